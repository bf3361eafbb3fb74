"""Timing of the skinny GEMM against cuBLAS on the decode projections (`infer bench gemm`).

Shapes: every projection of Qwen3-4B and Gemma 4 12B, read from the synthetic-checkpoint presets
(`models.synth.families`, dimensions in shared/presets.md): fused QKV (Gemma's global layers: Q and
K only, K = V), O, fused gate/up, down, and the (tied) LM head. Rows: M = 1, 2, 4, 8, 16, 32, 64.

How one figure is taken: a CUDA graph holds a chain of the same GEMM over ``chain_copies`` distinct
copies of the weight, and `timing.device_ms` (the one device timer: median, L2 flushed before each
replay) times its replay; the chain time over the copies is the figure per GEMM. The copies hold
at least 4× the device's L2 (50 MB on an H200) and are at least 8: no copy can still be in L2 when
it is read, whatever the flush leaves, and the chain has at least 7 boundaries between GEMMs, which
is where a launch ramps up and drains and where PDL acts (perf-notes 2.1: the per-kernel loss, not
the launch, is what separates the kernels). One GEMM alone would time the graph launch and a cold
start instead. A QKV weight (31 MB) gets 8 copies (4 × 50 MiB is 6.7 copies; at least 8), the O
projection (21 MB) 10.

The floor of a GEMM is its bytes (the weight, the activations read, the output written, once each)
over the device-to-device copy bandwidth measured in the same run (`timing.copy_gb_per_s`, read +
write); "% of floor" is floor time over measured time. For the skinny kernel, every candidate of
`kernels.gemm.skinny_candidates` is timed and one per weight shape is kept, the one with the lowest
mean time-over-floor across the measured row counts, never one per row count (that would change the
K partition with M and lose batch invariance). The row count picks the fastest of cuBLAS, that one,
and the fused decode GEMV and MMA below (where they were timed): the dispatch table
(`kernels.gemm.skinny_dispatch`, `dispatch_table`).

The fused decode GEMV (`kernels.triton.fused_gemv`, plain `x @ w.T`, its settings a function of the
shape) is a third candidate per shape at the row counts it takes (M ≤ its ``MAX_ROWS``, 4). The
fused decode MMA (`kernels.triton.fused_mma`, plain `x @ w.T` on tensor cores) is the fourth at the
row counts above that (5-64): every one of its candidates (`fused_mma.mma_candidates`) is timed, and
one is kept per shape and row block (16 rows up to M = 16, 64 above), by the same rule as the skinny
kernel's (lowest mean time-over-floor over the block's measured row counts; never one per M, which
would change a row's bits with M). Both, plain, are dispatch choices ("gemv"; "mma" with the kept
settings of the row count's block); the fusions reach the models only through `--decode-fusion`
(kernels/gemm/projections.py).

Then, per model and row count, the whole decode chain (every projection of every layer once, in model
order, then the LM head; each weight its own tensor) graphed three ways: all cuBLAS, all ours, and
`SkinnyDispatch` over this run's table; and, for Qwen3 at every M ≤ 64, the fused decode layer chain:
per layer norm + QKV, O + residual, norm + gate/up + SiLU·mul, down + residual (``FUSED_LAYER``), then
the LM head as a plain fused launch, each through the fused GEMV at M ≤ 4 and the fused MMA (its
default settings, ``mma_settings``) above, as ``FusedDecodeProjections`` routes them. That chain does
the layer's norms, residual adds and activation too, which the cuBLAS chain leaves out; its floor is
the same projection bytes (the norm weights and residual rows it also reads are under 0.01 % of them).

A graph that fails (a setting Triton cannot build on this device, out of resources) is recorded as a
`Failure` and the run goes on without it; a candidate that failed at any row count is not chosen.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import TypeVar

import torch
import torch.nn.functional as F

from infer_cli.bench.timing import copy_gb_per_s as copy_bandwidth
from infer_cli.bench.timing import cuda_device, graph_us, versions
from kernels.gemm.skinny_candidates import candidate_settings
from kernels.gemm.skinny_dispatch import Backend, ChoiceTable, ShapeChoice, SkinnyDispatch, dtype_name
from kernels.reference import GatedActivation, NormSpec, NormWeight
from kernels.triton.fused_gemv import MAX_ROWS as FUSED_MAX_ROWS
from kernels.triton.fused_gemv import Fusion
from kernels.triton.fused_mma import MAX_ROWS as MMA_MAX_ROWS
from kernels.triton.fused_mma import ROW_BLOCKS, MmaSettings, mma_candidates, row_block
from kernels.triton.skinny_gemm import MAX_ROWS, SkinnySettings
from kernels.triton.storage import pdl_supported
from models.synth.families.gemma4 import GEMMA4
from models.synth.families.qwen3 import QWEN3
from models.synth.families.qwen35 import QWEN35

MODEL_NAMES: tuple[str, ...] = ("qwen3-4b", "gemma4-12b", "qwen35-4b")
# Qwen3's decode layer through the fused GEMV, by projection name (models/qwen3/model.py).
_QWEN3_NORM = NormSpec(NormWeight.W, round_before_weight=True)
FUSED_LAYER: dict[str, Fusion] = {
    "qkv": Fusion(norm=_QWEN3_NORM),
    "o": Fusion(residual=True),
    "gate-up": Fusion(norm=_QWEN3_NORM, activation=GatedActivation.SILU),
    "down": Fusion(residual=True),
    "lm-head": Fusion(),
}
MIN_COPIES = 8
Settings = TypeVar("Settings", SkinnySettings, MmaSettings)
L2_MULTIPLE = 4


# ----------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection weight shape [n, k] of a model, and how many a decode step multiplies."""

    model: str
    name: str
    n: int
    k: int
    per_step: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


