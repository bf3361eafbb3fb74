"""The Triton token draw against its spec (``kernels.reference.draw_tokens``) and against itself, under
the interpreter (on the GPU when there is one), the engine's sampler through it, and an sm_90 compile
check of every variant.

The integer hash, the division by the temperature, min-p's mask, the keep mask and the argmax are
exact; the spec leaves kernels the last fp32 bits of ``log1p`` and ``log`` in the Gumbel transform.
So, per case: the kernel's Gumbel values for the case's seeds and steps must be at most twice as
far as the spec's own from the fp64 transform of the same (exact) uniforms; its scores
(``scores=``: what its argmax saw) must have the spec's ``-inf`` pattern exactly, and each finite
score may differ from the spec's by at most ``ε_g`` (the largest difference between the kernel's
and the spec's Gumbel values, measured in the same run) plus an ulp of the score (the one add
after the noise). ``ε`` is the largest score difference seen; a token may differ from the spec's
only where the spec scores the kernel's token within ``2ε`` of its best (each side moved by at
most ``ε``).

Measured on the 2-core CPU machine under the interpreter: from fp64, kernel 4.2e-7 to 6.2e-7,
spec 4.2e-7 to 5.1e-7; ``ε_g`` = 4.8e-7 to 9.5e-7 and ``ε`` = 1.9e-6 to 3.8e-6 nats (one or two fp32 ulps
at the scores' magnitude); 0 of 290 random rows drew another token. On the GPU both sides call
libdevice's ``log1pf`` / ``logf`` and ``ε`` is expected to be 0 (not yet run there).
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch
from sm90_compile import compiled_variants

from engine.contract import SamplingParams
from engine.sampling import SamplerOutput, allowed_tokens, sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingPlan
from kernels import reference
from kernels.reference import DrawRows, SpecError
from kernels.triton.token_draw import BLOCK, CHUNK, TokenDrawError, token_draw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEMPERATURES = (0.25, 0.7, 1.0, 1.6, 3.0)
MIN_PS = (0.0, 0.0, 0.001, 0.05, 0.3, 0.9)


def _rows(count: int, seed: int, *, greedy_every: int = 5) -> DrawRows:
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, 1000, (count, 2), generator=g)
    temperature = torch.tensor([TEMPERATURES[int(i) % len(TEMPERATURES)] for i in pick[:, 0]])
    min_p = torch.tensor([MIN_PS[int(i) % len(MIN_PS)] for i in pick[:, 1]])
    greedy = (torch.arange(count) % greedy_every == greedy_every - 1).long()
    return DrawRows(
        temperature=torch.where(greedy != 0, 1.0, temperature).to(DEVICE),
        min_p=min_p.to(DEVICE),
        greedy=greedy.to(DEVICE),
        # Full 64-bit seeds (negative ones too) and steps past 2**32 (only the low word keys).
        seed=torch.randint(-(2**63), 2**63 - 1, (count,), generator=g).to(DEVICE),
        step=torch.randint(0, 2**40, (count,), generator=g).to(DEVICE),
    )


def _logits(count: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, vocab, generator=g) * 3
    # Masked vocabulary entries, as models suppress tokens; and whole-number rows, where greedy ties.
    logits[:, torch.randint(0, vocab, (vocab // 50,), generator=g)] = float("-inf")
    logits[1::7] = logits[1::7].round()
    return logits.to(dtype).to(DEVICE)


def _keep(count: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(count, vocab, generator=g) < 0.6).to(DEVICE)


def _spec_scores(logits: torch.Tensor, rows: DrawRows, keep: torch.Tensor | None) -> torch.Tensor:
    """What the spec's argmax sees per token (the spec's own functions, composed as draw_tokens does)."""
    raw = logits.float()
    scaled = raw / rows.temperature.unsqueeze(1)
    allowed = reference.min_p_keep(scaled, rows.min_p)
    if keep is not None:
        allowed &= keep
    noisy = (scaled + reference.gumbel_noise(rows.seed, rows.step, logits.shape[1])).masked_fill(
        ~allowed, float("-inf")
    )
    return torch.where(rows.greedy.unsqueeze(1) != 0, raw, noisy)


def _gumbel_difference(rows: DrawRows, vocab: int) -> float:
    """max |kernel Gumbel − spec Gumbel| for these rows' seeds and steps (the kernel's scores on zero
    logits at temperature 1 with no filter are its Gumbel values themselves), after checking that
    the kernel's values are at most twice as far as the spec's own from the fp64 transform of the
    same (exact) uniforms."""
    count = rows.num_rows
    noise_only = replace(
        rows,
        temperature=torch.ones(count, device=DEVICE),
        min_p=torch.zeros(count, device=DEVICE),
        greedy=torch.zeros(count, dtype=torch.int64, device=DEVICE),
    )
    kernel = torch.empty(count, vocab, device=DEVICE)
    token_draw(torch.zeros(count, vocab, device=DEVICE), noise_only, scores=kernel, min_p=False)
    spec = reference.gumbel_noise(rows.seed, rows.step, vocab)
    exact = -torch.log(-torch.log1p(-reference.uniform_noise(rows.seed, rows.step, vocab).double()))
    spec_error = float((spec.double() - exact).abs().max())
    kernel_error = float((kernel.double() - exact).abs().max())
    print(f"Gumbel values vs fp64: spec {spec_error:.3g}, kernel {kernel_error:.3g}")
    assert kernel_error <= 2 * spec_error, (kernel_error, spec_error)
    return float((kernel - spec).abs().max())


def _ulp(x: torch.Tensor) -> torch.Tensor:
    magnitude = x.abs()
    return torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude


def _check_against_spec(
    logits: torch.Tensor, rows: DrawRows, keep: torch.Tensor | None, *, chunk: int = CHUNK
) -> tuple[float, float, int]:
    """Runs kernel and spec; asserts the rules in the module docstring; returns (ε_g, ε, rows that differ)."""
    scores = torch.empty(logits.shape, dtype=torch.float32, device=DEVICE)
    got = token_draw(logits, rows, keep, scores=scores, chunk=chunk)
    want = reference.draw_tokens(logits, rows, keep)
    spec = _spec_scores(logits, rows, keep)
    assert torch.equal(torch.isneginf(scores), torch.isneginf(spec)), "the filters kept other tokens"
    greedy = rows.greedy != 0
    assert torch.equal(scores[greedy].view(torch.int32), spec[greedy].view(torch.int32))
    assert torch.equal(got[greedy], want[greedy]), "a greedy row is not the raw argmax"
    finite = torch.isfinite(spec)
    epsilon = float((scores[finite] - spec[finite]).abs().max()) if bool(finite.any()) else 0.0
    # Everything before the noise is exact, so a score may move only by the Gumbel values' own
    # difference plus the rounding of the one add (an ulp of the score).
    gumbel_epsilon = _gumbel_difference(rows, logits.shape[1])
    excess = (scores[finite] - spec[finite]).abs() - (gumbel_epsilon + _ulp(spec[finite]))
    assert float(excess.max()) <= 0.0, float(excess.max())

    differ = (got != want).nonzero().flatten().tolist()
    for row in differ:
        best = spec[row].max()
        # The kernel's token is one the spec allows, scored within the transform's measured error.
        assert float(best - spec[row, got[row]]) <= 2 * epsilon, (row, int(got[row]), int(want[row]))
    return gumbel_epsilon, epsilon, len(differ)


@pytest.mark.parametrize(
    ("vocab", "dtype", "with_keep", "chunk"),
    [
        (2500, torch.float32, False, BLOCK),  # three chunks, the last partial
        (2500, torch.float32, True, 2 * BLOCK),
        (4096 + 77, torch.bfloat16, True, CHUNK),  # two chunks of the serving size
        (300, torch.float32, False, CHUNK),  # one chunk, mostly past the vocabulary
    ],
    ids=["fp32-chunk1k", "fp32-keep-chunk2k", "bf16-keep-serving-chunk", "tiny-vocab"],
)
def test_kernel_is_the_spec_up_to_the_measured_transform_error(
    vocab: int, dtype: torch.dtype, with_keep: bool, chunk: int
) -> None:
    count = 80 if vocab < 1000 else 70
    logits = _logits(count, vocab, seed=vocab + chunk, dtype=dtype)
    rows = _rows(count, seed=vocab)
    keep = _keep(count, vocab, seed=3) if with_keep else None
    gumbel_epsilon, epsilon, differ = _check_against_spec(logits, rows, keep, chunk=chunk)
    print(
        f"vocab {vocab} {dtype} keep={with_keep}: Gumbel ε_g = {gumbel_epsilon:.3g}, scores ε = "
        f"{epsilon:.3g} nats, {differ} of {count} rows differ"
    )


def test_the_tiling_never_changes_a_token_or_a_score() -> None:
    logits, rows, keep = _logits(24, 3000, seed=5), _rows(24, seed=5), _keep(24, 3000, seed=5)
    outputs = []
    for chunk in (BLOCK, 2 * BLOCK, CHUNK):
        scores = torch.empty(logits.shape, device=DEVICE)
        outputs.append((token_draw(logits, rows, keep, scores=scores, chunk=chunk), scores))
    for tokens, scores in outputs[1:]:
        assert torch.equal(tokens, outputs[0][0])
        assert torch.equal(scores.view(torch.int32), outputs[0][1].view(torch.int32))


def _row(rows: DrawRows, i: int) -> DrawRows:
    return DrawRows(*(getattr(rows, field.name)[i : i + 1] for field in fields(DrawRows)))


def test_a_row_alone_and_inside_a_batch_is_the_same_bits_and_two_runs_agree() -> None:
    count, vocab = 24, 2100
    logits, rows, keep = _logits(count, vocab, seed=6), _rows(count, seed=6), _keep(count, vocab, seed=6)
    scores = torch.empty(count, vocab, device=DEVICE)
    together = token_draw(logits, rows, keep, scores=scores, chunk=BLOCK)
    for i in (0, 4, 9, 13, 23):  # random rows, greedy rows (4, 9), a whole-number row (13)
        alone_scores = torch.empty(1, vocab, device=DEVICE)
        alone = token_draw(
            logits[i : i + 1], _row(rows, i), keep[i : i + 1], scores=alone_scores, chunk=BLOCK
        )
        assert int(alone) == int(together[i]), f"row {i}"
        assert torch.equal(alone_scores[0].view(torch.int32), scores[i].view(torch.int32)), f"row {i}"
    again = torch.empty(count, vocab, device=DEVICE)
    assert torch.equal(token_draw(logits, rows, keep, scores=again, chunk=BLOCK), together), "two runs differ"
    assert torch.equal(again.view(torch.int32), scores.view(torch.int32))


def test_rows_at_an_offset_read_and_write_only_their_own_entries() -> None:
    count, vocab, offset = 5, 1500, 2
    logits, rows, keep = _logits(count, vocab, seed=7), _rows(count, seed=7), _keep(count, vocab, seed=7)
    expected = token_draw(logits, rows, keep)
    # +inf around the rows and past the vocabulary: a read of any of it would win an argmax.
    buffer = torch.full((count + 4, vocab + 48), float("inf"), device=DEVICE)
    buffer[offset : offset + count, :vocab] = logits
    keep_buffer = torch.ones(count + 4, vocab + 48, dtype=torch.bool, device=DEVICE)
    keep_buffer[offset : offset + count, :vocab] = keep
    # The per-row parameters as views into packed tensors, as the engine hands them over.
    packed_floats = torch.full((2, count + 4), float("nan"), device=DEVICE)
    packed_ints = torch.full((3, count + 4), -5, dtype=torch.int64, device=DEVICE)
    for index, name in enumerate(("temperature", "min_p")):
        packed_floats[index, offset : offset + count] = getattr(rows, name)
    for index, name in enumerate(("greedy", "seed", "step")):
        packed_ints[index, offset : offset + count] = getattr(rows, name)
    at_offset = DrawRows(
        temperature=packed_floats[0, offset : offset + count],
        min_p=packed_floats[1, offset : offset + count],
        greedy=packed_ints[0, offset : offset + count],
        seed=packed_ints[1, offset : offset + count],
        step=packed_ints[2, offset : offset + count],
    )
    out = torch.full((count + 4,), -7, dtype=torch.int64, device=DEVICE)
    scores = torch.full((count + 4, vocab + 48), 3.5, device=DEVICE)
    token_draw(
        buffer[offset : offset + count, :vocab],
        at_offset,
        keep_buffer[offset : offset + count, :vocab],
        out=out[offset : offset + count],
        scores=scores[offset : offset + count, :vocab],
    )
    assert torch.equal(out[offset : offset + count], expected)
    sentinel = torch.ones(count + 4, dtype=torch.bool, device=DEVICE)
    sentinel[offset : offset + count] = False
    assert bool((out[sentinel] == -7).all())
    assert bool((scores[sentinel] == 3.5).all()) and bool((scores[:, vocab:] == 3.5).all())


# An all -inf row subtracts -inf from -inf on the way to its NaN relative probabilities, as the spec does.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_degenerate_rows_follow_the_spec() -> None:
    """Every logit -inf (token 0, greedy or not); min-p 1 (the best token only); greedy maxima tied in
    one lane and across chunks (the lowest id); a one-token vocabulary."""
    vocab = 1100
    logits = _logits(5, vocab, seed=8)
    logits[0:2] = float("-inf")
    # Ids 7 and 7 + BLOCK share a lane of one chunk, or sit in two chunks of BLOCK tokens.
    logits[4, [7, 7 + BLOCK, 900]] = 50.0
    rows = DrawRows(
        temperature=torch.tensor([1.0, 0.8, 0.8, 1.3, 1.0], device=DEVICE),
        min_p=torch.tensor([0.0, 0.5, 1.0, 0.0, 0.0], device=DEVICE),
        greedy=torch.tensor([1, 0, 0, 0, 1], device=DEVICE),
        seed=torch.tensor([1, 2, 3, 4, 5], device=DEVICE),
        step=torch.tensor([0, 0, 0, 0, 0], device=DEVICE),
    )
    for chunk in (BLOCK, CHUNK):
        got = token_draw(logits, rows, chunk=chunk)
        assert got.tolist()[:3] == [0, 0, int(logits[2].argmax())]
        assert int(got[4]) == 7
        assert torch.equal(got, reference.draw_tokens(logits, rows))
    single = _logits(3, 1, seed=9)
    assert token_draw(single, _rows(3, seed=9)).tolist() == [0, 0, 0]


# ----------------------------------------------------------------------- the engine's sampler through it

TARGETS = [
    SamplingParams(temperature=1.0, seed=1, logprobs=3),
    SamplingParams(temperature=0.7, top_p=0.9, seed=2, logprobs=0),
    SamplingParams(temperature=1.3, top_k=40, seed=3),
    SamplingParams(temperature=0.9, min_p=0.05, seed=-4, logprobs=5),
    SamplingParams(temperature=1.1, top_k=100, top_p=0.8, min_p=0.01, seed=2**70 + 5, logprobs=1),
    SamplingParams(temperature=0.0, seed=6, logprobs=2),
]


def _engine_rows(step: int) -> list[RowSampling]:
    return [RowSampling(params, params.seed or 0, step + i) for i, params in enumerate(TARGETS)]


def _engine_epsilon(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The spec's scores under the engine's filters, the kernel's for the same rows, and ε between."""
    params = batch.to(DEVICE)
    scaled = logits / params.temperature.unsqueeze(1)
    keep = allowed_tokens(scaled, params)
    rows = DrawRows(params.temperature, params.min_p, params.greedy, params.seed, params.step)
    spec = _spec_scores(logits, rows, keep)
    scores = torch.empty(logits.shape, device=DEVICE)
    token_draw(logits, rows, keep, scores=scores)
    assert torch.equal(torch.isneginf(scores), torch.isneginf(spec))
    finite = torch.isfinite(spec)
    return spec, scores, float((scores[finite] - spec[finite]).abs().max())


