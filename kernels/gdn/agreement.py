"""Whether a GDN backend computes the spec: output and final state against the fp64 spec, held to
a bound measured from the spec itself in the same run. The `gdn_backends_agree` gate and `auto`'s
start-up choice both use it.

The oracle is ``reference.gated_delta_rule`` run in fp64 on fp64 copies of the inputs. Bounds:

- fp32 inputs: the spec's own fp32 error times ``FP32_RATIO``. A chunked form reorders sums and
  solves a triangular system per chunk; tests/kernels/test_gdn_torch.py measured the torch chunked
  form at up to 48× the spec's error (strong decay, states), so 64.
- bf16 / fp16 inputs: the fast kernels store q̂ and k̂ after the L2 norm in the input dtype and keep
  their chunk intermediates in it. The unit of that error is measured here: the spec run on q and k
  replaced by their L2-normed values rounded once to the input dtype. The bound is ``LOW_RATIO``
  times the larger of that and the spec's own error on the same inputs (its output rounding).
  ``LOW_RATIO`` = 8 was set before any GPU run (one rounding of q̂, k̂ plus a few of the same size
  in the intermediates); the gate prints the measured ratios, and docs/kernels.md records them.
- fp32 inputs to a backend whose kernels round fp32 dot operands to TF32 (``fp32_dots == "tf32"``):
  the unit is the spec's error with q̂ and k̂ rounded once to TF32 (10 mantissa bits, nearest-even),
  measured here, and the bound is ``TF32_RATIO`` times it. fla-core rounds only the merges of its
  triangular solve, fewer roundings than every q̂ and k̂, so 1: on the H200 (2026-12-04) fla's fp32
  prefill measured 1.24e-5 where TF32 dots throughout measured 5.2e-4; docs/kernels.md has the
  unit's size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels import reference
from kernels.gdn.base import GDNBackend, GDNGeometry, StateRows

FP32_RATIO = 64.0
LOW_RATIO = 8.0
TF32_RATIO = 1.0
# The gate's varlen batch (issue 19): single tokens, chunk edges at 64 and 128, one long prompt.
GATE_LENGTHS: tuple[int, ...] = (1, 2, 63, 64, 65, 127, 128, 4096)
# A per value head: mild keeps an initial state alive over the whole sequence, strong (the range
# synthetic checkpoints draw from) forgets it in a few tokens.
DECAYS = {"mild": (0.01, 0.3), "strong": (1.0, 16.0)}


@dataclass(frozen=True, slots=True)
class AgreementCase:
    """One batch: ``lengths`` per sequence (None: a decode step, one token per sequence, no host
    boundaries), from zero state or from a random initial state."""

    geometry: GDNGeometry
    lengths: tuple[int, ...] | None
    sequences: int
    with_initial: bool
    dtype: torch.dtype
    decay: str = "mild"
    seed: int = 0

    @property
    def label(self) -> str:
        shape = "decode" if self.lengths is None else "varlen " + "/".join(map(str, self.lengths))
        start = "initial state" if self.with_initial else "zero state"
        return f"{shape}, {self.sequences} seqs, {start}, {str(self.dtype).removeprefix('torch.')}, {self.decay} decay"


@dataclass(frozen=True, slots=True)
class Agreement:
    backend: str
    case: str
    err_out: float
    err_state: float
    bound_out: float
    bound_state: float
    # The spec's own errors (fp32 compute) and, for low-precision inputs, the q̂/k̂ rounding unit.
    spec_out: float
    spec_state: float
    unit_out: float
    unit_state: float

    @property
    def passed(self) -> bool:
        return self.err_out <= self.bound_out and self.err_state <= self.bound_state

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"{verdict} {self.backend:10s} {self.case}: out {self.err_out:.3g} ≤ {self.bound_out:.3g} "
            f"({self.err_out / max(self.unit_out, 1e-300):.2f}× unit), state {self.err_state:.3g} ≤ "
            f"{self.bound_state:.3g} ({self.err_state / max(self.unit_state, 1e-300):.2f}× unit); "
            f"spec {self.spec_out:.3g} / {self.spec_state:.3g}"
        )


@dataclass(frozen=True, slots=True)
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial: torch.Tensor | None
    bounds: tuple[int, ...]


def gate_cases(geometry: GDNGeometry, dtypes: Sequence[torch.dtype]) -> list[AgreementCase]:
    """The gate's batches: the varlen lengths and a 64-row decode step, with and without initial
    state, at each dtype and both decays."""
    cases = []
    for dtype, with_initial, decay in itertools.product(dtypes, (False, True), sorted(DECAYS)):
        cases.append(AgreementCase(geometry, GATE_LENGTHS, len(GATE_LENGTHS), with_initial, dtype, decay))
        cases.append(AgreementCase(geometry, None, 64, with_initial, dtype, decay, seed=1))
    return cases


def _make_inputs(case: AgreementCase, device: torch.device) -> _Inputs:
    geo = case.geometry
    lengths = case.lengths if case.lengths is not None else (1,) * case.sequences
    bounds = tuple(itertools.accumulate(lengths, initial=0))
    tokens = bounds[-1]
    gen = torch.Generator(device=device).manual_seed(1000 + case.seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = randn(tokens, geo.key_heads, geo.key_dim).to(case.dtype)
    k = randn(tokens, geo.key_heads, geo.key_dim).to(case.dtype)
    v = randn(tokens, geo.value_heads, geo.value_dim).to(case.dtype)
    a = randn(tokens, geo.value_heads)
    b = randn(tokens, geo.value_heads).to(case.dtype)
    low, high = DECAYS[case.decay]
    a_log = (low + (high - low) * torch.rand(geo.value_heads, generator=gen, device=device)).log()
    dt_bias = 0.5 + torch.rand(geo.value_heads, generator=gen, device=device)
    g, beta = reference.gdn_gates(a, b, a_log, dt_bias)
    initial = None
    if case.with_initial:
        initial = 0.3 * randn(len(lengths), geo.value_heads, geo.value_dim, geo.key_dim)
    return _Inputs(q, k, v, g, beta, initial, bounds)


def _spec(
    inputs: _Inputs, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    cast = (lambda t: t.to(dtype)) if dtype == torch.float64 else (lambda t: t)
    return reference.gated_delta_rule(
        cast(q),
        cast(k),
        cast(inputs.v),
        cast(inputs.g),
        cast(inputs.beta),
        inputs.bounds,
        None if inputs.initial is None else cast(inputs.initial),
        accumulate=dtype,
    )


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to TF32's 10 mantissa bits, nearest-even, kept in fp32."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    bits = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


class AgreementRun:
    """One case's inputs, oracle and bounds, computed once and checked against any backend."""

    def __init__(self, case: AgreementCase, device: torch.device) -> None:
        self.case = case
        self.device = device
        self.inputs = _make_inputs(case, device)
        x = self.inputs
        self.want_out, self.want_state = _spec(x, x.q, x.k, torch.float64)
        spec_out, spec_state = _spec(x, x.q, x.k, torch.float32)
        self.spec_out, self.spec_state = _err(spec_out, self.want_out), _err(spec_state, self.want_state)
        self.tf32_unit: tuple[float, float] | None = None
        if case.dtype == torch.float32:
            self.unit_out, self.unit_state = self.spec_out, self.spec_state
            self.bound_out, self.bound_state = FP32_RATIO * self.spec_out, FP32_RATIO * self.spec_state
            self.tf32_unit = self._rounded_unit(round_to_tf32)
        else:
            self.unit_out, self.unit_state = self._rounded_unit(lambda t: t.to(case.dtype))
            self.bound_out, self.bound_state = LOW_RATIO * self.unit_out, LOW_RATIO * self.unit_state

    def _rounded_unit(self, rounding: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, float]:
        """The spec's error (fp32 compute) with q̂ and k̂ rounded once by ``rounding``, at least its
        own error."""
        x = self.inputs
        out, state = _spec(
            x, rounding(reference.l2_normalize(x.q)), rounding(reference.l2_normalize(x.k)), torch.float32
        )
        return max(_err(out, self.want_out), self.spec_out), max(
            _err(state, self.want_state), self.spec_state
        )

    def bounds_for(self, backend: GDNBackend) -> tuple[float, float, float, float]:
        """(unit_out, unit_state, bound_out, bound_state) that ``backend`` is held to here."""
        if self.tf32_unit is not None and backend.fp32_dots == "tf32":
            unit_out, unit_state = self.tf32_unit
            return unit_out, unit_state, TF32_RATIO * unit_out, TF32_RATIO * unit_state
        return self.unit_out, self.unit_state, self.bound_out, self.bound_state

    def _pool_and_rows(self) -> tuple[torch.Tensor, StateRows]:
        x, case = self.inputs, self.case
        sequences = len(x.bounds) - 1
        # The batch's slots are 2, 4, 6, …: not the sequence order and not contiguous; every other
        # slot, and slot 0, holds a sentinel that must survive.
        pool = torch.full(
            (2 * sequences + 2, case.geometry.value_heads, case.geometry.value_dim, case.geometry.key_dim),
            7.0,
            device=self.device,
        )
        slots = torch.arange(2, 2 * sequences + 2, 2, device=self.device)
        if x.initial is not None:
            pool[slots] = x.initial
        fresh = torch.full((sequences,), x.initial is None, dtype=torch.bool, device=self.device)
        return pool, StateRows(slots, fresh, None if case.lengths is None else x.bounds)

    def timed_call(self, backend: GDNBackend) -> Callable[[], torch.Tensor]:
        """The backend's call on this case's batch and a pool of its own, for timing."""
        pool, rows = self._pool_and_rows()
        x = self.inputs
        return lambda: backend.delta_rule(x.q, x.k, x.v, x.g, x.beta, rows, pool)

    def check(self, backend: GDNBackend) -> Agreement:
        x, case = self.inputs, self.case
        pool, rows = self._pool_and_rows()
        slots = rows.slots
        untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=self.device)
        untouched[slots] = False
        before = pool[untouched].clone()
        out = backend.delta_rule(x.q, x.k, x.v, x.g, x.beta, rows, pool)
        if not torch.equal(pool[untouched], before):
            raise AssertionError(f"{backend.name}: {case.label}: a slot outside the batch was written")
        if out.dtype != x.v.dtype or tuple(out.shape) != tuple(x.v.shape):
            raise AssertionError(
                f"{backend.name}: {case.label}: output {out.dtype} {list(out.shape)}, want {x.v.dtype} {list(x.v.shape)}"
            )
        unit_out, unit_state, bound_out, bound_state = self.bounds_for(backend)
        return Agreement(
            backend=backend.name,
            case=case.label,
            err_out=_err(out, self.want_out),
            err_state=_err(pool[slots], self.want_state),
            bound_out=bound_out,
            bound_state=bound_state,
            spec_out=self.spec_out,
            spec_state=self.spec_state,
            unit_out=unit_out,
            unit_state=unit_state,
        )