def qwen3_projections(preset: str = "4b") -> tuple[Projection, ...]:
    f = QWEN3.preset(preset).fields
    model = f"qwen3-{preset}"
    hidden, layers, head = f["hidden_size"], f["num_hidden_layers"], f["head_dim"]
    q, kv = f["num_attention_heads"] * head, f["num_key_value_heads"] * head
    return (
        Projection(model, "qkv", q + 2 * kv, hidden, layers),
        Projection(model, "o", hidden, q, layers),
        Projection(model, "gate-up", 2 * f["intermediate_size"], hidden, layers),
        Projection(model, "down", hidden, f["intermediate_size"], layers),
        Projection(model, "lm-head", f["vocab_size"], hidden, 1),
    )


def gemma4_projections(preset: str = "12b") -> tuple[Projection, ...]:
    f = GEMMA4.preset(preset).fields
    model = f"gemma4-{preset}"
    hidden, heads = f["hidden_size"], f["num_attention_heads"]
    kinds = list(f["layer_types"])
    sliding, full = kinds.count("sliding_attention"), kinds.count("full_attention")
    q_s, kv_s = heads * f["head_dim"], f["num_key_value_heads"] * f["head_dim"]
    q_g, kv_g = heads * f["global_head_dim"], f["num_global_key_value_heads"] * f["global_head_dim"]
    global_qkv = q_g + (kv_g if f["attention_k_eq_v"] else 2 * kv_g)  # K = V: no V projection
    return (
        Projection(model, "qkv", q_s + 2 * kv_s, hidden, sliding),
        Projection(model, "o", hidden, q_s, sliding),
        Projection(model, "qk-global", global_qkv, hidden, full),
        Projection(model, "o-global", hidden, q_g, full),
        Projection(model, "gate-up", 2 * f["intermediate_size"], hidden, len(kinds)),
        Projection(model, "down", hidden, f["intermediate_size"], len(kinds)),
        Projection(model, "lm-head", f["vocab_size"], hidden, 1),
    )