def test_the_engines_sampler_draws_through_the_kernel_as_through_the_spec() -> None:
    g = torch.Generator().manual_seed(30)
    for step in range(0, 60, 4):
        logits = (torch.randn(len(TARGETS), 1200, generator=g) * 3).to(DEVICE)
        batch = SamplingBatch.pack(_engine_rows(step))
        assert batch.plan.sorted_filters and batch.plan.min_p_filter
        params = batch.to(DEVICE)
        kernel = sample(logits, params, batch.plan, triton_draw=True)
        spec = sample(logits, params, batch.plan, triton_draw=False)
        spec_scores, _, epsilon = _engine_epsilon(logits, batch)
        for row in (kernel.token_ids != spec.token_ids).nonzero().flatten().tolist():
            gap = float(spec_scores[row].max() - spec_scores[row, kernel.token_ids[row]])
            assert gap <= 2 * epsilon, (step, row, gap, epsilon)
        # The greedy row is the raw argmax, and log-probs are the same torch computation either way.
        assert int(kernel.token_ids[-1]) == int(logits[-1].argmax())
        _assert_same_logprobs(kernel, spec)


def _assert_same_logprobs(a: SamplerOutput, b: SamplerOutput) -> None:
    # Log-probs of the chosen token depend on the token; where the tokens agree they must be the same bits.
    same = a.token_ids == b.token_ids
    assert a.logprobs is not None and b.logprobs is not None
    assert torch.equal(a.logprobs[same].view(torch.int32), b.logprobs[same].view(torch.int32))
    assert a.top_ids is not None and b.top_ids is not None and torch.equal(a.top_ids, b.top_ids)


