"""The `fla` GDN backend against the spec, where fla-core is installed (`pip install 'infer[gdn]'`).

On a GPU it runs as served. On CPU fla-core's Triton kernels run under the interpreter, in fp32
only (the interpreter's bf16 `tl.dot` is wrong), with two test-only shims fla needs there: every
autotuner keeps its first config (the interpreter has no benchmarker), and the `range` its chunk
kernels iterate yields ints with a `.to()` (the compiled kernels get Triton scalars).

Bounds as kernels/gdn/agreement.py sets them (spec error measured in the same run).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator

import pytest
import torch

from kernels.gdn import GDNBackend, GDNGeometry, StateRows
from kernels.gdn.agreement import FP32_RATIO, TF32_RATIO, AgreementCase, AgreementRun, round_to_tf32
from kernels.triton.storage import interpreted

pytest.importorskip("fla", reason="fla-core is not installed (pip install 'infer[gdn]')")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GEOMETRY = GDNGeometry(key_heads=2, value_heads=4, key_dim=32, value_dim=32)
LENGTHS = (1, 2, 63, 64, 65, 130)


class _Index(int):
    def to(self, *_args: object, **_kwargs: object) -> _Index:
        return self


def _index_range(*args: int) -> Iterator[int]:
    return (_Index(i) for i in range(*args))


@pytest.fixture(scope="module")
def fla_backend() -> Iterator[GDNBackend]:
    from kernels.gdn.fla_backend import FlaGDN

    if not interpreted():
        # fla's fp32 `tl.dot` compiles to TF32 unless asked otherwise; these cases are fp32.
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TRITON_F32_DEFAULT", "ieee")
            yield FlaGDN(DEVICE)
        return
    import triton.runtime.autotuner as autotuner

    original = autotuner.Autotuner.__init__

    def first_config(
        self: object, fn: object, arg_names: object, configs: list, *a: object, **kw: object
    ) -> None:
        original(self, fn, arg_names, configs[:1], *a, **kw)

    autotuner.Autotuner.__init__ = first_config  # type: ignore[method-assign]
    try:
        backend = FlaGDN(DEVICE, interpreter=True)
    finally:
        autotuner.Autotuner.__init__ = original  # type: ignore[method-assign]
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            module.range = _index_range  # type: ignore[attr-defined]
    yield backend


@pytest.mark.parametrize("with_initial", [False, True])
def test_fla_prefill_matches_the_spec_in_fp32(fla_backend: GDNBackend, with_initial: bool) -> None:
    case = AgreementCase(GEOMETRY, LENGTHS, len(LENGTHS), with_initial, torch.float32)
    agreement = AgreementRun(case, DEVICE).check(fla_backend)
    print(agreement.line())
    assert agreement.passed, agreement.line()
    # On sm_80+ fla rounds its triangular solve's merges to TF32 (kernels/gdn/fla_backend.py).
    if fla_backend.fp32_dots == "tf32":
        assert agreement.bound_out == TF32_RATIO * agreement.unit_out > FP32_RATIO * agreement.spec_out
    else:
        assert agreement.bound_out == FP32_RATIO * agreement.spec_out


def test_fla_decode_step_matches_the_spec(fla_backend: GDNBackend) -> None:
    case = AgreementCase(GEOMETRY, None, 6, True, torch.float32)
    agreement = AgreementRun(case, DEVICE).check(fla_backend)
    print(agreement.line())
    assert agreement.passed, agreement.line()


def test_prefill_then_decode_carries_the_state(fla_backend: GDNBackend) -> None:
    """A prefill of 65 tokens then 3 decode steps is one 68-token prefill, within the spec bound."""
    from kernels import reference

    total = 68
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(total, 2, 32, generator=gen).to(DEVICE)
    k = torch.randn(total, 2, 32, generator=gen).to(DEVICE)
    v = torch.randn(total, 4, 32, generator=gen).to(DEVICE)
    g, beta = reference.gdn_gates(
        torch.randn(total, 4, generator=gen).to(DEVICE),
        torch.randn(total, 4, generator=gen).to(DEVICE),
        torch.full((4,), 0.1, device=DEVICE).log(),
        torch.ones(4, device=DEVICE),
    )
    d = torch.float64
    want, want_state = reference.gated_delta_rule(
        q.to(d), k.to(d), v.to(d), g.to(d), beta.to(d), (0, total), accumulate=d
    )
    if fla_backend.fp32_dots == "tf32":
        # The unit is the spec with q̂ and k̂ rounded once to TF32, as the agreement check sets it.
        ratio = TF32_RATIO
        spec, spec_state = reference.gated_delta_rule(
            round_to_tf32(reference.l2_normalize(q)),
            round_to_tf32(reference.l2_normalize(k)),
            v,
            g,
            beta,
            (0, total),
        )
    else:
        ratio = FP32_RATIO
        spec, spec_state = reference.gated_delta_rule(q, k, v, g, beta, (0, total))
    pool = torch.zeros(2, 4, 32, 32, device=DEVICE)
    slot = torch.tensor([1], device=DEVICE)
    outs = [
        fla_backend.delta_rule(
            q[:65],
            k[:65],
            v[:65],
            g[:65],
            beta[:65],
            StateRows(slot, torch.tensor([True], device=DEVICE), (0, 65)),
            pool,
        )
    ]
    for t in range(65, total):
        step = slice(t, t + 1)
        outs.append(
            fla_backend.delta_rule(
                q[step],
                k[step],
                v[step],
                g[step],
                beta[step],
                StateRows(slot, torch.tensor([False], device=DEVICE)),
                pool,
            )
        )
    got = torch.cat(outs)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max())

    assert err(got, want) <= ratio * err(spec, want)
    assert err(pool[1], want_state[0]) <= ratio * err(spec_state, want_state)
    assert not any(torch.equal(a, b) for a, b in itertools.pairwise(outs[1:])), "decode outputs repeat"