def qwen35_projections(preset: str = "4b") -> tuple[Projection, ...]:
    """A GDN layer's in_proj (qkv | z | b | a, as models/qwen35 concatenates them) and out_proj; a
    gated full-attention layer's QKV (q and its gate per head) and O; every layer's MLP."""
    f = QWEN35.preset(preset).fields
    model = f"qwen35-{preset}"
    hidden, head = f["hidden_size"], f["head_dim"]
    kinds = list(f["layer_types"])
    gdn, full = kinds.count("linear_attention"), kinds.count("full_attention")
    key_dim = f["linear_num_key_heads"] * f["linear_key_head_dim"]
    value_dim = f["linear_num_value_heads"] * f["linear_value_head_dim"]
    in_proj = 2 * key_dim + value_dim + value_dim + 2 * f["linear_num_value_heads"]
    q = f["num_attention_heads"] * head
    gated_q = 2 * q if f["attn_output_gate"] else q
    return (
        Projection(model, "in-proj", in_proj, hidden, gdn),
        Projection(model, "out-proj", hidden, value_dim, gdn),
        Projection(model, "qkv", gated_q + 2 * f["num_key_value_heads"] * head, hidden, full),
        Projection(model, "o", hidden, q, full),
        Projection(model, "gate-up", 2 * f["intermediate_size"], hidden, len(kinds)),
        Projection(model, "down", hidden, f["intermediate_size"], len(kinds)),
        Projection(model, "lm-head", f["vocab_size"], hidden, 1),
    )


def model_projections(model: str) -> tuple[Projection, ...]:
    if model == "qwen3-4b":
        return qwen3_projections("4b")
    if model == "gemma4-12b":
        return gemma4_projections("12b")
    if model == "qwen35-4b":
        return qwen35_projections("4b")
    raise ValueError(f"model {model!r} is not benchmarked; choose one of {', '.join(MODEL_NAMES)}")


def decode_chain(model: str) -> list[Projection]:
    """Every GEMM of one decode step in model order: per layer its projections, then the LM head."""
    if model == "qwen3-4b":
        qkv, o, gate_up, down, head = qwen3_projections("4b")
        return [qkv, o, gate_up, down] * qkv.per_step + [head]
    if model == "qwen35-4b":
        in_proj, out_proj, qkv, o, gate_up, down, head = qwen35_projections("4b")
        kinds = QWEN35.preset("4b").fields["layer_types"]
        mixers = {"linear_attention": (in_proj, out_proj), "full_attention": (qkv, o)}
    else:
        qkv, o, qk_g, o_g, gate_up, down, head = model_projections(model)
        kinds = GEMMA4.preset("12b").fields["layer_types"]
        mixers = {"sliding_attention": (qkv, o), "full_attention": (qk_g, o_g)}
    chain: list[Projection] = []
    for kind in kinds:
        chain += [*mixers[kind], gate_up, down]
    return [*chain, head]


# ------------------------------------------------------------------------------------------- bytes


def gemm_bytes(n: int, k: int, m: int, element: int = 2) -> int:
    """What one GEMM must move at least: the weight and x read once, y written once."""
    return (n * k + m * k + m * n) * element


def chain_bytes(chain: Sequence[Projection], m: int, element: int = 2) -> int:
    return sum(gemm_bytes(p.n, p.k, m, element) for p in chain)


def chain_copies(weight_bytes: int, l2_bytes: int) -> int:
    """Distinct weight copies in one timed chain: at least ``L2_MULTIPLE`` × L2 and ``MIN_COPIES``."""
    return max(MIN_COPIES, math.ceil(L2_MULTIPLE * l2_bytes / weight_bytes))


