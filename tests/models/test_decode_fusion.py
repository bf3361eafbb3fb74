"""Each model line's tiny checkpoint decoding with ``--decode-fusion`` (the fused decode GEMV and MMA,
under the Triton interpreter or compiled on a GPU) against the same model composing its projections
as every other step does: three sequences (decode steps of 1-3 rows through the GEMV) and eight
(decode steps of 8 rows through the MMA).

Greedy tokens must be the same. Log-probs may differ by what the spec leaves free (the fp32 order of
each projection's sum and of each norm's sum of squares), so the bound is measured in the same run:
the composed model once more with every projection's sum over K reversed (a linear the spec allows,
``tests/kernels/linear_bounds.py``) gives the log-prob spread that reordering alone causes; the
fused model may sit at most 4× that worst spread from the composed one (about the margin the linear
bounds keep over their measured reordering).

Every fused launch is spied on: each layer's projections, and the LM head, must each have run
through the kernel with the line's fusion (docs/kernels.md, "The fused decode GEMV" and "MMA").
Qwen3.5's GDN layers must also have run every decode step's mixer (conv step, gates + recurrent
step, gated norm) through the fused decode mixer's three kernels, and only those steps: a multi-step
decode whose conv and recurrent states carry from step to step in the kernels' in-place writes
(docs/kernels.md, "Gated DeltaNet").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kernels.gdn.decode_mixer as mixer_module
import kernels.triton.fused_gemv as fused_module
import kernels.triton.fused_mma as mma_module
import models.paged_line
import models.qwen35
from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.scheduler import BatchScheduler
from kernels.gdn import GDNBackend, StateRows, TorchGDN
from kernels.gemm.projections import FusedDecodeProjections
from kernels.triton.fused_gemv import Fusion
from models.registry import ModelOptions, load_model

Run = tuple[dict[str, list[int]], dict[str, list[float]]]
# What a line's decode step launches per weight: the fusion's name (``Fusion.name``).
Expected = dict[int, str]


def _qwen3_launches(model: Any) -> Expected:
    """Qwen3: norm + QKV, O + residual, norm + gate/up + SiLU·mul, down + residual; the LM head."""
    launches = {model.lm_head.data_ptr(): "gemv"}
    for layer in model.layers:
        launches[layer.qkv.data_ptr()] = "norm+gemv"
        launches[layer.o.data_ptr()] = "gemv+residual"
        launches[layer.gate_up.data_ptr()] = "norm+gemv+silu"
        launches[layer.down.data_ptr()] = "gemv+residual"
    return launches


def _qwen35_launches(model: Any) -> Expected:
    """Qwen3.5: as Qwen3, the mixer's projections (GDN's in_proj/out_proj or QKV/O) in place of QKV/O."""
    launches = {model.lm_head.data_ptr(): "gemv"}
    for layer in model.layers:
        mixer = layer.mixer
        into, out = (mixer.in_proj, mixer.out) if hasattr(mixer, "in_proj") else (mixer.qkv, mixer.o)
        launches[into.data_ptr()] = "norm+gemv"
        launches[out.data_ptr()] = "gemv+residual"
        launches[layer.gate_up.data_ptr()] = "norm+gemv+silu"
        launches[layer.down.data_ptr()] = "gemv+residual"
    return launches


def _gemma_launches(head: str) -> Callable[[Any], Expected]:
    """Gemma 3 and 4: QKV, O, down and the LM head plain; gate/up with the GELU-tanh epilogue (the
    norms stay in the residual kernel)."""

    def launches(model: Any) -> Expected:
        found = {getattr(model, head).data_ptr(): "gemv"}
        for layer in model.layers:
            found[layer.qkv.data_ptr()] = "gemv"
            found[layer.o.data_ptr()] = "gemv"
            found[layer.gate_up.data_ptr()] = "gemv+gelu_tanh"
            found[layer.down.data_ptr()] = "gemv"
        return found

    return launches


LINES: dict[str, Callable[[Any], Expected]] = {
    "tiny_qwen3": _qwen3_launches,
    "tiny_qwen35": _qwen35_launches,
    "tiny_gemma4": _gemma_launches("embed"),
    "tiny_gemma3": _gemma_launches("lm_head"),
}


# Prompt lengths: three sequences, and eight that decode together in steps of 8 rows.
SMALL = (5, 21, 12)
BATCH_8 = (5, 21, 12, 7, 16, 9, 13, 6)


# On a GPU the kernels run compiled, in fp32 (the MMA's fp32 dot is IEEE there, no TF32), eagerly:
# a captured graph would call the spied launchers once per bucket, not once per step. Attention is
# torch's (FlashInfer has no head dim 32, the tiny checkpoints').
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _decode(checkpoint: Path, *, fusion: bool, lengths: tuple[int, ...] = SMALL) -> tuple[Run, Any]:
    engine = EngineConfig(
        max_num_batched_tokens=64, num_kv_pages=64, max_num_seqs=len(lengths), enforce_eager=True
    )
    options = ModelOptions(
        engine=engine, device=DEVICE, dtype="float32", attention_backend="torch", decode_fusion=fusion
    )
    scheduler = load_model(str(checkpoint), options).scheduler
    assert isinstance(scheduler, BatchScheduler)
    model = scheduler.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.projections, FusedDecodeProjections) == fusion
    prompts = [tuple(range(40, 40 + n)) for n in lengths]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0)
        scheduler.submit(Request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while scheduler.has_work():
        for update in scheduler.step().updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            logprobs.setdefault(update.request_id, []).extend(lp.logprob for lp in update.logprobs or ())
    return (tokens, logprobs), model


# The fused decode mixer's three launches, by their names in kernels.gdn.decode_mixer, and the
# token-wise gates kernel a composed step takes beside the third.
MIXER_KERNELS = ("gdn_conv_step", "gdn_decode_step_with_gates", "gdn_gated_norm")
COMPOSED_STEP_KERNELS = ("gdn_gates",)


def _spy_mixer(patch: pytest.MonkeyPatch) -> Counter[tuple[str, int]]:
    """Counts (kernel, rows) of every launch of the fused decode mixer's kernels."""
    launched: Counter[tuple[str, int]] = Counter()
    for name in MIXER_KERNELS + COMPOSED_STEP_KERNELS:
        real = getattr(mixer_module, name)

        def spied(x: torch.Tensor, *args: Any, _name: str = name, _real: Any = real, **kw: Any) -> Any:
            launched[(_name, x.shape[0])] += 1
            return _real(x, *args, **kw)

        patch.setattr(mixer_module, name, spied)
    return launched


