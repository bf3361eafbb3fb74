"""`infer bench gdn`'s measurements: one GDN layer's gated delta rule per backend, prefill and decode,
against the floor it cannot beat on this device.

- Prefill: one request of L tokens, or 8 requests of unequal lengths summing to L (varlen), from
  zero state, read from and written to pool slots. Floor: the larger of the bytes it must move
  (q, k, v, g, β in, o out, each sequence's state in and out) at the measured copy bandwidth, and
  the FLOPs of the chunked form at the measured bf16 matmul rate. The FLOP count is a model of the
  chunked algorithm (chunk C = 64; per token and value head ``2·(3·C·K + 2·C·V + 3·K·V)``: the
  within-chunk ``k·kᵀ``, ``q·kᵀ``, the WY products for ``w`` and ``u``, the state's three products),
  not a count of what any one kernel issues.
- Decode: one step of N sequences (one token each). Floor: the bytes (each state read and
  written once, fp32, plus the token's q, k, v, o) at the copy bandwidth.

Times are `timing.device_ms` (median, L2 flushed before each call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from infer_cli.bench.timing import copy_gb_per_s, cuda_device, device_ms, matmul_tflops, versions
from kernels.gdn import GDNBackend, GDNGeometry, StateRows, available_gdn_backends

# The GDN layer of the synthetic presets (models/synth/families/qwen35.py, from the published
# configs in shared/presets.md). 4B and 9B share it; they differ in hidden size, which the GDN
# kernels never see.
GEOMETRIES: dict[str, GDNGeometry] = {
    "4b": GDNGeometry(key_heads=16, value_heads=32, key_dim=128, value_dim=128),
    "9b": GDNGeometry(key_heads=16, value_heads=32, key_dim=128, value_dim=128),
}
PREFILL_TOKENS = (1024, 8192, 32768)
DECODE_BATCHES = (1, 64)
VARLEN_REQUESTS = 8
CHUNK = 64


@dataclass(frozen=True, slots=True)
class GDNTiming:
    backend: str
    geometry: str
    phase: str
    shape: str
    tokens: int
    median_ms: float
    tokens_per_s: float
    floor_ms: float
    floor_kind: str  # "bandwidth" or "matmul": the binding one
    floor_fraction: float


@dataclass(frozen=True, slots=True)
class GDNBenchResult:
    device: str
    dtype: str
    copy_gb_per_s: float
    matmul_tflops: float
    versions: dict[str, str]
    backends: dict[str, str]  # name → what runs each phase
    refused: dict[str, str]
    timings: tuple[GDNTiming, ...]

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def varlen_lengths(total: int, requests: int = VARLEN_REQUESTS) -> tuple[int, ...]:
    """``requests`` unequal lengths (proportional to 1, 2, …, n) summing to ``total``."""
    weights = range(1, requests + 1)
    lengths = [max(1, total * w // sum(weights)) for w in weights]
    lengths[-1] += total - sum(lengths)
    return tuple(lengths)


def prefill_flops(geometry: GDNGeometry, tokens: int) -> float:
    k, v = geometry.key_dim, geometry.value_dim
    return float(tokens * geometry.value_heads * 2 * (3 * CHUNK * k + 2 * CHUNK * v + 3 * k * v))


def moved_bytes(geometry: GDNGeometry, tokens: int, sequences: int, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    per_token = size * (
        2 * geometry.key_heads * geometry.key_dim + 2 * geometry.value_heads * geometry.value_dim
    )
    per_token += 4 * geometry.value_heads + size * geometry.value_heads  # g fp32, β in the storage dtype
    state = 2 * 4 * geometry.value_heads * geometry.value_dim * geometry.key_dim
    return tokens * per_token + sequences * state


def _inputs(
    geometry: GDNGeometry, tokens: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(tokens, geometry.key_heads, geometry.key_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(tokens, geometry.key_heads, geometry.key_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(tokens, geometry.value_heads, geometry.value_dim, generator=gen, device=device).to(dtype)
    # Decay and write strengths in the synthetic checkpoints' range (A in [1, 16], softplus ≈ 1).
    g = -(1.0 + 15.0 * torch.rand(tokens, geometry.value_heads, generator=gen, device=device))
    beta = torch.rand(tokens, geometry.value_heads, generator=gen, device=device).to(dtype)
    return q, k, v, g, beta


def _call(
    backend: GDNBackend,
    geometry: GDNGeometry,
    lengths: Sequence[int] | None,
    sequences: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Callable[[], object]:
    tokens = sum(lengths) if lengths is not None else sequences
    q, k, v, g, beta = _inputs(geometry, tokens, dtype, device)
    pool = torch.zeros(
        (sequences + 1, geometry.value_heads, geometry.value_dim, geometry.key_dim), device=device
    )
    slots = torch.arange(1, sequences + 1, device=device)
    if lengths is None:
        rows = StateRows(slots, torch.zeros(sequences, dtype=torch.bool, device=device))
    else:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        rows = StateRows(slots, torch.ones(sequences, dtype=torch.bool, device=device), tuple(bounds))
    return lambda: backend.delta_rule(q, k, v, g, beta, rows, pool)


def run_gdn_bench(
    backend_names: Sequence[str] | None,
    geometry_names: Sequence[str],
    prefill_tokens: Sequence[int],
    decode_batches: Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    on_step: Callable[[str], None] | None = None,
) -> GDNBenchResult:
    device = cuda_device()
    built, refused = available_gdn_backends(device)
    if backend_names is not None:
        unknown = [name for name in backend_names if name not in built and name not in refused]
        if unknown:
            raise ValueError(f"unknown GDN backend(s) {unknown}: choose from torch, fla, flashinfer")
        built = {name: b for name, b in built.items() if name in backend_names}
        refused = {name: why for name, why in refused.items() if name in backend_names}
    copy = copy_gb_per_s(device)
    tflops = matmul_tflops(device)
    timings = []
    for geometry_name in geometry_names:
        geometry = GEOMETRIES[geometry_name]
        for name, backend in built.items():
            backend.warm_up(geometry, dtype, device)
            cases: list[tuple[str, str, Sequence[int] | None, int]] = []
            for total in prefill_tokens:
                cases.append(("prefill", f"1 × {total}", (total,), 1))
                cases.append(
                    (
                        "prefill",
                        f"{VARLEN_REQUESTS} varlen, Σ {total}",
                        varlen_lengths(total),
                        VARLEN_REQUESTS,
                    )
                )
            for batch in decode_batches:
                cases.append(("decode", f"batch {batch}", None, batch))
            for phase, shape, lengths, sequences in cases:
                if on_step is not None:
                    on_step(f"{name} {geometry_name} {phase} {shape}")
                tokens = sum(lengths) if lengths is not None else sequences
                ms = device_ms(_call(backend, geometry, lengths, sequences, dtype, device))
                bandwidth_ms = moved_bytes(geometry, tokens, sequences, dtype) / (copy * 1e9) * 1e3
                matmul_ms = (
                    prefill_flops(geometry, tokens) / (tflops * 1e12) * 1e3 if phase == "prefill" else 0.0
                )
                floor_ms, kind = max((bandwidth_ms, "bandwidth"), (matmul_ms, "matmul"))
                timings.append(
                    GDNTiming(
                        backend=name,
                        geometry=geometry_name,
                        phase=phase,
                        shape=shape,
                        tokens=tokens,
                        median_ms=ms,
                        tokens_per_s=tokens / (ms * 1e-3),
                        floor_ms=floor_ms,
                        floor_kind=kind,
                        floor_fraction=floor_ms / ms,
                    )
                )
    return GDNBenchResult(
        device=torch.cuda.get_device_name(device),
        dtype=str(dtype).removeprefix("torch."),
        copy_gb_per_s=copy,
        matmul_tflops=tflops,
        versions=versions(),
        backends={name: b.describe() for name, b in built.items()},
        refused=refused,
        timings=tuple(timings),
    )