# ----------------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class GemmTiming:
    """One shape at one row count: cuBLAS against the shape's chosen skinny settings and the GEMV."""

    model: str
    name: str
    n: int
    k: int
    rows: int
    cublas_us: float
    ours_us: float
    floor_us: float
    settings: str
    fused_us: float | None = None  # the fused GEMV; None above its MAX_ROWS or where it failed
    mma_us: float | None = None  # the fused MMA's kept settings for this row block; None: not run
    mma_settings: str | None = None  # their label

    @property
    def cublas_floor_pct(self) -> float:
        return 100 * self.floor_us / self.cublas_us

    @property
    def ours_floor_pct(self) -> float:
        return 100 * self.floor_us / self.ours_us

    @property
    def fused_floor_pct(self) -> float | None:
        return None if self.fused_us is None else 100 * self.floor_us / self.fused_us

    @property
    def mma_floor_pct(self) -> float | None:
        return None if self.mma_us is None else 100 * self.floor_us / self.mma_us

    @property
    def winner(self) -> Backend:
        """The fastest backend of those timed (the MMA where its kept settings are named too); on a
        tie the earlier of cuBLAS, ours, the GEMV, the MMA."""
        times = [(self.cublas_us, Backend.CUBLAS), (self.ours_us, Backend.OURS)]
        if self.fused_us is not None:
            times.append((self.fused_us, Backend.GEMV))
        if self.mma_us is not None and self.mma_settings is not None:
            times.append((self.mma_us, Backend.MMA))
        return min(times, key=lambda timed: timed[0])[1]


@dataclass(frozen=True, slots=True)
class CandidateTiming:
    n: int
    k: int
    rows: int
    settings: str
    us: float


@dataclass(frozen=True, slots=True)
class ChainTiming:
    """A model's whole decode chain of GEMMs at one row count (None: that graph failed)."""

    model: str
    rows: int
    gemms: int
    bytes_moved: int
    cublas_us: float | None
    ours_us: float | None
    best_us: float | None
    floor_us: float
    fused_us: float | None = None  # the fused decode layer chain (Qwen3, M ≤ 64)

    def floor_pct(self, us: float | None) -> float | None:
        return None if us is None else 100 * self.floor_us / us


@dataclass(frozen=True, slots=True)
class Failure:
    """A graph that could not be built or timed; the run goes on without it."""

    what: str
    error: str


@dataclass(frozen=True, slots=True)
class GemmBenchResult:
    device: str
    dtype: str
    copy_gb_per_s: float
    l2_bytes: int
    pdl: bool  # whether launches asking for PDL got it on this device and Triton
    rows: tuple[int, ...]
    projections: tuple[Projection, ...]
    chosen: tuple[tuple[tuple[int, int], SkinnySettings], ...]
    timings: tuple[GemmTiming, ...]
    candidates: tuple[CandidateTiming, ...]
    chains: tuple[ChainTiming, ...]
    failures: tuple[Failure, ...]
    measured_at: str
    complete: bool = True

    def dispatch_table(self) -> ChoiceTable:
        return dispatch_table(self.chosen, self.timings, self.dtype, self.device, self.measured_at)

    def to_json(self) -> dict[str, object]:
        return {
            "measured_at": self.measured_at,
            "device": self.device,
            **versions(),
            "dtype": self.dtype,
            "copy_gb_per_s": self.copy_gb_per_s,
            "l2_bytes": self.l2_bytes,
            "pdl": self.pdl,
            "rows": list(self.rows),
            "projections": [asdict(p) for p in self.projections],
            "chosen": [
                {"n": n, "k": k, "label": s.label, "settings": s.to_json()} for (n, k), s in self.chosen
            ],
            "timings": [
                asdict(t)
                | {"cublas_floor_pct": t.cublas_floor_pct, "ours_floor_pct": t.ours_floor_pct}
                | {"fused_floor_pct": t.fused_floor_pct, "mma_floor_pct": t.mma_floor_pct}
                | {"winner": t.winner.value}
                for t in self.timings
            ],
            "candidates": [asdict(c) for c in self.candidates],
            "chains": [asdict(c) for c in self.chains],
            "failures": [asdict(f) for f in self.failures],
            "complete": self.complete,
        }