def _check_mixer_launches(line: str, model: Any, launched: Counter[tuple[str, int]], rows: int) -> None:
    """Qwen3.5: each GDN layer ran its decode steps through the three kernels, each step all three,
    at least 5 steps with every one of the ``rows`` sequences decoding (the step plan is the
    scheduler's: a decode row beside a prefill chunk composes), and the steps that compose through
    the gates and gated norm kernels; the other lines never."""
    if line != "tiny_qwen35":
        assert not launched, launched
        return
    gdn_layers = sum(hasattr(layer.mixer, "in_proj") for layer in model.layers)
    assert gdn_layers > 0
    per_kernel = {name: sum(n for (k, _), n in launched.items() if k == name) for name in MIXER_KERNELS}
    decode_steps = per_kernel["gdn_conv_step"]
    assert per_kernel["gdn_decode_step_with_gates"] == decode_steps, per_kernel
    assert per_kernel["gdn_gated_norm"] > decode_steps, per_kernel  # the composed steps' norms too
    composed_steps = per_kernel["gdn_gated_norm"] - decode_steps
    assert sum(n for (k, _), n in launched.items() if k == "gdn_gates") == composed_steps, launched
    assert launched[("gdn_conv_step", rows)] >= 5 * gdn_layers, launched
    assert max(r for k, r in launched if k not in ("gdn_gated_norm", "gdn_gates")) == rows, launched
    assert all(count % gdn_layers == 0 for (_, _), count in launched.items()), launched


def _worst(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key], strict=True))