def test_a_seeded_request_draws_the_same_stream_in_any_batch_through_the_kernel() -> None:
    g = torch.Generator().manual_seed(31)
    steps, vocab = 8, 900
    stream_logits = (torch.randn(steps, vocab, generator=g) * 2).to(DEVICE)
    target = SamplingParams(temperature=0.8, min_p=0.02, seed=1234)
    neighbour = SamplingParams(temperature=1.5, top_k=7)
    alone = [
        int(_draw_engine(stream_logits[s : s + 1], [RowSampling(target, 1234, s)]).token_ids[0])
        for s in range(steps)
    ]
    for s in range(steps):
        before = s % 3
        logits = torch.cat(
            [(torch.randn(before, vocab, generator=g) * 2).to(DEVICE), stream_logits[s : s + 1]]
        )
        rows = [RowSampling(neighbour, 99 + i, s) for i in range(before)]
        batched = _draw_engine(logits, [*rows, RowSampling(target, 1234, s)])
        assert int(batched.token_ids[before]) == alone[s], f"step {s}"
    assert len(set(alone)) > 1, "the stream never moved"


def _draw_engine(logits: torch.Tensor, rows: list[RowSampling]) -> SamplerOutput:
    batch = SamplingBatch.pack(rows)
    return sample(logits, batch.to(DEVICE), batch.plan, triton_draw=True)