def choose_settings(times: Mapping[Settings, Mapping[int, float]], floors: Mapping[int, float]) -> Settings:
    """The candidate with the lowest mean time-over-floor across the row counts (one per shape, or
    per shape and row block)."""
    if not times:
        raise ValueError("no candidate was timed")

    def score(settings: Settings) -> float:
        per_row = times[settings]
        return sum(per_row[m] / floors[m] for m in floors) / len(floors)

    return min(times, key=score)


def dispatch_table(
    chosen: Sequence[tuple[tuple[int, int], SkinnySettings]],
    timings: Sequence[GemmTiming],
    dtype: str,
    device: str = "",
    measured_at: str = "",
) -> ChoiceTable:
    """Per shape its chosen skinny settings; per measured row count the backend with the smallest
    time (``GemmTiming.winner``: cuBLAS, the skinny kernel, the GEMV where it was timed, M ≤ 4, and
    the MMA with its kept settings where it was timed, 5-64; a tie goes to the earlier of them, so
    the MMA is chosen only where it was strictly the fastest), and for each row count choosing the
    MMA the settings it was timed with (one per shape and row block, as the bench keeps them)."""
    shapes = []
    for (n, k), settings in chosen:
        timed = sorted((t for t in timings if (t.n, t.k) == (n, k)), key=lambda t: t.rows)
        if timed:
            rows = tuple((t.rows, t.winner) for t in timed)
            mma = tuple(
                (t.rows, MmaSettings.from_label(t.mma_settings))
                for t in timed
                if t.winner is Backend.MMA and t.mma_settings is not None
            )
            shapes.append(ShapeChoice(n, k, dtype, settings, rows, mma))
    return ChoiceTable(shapes=tuple(shapes), device=device, measured_at=measured_at)


def saved_dispatch_table(saved: Mapping[str, object]) -> ChoiceTable:
    """``dispatch_table`` of a result saved by ``--save-result`` (``GemmBenchResult.to_json``): the
    table ``--save-dispatch`` wrote in that run, or, for a result saved before a backend joined the
    choice, the table the choice of this code makes from the same timings."""
    chosen = saved.get("chosen")
    timings = saved.get("timings")
    if not isinstance(chosen, list) or not isinstance(timings, list):
        raise ValueError("a saved gemm result has 'chosen' and 'timings' lists")
    names = {f.name for f in fields(GemmTiming)}
    return dispatch_table(
        [((c["n"], c["k"]), SkinnySettings.from_json(c["settings"])) for c in chosen],
        [GemmTiming(**{key: value for key, value in t.items() if key in names}) for t in timings],
        str(saved["dtype"]),
        str(saved.get("device", "")),
        str(saved.get("measured_at", "")),
    )


# ------------------------------------------------------------------------------------------ timing


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, scale: float) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device) * scale


def _timed(what: str, calls: Sequence[Callable[[], object]], failures: list[Failure]) -> float | None:
    """``graph_us(calls)``, or None with the failure recorded (one bad setting must not end the run)."""
    try:
        return graph_us(calls)
    except Exception as exc:  # a compile error, out of resources, or a refused shape: keep going
        failures.append(Failure(what, f"{type(exc).__name__}: {exc}"))
        return None


@dataclass(frozen=True, slots=True)
class ShapeResult:
    chosen: SkinnySettings | None  # None: no candidate ran at every row count
    timings: tuple[GemmTiming, ...]
    candidates: tuple[CandidateTiming, ...]