@pytest.mark.parametrize("line", sorted(LINES))
def test_fused_decode_gives_the_composed_tokens_within_the_reordering_bound(
    line: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint: Path = request.getfixturevalue(line)
    composed, _ = _decode(checkpoint, fusion=False)

    rows_seen: list[int] = []
    launched: Counter[tuple[int, str]] = Counter()
    real = fused_module.fused_gemv

    def spied(x: torch.Tensor, weight: torch.Tensor, fusion: Fusion = Fusion(), *args: Any, **kw: Any) -> Any:
        rows_seen.append(x.shape[0])
        launched[(weight.data_ptr(), fusion.name)] += 1
        return real(x, weight, fusion, *args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(fused_module, "fused_gemv", spied)
        mixer_launched = _spy_mixer(patch)
        fused, model = _decode(checkpoint, fusion=True)
    _check_mixer_launches(line, model, mixer_launched, rows=len(SMALL))
    # Decode steps of 3 rows (and fewer as requests finish) ran fused, every projection of every
    # layer once a step with its line's fusion, and the LM head (on the prefill steps' sampled rows
    # too: it fuses by its own row count).
    assert rows_seen and max(rows_seen) <= fused_module.MAX_ROWS, rows_seen
    expected = LINES[line](model)
    assert {ptr: name for ptr, name in launched} == expected
    assert len(launched) == len(expected), "a weight ran under two fusions"
    head = next(iter(expected))
    per_layer = {count for (ptr, _), count in launched.items() if ptr != head}
    assert len(per_layer) == 1, per_layer
    assert launched[(head, "gemv")] >= per_layer.pop() > 0

    _check_against_composed(line, checkpoint, monkeypatch, composed, fused, SMALL)


def _k_reversed(policy: object, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda x, w: F.linear(x.flip(-1), w.flip(-1))


def _check_against_composed(
    line: str,
    checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    composed: Run,
    fused: Run,
    lengths: tuple[int, ...],
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(models.paged_line, "policy_linear", _k_reversed)
        reordered, _ = _decode(checkpoint, fusion=False, lengths=lengths)

    assert fused[0] == composed[0] and all(len(t) == 10 for t in composed[0].values())
    assert reordered[0] == composed[0]
    spread = _worst(reordered[1], composed[1])
    got = _worst(fused[1], composed[1])
    print(f"{line} log-prob |Δ|: fused {got:.3g}, reordered sums {spread:.3g}")
    assert spread > 0, "the reordered sums changed no log-prob: the bound would be zero"
    assert got <= 4 * spread, (got, spread)


@pytest.mark.parametrize("line", sorted(LINES))
def test_a_batch_of_eight_decodes_through_the_fused_mma(
    line: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint: Path = request.getfixturevalue(line)
    composed, _ = _decode(checkpoint, fusion=False, lengths=BATCH_8)
    rows_seen: list[int] = []
    real = mma_module.fused_mma

    def counted(x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        rows_seen.append(x.shape[0])
        return real(x, *args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(mma_module, "fused_mma", counted)
        mixer_launched = _spy_mixer(patch)
        fused, model = _decode(checkpoint, fusion=True, lengths=BATCH_8)
    _check_mixer_launches(line, model, mixer_launched, rows=len(BATCH_8))
    # Every sequence decodes 10 tokens together: at least 9 decode steps of 8 rows through the MMA.
    assert rows_seen.count(len(BATCH_8)) >= 9, sorted(set(rows_seen))
    assert all(fused_module.MAX_ROWS < m <= mma_module.MAX_ROWS for m in rows_seen), sorted(set(rows_seen))
    _check_against_composed(line, checkpoint, monkeypatch, composed, fused, BATCH_8)


class _NotTheSpecGDN(GDNBackend):
    """The torch backend's conv and delta rule under another name: any GDN backend but the spec's own
    takes the fused decode mixer where its kernels run, without ``--decode-fusion``."""

    name = "torch-delegate"

    def __init__(self) -> None:
        self._spec = TorchGDN()

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, rows: StateRows, pool: torch.Tensor
    ) -> torch.Tensor:
        return self._spec.conv(x, weight, rows, pool)

    def delta_rule(self, *args: Any) -> torch.Tensor:
        return self._spec.delta_rule(*args)


def test_qwen35_decodes_through_the_mixer_with_composed_projections(
    tiny_qwen35: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    composed, _ = _decode(tiny_qwen35, fusion=False)
    with monkeypatch.context() as patch:
        patch.setattr(models.qwen35, "pick_gdn_backend", lambda *_: _NotTheSpecGDN())
        mixer_launched = _spy_mixer(patch)
        mixed, model = _decode(tiny_qwen35, fusion=False)
    assert model.decode_mixer is not None
    _check_mixer_launches("tiny_qwen35", model, mixer_launched, rows=len(SMALL))
    _check_against_composed("tiny_qwen35", tiny_qwen35, monkeypatch, composed, mixed, SMALL)