def test_plan_shortcuts_give_the_same_tokens_through_the_kernel() -> None:
    g = torch.Generator().manual_seed(32)
    logits = (torch.randn(6, 700, generator=g) * 3).to(DEVICE)
    rows = [RowSampling(SamplingParams(temperature=0.9 + 0.1 * i), i, i) for i in range(5)]
    rows.append(RowSampling(SamplingParams(temperature=0.0), 0, 0))
    batch = SamplingBatch.pack(rows)
    assert not batch.plan.sorted_filters and not batch.plan.min_p_filter
    params = batch.to(DEVICE)
    eager = sample(logits, params, batch.plan, triton_draw=True).token_ids
    assert torch.equal(eager, sample(logits, params, SamplingPlan.widest(None), triton_draw=True).token_ids)


# ---------------------------------------------------------------------------------- refusals, compile


def test_kernel_and_spec_refuse_what_they_cannot_take() -> None:
    logits, rows = _logits(3, 64, seed=10), _rows(3, seed=10)
    with pytest.raises(SpecError, match=r"temperature is \(2,\)"):
        token_draw(logits, replace(rows, temperature=rows.temperature[:2]))
    with pytest.raises(SpecError, match=r"seed is \(3,\) torch.int32"):
        reference.draw_tokens(logits, replace(rows, seed=rows.seed.int()))
    with pytest.raises(SpecError, match=r"logits.shape=\(3, 0\)"):
        token_draw(logits[:, :0], rows)
    with pytest.raises(TokenDrawError, match=r"keep is \(3, 63\)"):
        token_draw(logits, rows, torch.ones(3, 63, dtype=torch.bool, device=DEVICE))
    with pytest.raises(TokenDrawError, match=r"logits dtype torch.float64"):
        token_draw(logits.double(), rows)
    with pytest.raises(TokenDrawError, match=r"logits stride \(1, 3\)"):
        token_draw(logits.t().contiguous().t(), rows)
    with pytest.raises(TokenDrawError, match=r"chunk=1000"):
        token_draw(logits, rows, chunk=1000)
    with pytest.raises(TokenDrawError, match=r"out is \(3,\) torch.int32"):
        token_draw(logits, rows, out=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_every_variant_compiles_for_sm90() -> None:
    compiled = compiled_variants("kernels.triton.token_draw")
    assert len(compiled) == 3 * 2 * 2, compiled