def time_projection(
    projection: Projection,
    rows: Sequence[int],
    device: torch.device,
    dtype: torch.dtype,
    copy_gb_per_s: float,
    l2_bytes: int,
    failures: list[Failure],
    on_step: Callable[[str], None] | None = None,
) -> ShapeResult:
    """cuBLAS, every candidate and the fused GEMV or MMA at every row count; the candidates kept
    (module doc)."""
    from kernels.triton.fused_gemv import fused_gemv
    from kernels.triton.fused_mma import fused_mma
    from kernels.triton.skinny_gemm import skinny_gemm

    n, k = projection.shape
    element = torch.empty((), dtype=dtype).element_size()
    copies = chain_copies(n * k * element, l2_bytes)
    weights = [_random((n, k), dtype, device, k**-0.5) for _ in range(copies)]
    floors = {m: gemm_bytes(n, k, m, element) / (copy_gb_per_s * 1e3) for m in rows}  # µs
    cublas: dict[int, float] = {}
    fused: dict[int, float] = {}
    ours: dict[SkinnySettings, dict[int, float]] = {s: {} for s in candidate_settings(n, k)}
    # The fused MMA's candidates per row block, each timed at that block's row counts.
    mma_rows = {block: [m for m in rows if _mma_takes(m) and row_block(m) == block] for block in ROW_BLOCKS}
    mma: dict[int, dict[MmaSettings, dict[int, float]]] = {
        block: {s: {} for s in mma_candidates(n, k, block, element=element)}
        for block, ms in mma_rows.items()
        if ms
    }
    for m in rows:
        x = _random((m, k), dtype, device, 1.0)
        what = f"[{n}, {k}] M={m}"
        us = _timed(f"{what} cuBLAS", [partial(F.linear, x, w) for w in weights], failures)
        if us is not None:
            cublas[m] = us / copies
        if on_step is not None:
            on_step(f"{projection.model} {projection.name} M={m} cuBLAS")
        if m <= FUSED_MAX_ROWS:
            us = _timed(f"{what} fused GEMV", [partial(fused_gemv, x, w) for w in weights], failures)
            if us is not None:
                fused[m] = us / copies
            if on_step is not None:
                on_step(f"{projection.model} {projection.name} M={m} fused GEMV")
        for mma_settings, per_row in mma.get(row_block(m), {}).items() if _mma_takes(m) else ():
            calls = [partial(fused_mma, x, w, Fusion(), mma_settings) for w in weights]
            us = _timed(f"{what} fused MMA {mma_settings.label}", calls, failures)
            if us is not None:
                per_row[m] = us / copies
            if on_step is not None:
                on_step(f"{projection.model} {projection.name} M={m} fused MMA {mma_settings.label}")
        for settings, per_row in ours.items():
            calls = [partial(skinny_gemm, x, w, settings) for w in weights]
            us = _timed(f"{what} {settings.label}", calls, failures)
            if us is not None:
                per_row[m] = us / copies
            if on_step is not None:
                on_step(f"{projection.model} {projection.name} M={m} {settings.label}")
    del weights
    torch.cuda.empty_cache()
    candidates = tuple(
        CandidateTiming(n, k, m, s.label, us) for s, per_row in ours.items() for m, us in per_row.items()
    ) + tuple(
        CandidateTiming(n, k, m, f"mma·{s.label}", us)
        for per_block in mma.values()
        for s, per_row in per_block.items()
        for m, us in per_row.items()
    )
    mma_kept: dict[int, MmaSettings] = {}
    for block, per_block in mma.items():
        ran = {s: per_row for s, per_row in per_block.items() if len(per_row) == len(mma_rows[block])}
        if ran:
            mma_kept[block] = choose_settings(ran, {m: floors[m] for m in mma_rows[block]})
    complete = {s: per_row for s, per_row in ours.items() if len(per_row) == len(rows)}
    if not complete:
        return ShapeResult(None, (), candidates)
    chosen = choose_settings(complete, floors)

    def mma_kept_at(m: int) -> MmaSettings | None:
        return mma_kept.get(row_block(m)) if _mma_takes(m) else None

    timings = tuple(
        GemmTiming(
            projection.model,
            projection.name,
            n,
            k,
            m,
            cublas[m],
            ours[chosen][m],
            floors[m],
            chosen.label,
            fused.get(m),
            None if (kept := mma_kept_at(m)) is None else mma[row_block(m)][kept][m],
            None if kept is None else kept.label,
        )
        for m in rows
        if m in cublas
    )
    return ShapeResult(chosen, timings, candidates)


def _mma_takes(m: int) -> bool:
    """Whether the fused MMA is timed at ``m`` rows: above the fused GEMV's rows, up to its own."""
    return FUSED_MAX_ROWS < m <= MMA_MAX_ROWS


def time_decode_chain(
    model: str,
    chain: Sequence[Projection],
    m: int,
    chosen: Mapping[tuple[int, int], SkinnySettings],
    weights: Sequence[torch.Tensor],
    dispatch: SkinnyDispatch,
    dtype: torch.dtype,
    copy_gb_per_s: float,
    failures: list[Failure],
) -> ChainTiming:
    """One model's decode chain at ``m`` rows: all cuBLAS, all ours, and the dispatch."""
    from kernels.triton.skinny_gemm import skinny_gemm

    device = weights[0].device
    xs = {k: _random((m, k), dtype, device, 1.0) for k in {p.k for p in chain}}
    what = f"{model} decode chain M={m}"
    cublas = _timed(f"{what} cuBLAS", [partial(F.linear, xs[w.shape[1]], w) for w in weights], failures)
    ours: float | None = None
    missing = sorted({p.shape for p in chain} - set(chosen))
    if missing:
        failures.append(Failure(f"{what} ours", f"no skinny settings ran for {missing}"))
    else:
        calls = [
            partial(skinny_gemm, xs[w.shape[1]], w, chosen[p.shape])
            for p, w in zip(chain, weights, strict=True)
        ]
        ours = _timed(f"{what} ours", calls, failures)
    best = _timed(f"{what} dispatch", [partial(dispatch, xs[w.shape[1]], w) for w in weights], failures)
    layer_calls = fused_chain_calls(chain, m, weights)
    fused = None if layer_calls is None else _timed(f"{what} fused layers", layer_calls, failures)
    moved = chain_bytes(chain, m, torch.empty((), dtype=dtype).element_size())
    floor = moved / (copy_gb_per_s * 1e3)
    return ChainTiming(model, m, len(chain), moved, cublas, ours, best, floor, fused)


def fused_chain_calls(
    chain: Sequence[Projection], m: int, weights: Sequence[torch.Tensor]
) -> list[Callable[[], object]] | None:
    """The decode chain as fused launches (``FUSED_LAYER`` by projection name): the fused GEMV at
    ``m`` ≤ its ``MAX_ROWS``, the fused MMA above; or None where the chain has a projection without
    a fused op (Gemma 4: its post-norms need the whole delta row) or ``m`` is above the fused MMA's
    ``MAX_ROWS``. Inputs are fixed tensors per width, as in the other chains: the launches do not
    read each other's outputs."""
    from kernels.triton.fused_gemv import fused_gemv
    from kernels.triton.fused_mma import fused_mma

    if m > MMA_MAX_ROWS or any(p.name not in FUSED_LAYER for p in chain):
        return None
    launch = fused_gemv if m <= FUSED_MAX_ROWS else fused_mma
    device, dtype = weights[0].device, weights[0].dtype
    widths = {p.k for p in chain} | {p.n for p in chain if FUSED_LAYER[p.name].residual}
    xs = {width: _random((m, width), dtype, device, 1.0) for width in widths}
    norm_weights = {p.k: 1 + _random((p.k,), dtype, device, 0.1) for p in chain if FUSED_LAYER[p.name].norm}
    calls: list[Callable[[], object]] = []
    for p, w in zip(chain, weights, strict=True):
        fusion = FUSED_LAYER[p.name]
        norm_weight = norm_weights[p.k] if fusion.norm is not None else None
        residual = xs[p.n] if fusion.residual else None
        calls.append(partial(launch, xs[p.k], w, fusion, norm_weight=norm_weight, residual=residual))
    return calls


@dataclass(frozen=True, slots=True)
class GemmBenchPlan:
    """What one run measures: each weight shape once, and the decode chains (empty: none)."""

    rows: tuple[int, ...]
    projections: tuple[Projection, ...]
    chains: tuple[tuple[str, tuple[Projection, ...]], ...]

    @property
    def steps(self) -> int:
        """Progress steps: the copy bandwidth, each timed graph of the shapes, each chain row count."""
        per_row = sum(1 + len(candidate_settings(p.n, p.k)) for p in self.projections)
        fused = len(self.projections) * sum(1 for m in self.rows if m <= FUSED_MAX_ROWS)
        mma = sum(
            len(mma_candidates(p.n, p.k, row_block(m)))
            for p in self.projections
            for m in self.rows
            if _mma_takes(m)
        )
        return 1 + per_row * len(self.rows) + fused + mma + len(self.chains) * len(self.rows)


def gemm_bench_plan(models: Sequence[str], rows: Sequence[int], *, chains: bool = True) -> GemmBenchPlan:
    """The plan for ``models`` (each shape once, under the first model that has it)."""
    if any(m < 1 or m > MAX_ROWS for m in rows):
        raise ValueError(f"row counts {tuple(rows)}: each must lie in 1..{MAX_ROWS}")
    unique: dict[tuple[int, int], Projection] = {}
    for model in models:
        for p in model_projections(model):
            unique.setdefault(p.shape, p)
    return GemmBenchPlan(
        rows=tuple(rows),
        projections=tuple(unique.values()),
        chains=tuple((model, tuple(decode_chain(model))) for model in models) if chains else (),
    )


def device_facts(device: torch.device) -> tuple[str, int]:
    """The device's name and L2 size in bytes."""
    properties = torch.cuda.get_device_properties(device)
    return torch.cuda.get_device_name(device), int(getattr(properties, "L2_cache_size", 50 << 20))


def run_gemm_bench(
    plan: GemmBenchPlan,
    dtype: torch.dtype = torch.bfloat16,
    on_step: Callable[[str], None] | None = None,
    on_partial: Callable[[GemmBenchResult], None] | None = None,
) -> GemmBenchResult:
    """Measure the copy bandwidth, every projection shape, then the decode chains (module doc).

    ``on_partial`` hears the result so far after each shape and each chain row count (the command
    writes it out, so a run stopped early still leaves what it measured)."""
    device = cuda_device()
    name, l2_bytes = device_facts(device)
    pdl = pdl_supported(device)
    copy_gb_per_s = copy_bandwidth(device)
    if on_step is not None:
        on_step("copy bandwidth")
    chosen: dict[tuple[int, int], SkinnySettings] = {}
    timings: list[GemmTiming] = []
    candidates: list[CandidateTiming] = []
    chains: list[ChainTiming] = []
    failures: list[Failure] = []
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    def result(complete: bool) -> GemmBenchResult:
        return GemmBenchResult(
            device=name,
            dtype=dtype_name(dtype),
            copy_gb_per_s=copy_gb_per_s,
            l2_bytes=l2_bytes,
            pdl=pdl,
            rows=plan.rows,
            projections=plan.projections,
            chosen=tuple(chosen.items()),
            timings=tuple(timings),
            candidates=tuple(candidates),
            chains=tuple(chains),
            failures=tuple(failures),
            measured_at=started,
            complete=complete,
        )

    for projection in plan.projections:
        shape = time_projection(
            projection, plan.rows, device, dtype, copy_gb_per_s, l2_bytes, failures, on_step
        )
        if shape.chosen is not None:
            chosen[projection.shape] = shape.chosen
        timings += shape.timings
        candidates += shape.candidates
        if on_partial is not None:
            on_partial(result(complete=False))
    dispatch = SkinnyDispatch(result(complete=False).dispatch_table())
    for model, chain in plan.chains:
        weights = [_random(p.shape, dtype, device, p.k**-0.5) for p in chain]
        for m in plan.rows:
            chains.append(
                time_decode_chain(model, chain, m, chosen, weights, dispatch, dtype, copy_gb_per_s, failures)
            )
            if on_step is not None:
                on_step(f"{model} decode chain M={m}")
            if on_partial is not None:
                on_partial(result(complete=False))
        del weights
        torch.cuda.empty_cache()
    return result(complete=True)
