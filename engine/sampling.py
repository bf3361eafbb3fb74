"""The on-device sampler: greedy, temperature, top-k, top-p, min-p, seeded draws, log-probs.

Semantics, per row:

- Greedy rows (temperature below `GREEDY_TEMPERATURE`) take the argmax of the raw logits; ties go
  to the lowest token id (`torch.argmax` returns the first maximum).
- Other rows divide the logits by the temperature, then filter in a fixed order, each filter on
  the distribution the previous ones left (renormalised): top-k (the k highest; ties at the cut
  go to the lower ids), top-p (keep a token while the mass strictly before it, in descending
  order, is below p — the smallest prefix with mass >= p), min-p (keep tokens whose probability
  is at least min_p times the top one's). The best token always survives every filter. Since
  min-p is relative to the top token, applying it last is the same as intersecting with its
  set. This is vLLM V0's order; vLLM V1 applies min-p before top-k/top-p, so top-p there sees
  a min-p-renormalised distribution: results differ only for rows that set both min-p and top-p.
- The token is then drawn by Gumbel-max: argmax over survivors of scaled logit + Gumbel noise,
  the noise keyed by (seed, step, token id). This is an exact draw from the softmax of the
  surviving scaled logits. The draw, min-p and the noise are `kernels.reference.draw_tokens`
  (the one statement of them); on CUDA the Triton kernel `kernels.triton.token_draw` runs it, one
  launch and a per-row finish over the whole batch, greedy rows included; elsewhere the spec runs.
  Top-k and top-p need a sort, which stays here in torch and hands the draw a keep mask.
- Log-probs are those of the raw model distribution — log_softmax of the logits before
  temperature and filters — as vLLM returns by default: the chosen token's, and the top
  `num_logprobs` alternatives ordered by log-prob, ties by lower id.

Batch invariance (the `invariant` policy's "fixed reduction order in sampling"). A row's tokens
and log-probs are a function of that row alone, bit for bit, whatever the batch: every op is
elementwise or reduces within one row, and no result depends on the order a kernel reduces in:

- float sums are the usual culprit: softmax, log_softmax, cumsum and sum may pick kernels by
  shape (CUDA `cumsum` can take a different scan for a lone row than for many; vectorised
  softmax paths depend on a row's alignment, which moves with its position when vocab * 4 bytes
  is not a multiple of 16). So probability mass is summed in int64 fixed point instead
  (`_fixed_point`), where addition is exact and every order gives the same bits;
- max and argmax are exact whatever the order; argmax breaks ties by lowest index;
- `torch.topk` picks its algorithm by the number of rows and leaves the order among tied values
  unspecified, so the top alternatives come from topk over distinct int64 keys
  (value, then lower id), which has one answer;
- `torch.sort` runs with `stable=True`: a stable sort's output is unique whatever algorithm;
- elementwise math (exp, log, division) gives the same bits per element on a device whatever the
  launch shape. It can differ between CPU and GPU by an ulp, so a seeded stream is reproducible
  per device type, not across them.

What this module cannot fix: the logits themselves must be batch-invariant (the GEMM policy).

Everything runs on the logits' device with fixed shapes and no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.contract import TokenLogprob
from engine.forward_batch import HostStaging
from engine.runner import SampledToken
from engine.sampling_batch import SamplingPlan, SamplingTensors
from kernels import reference
from kernels.reference import DrawRows

_LOG_2 = 0.6931471805599453


@dataclass(slots=True, frozen=True)
class SamplerOutput:
    """Device tensors for one step. `token_ids` int64 [rows]; with log-probs, `logprobs` float32
    [rows] (the chosen token's) and `top_ids` int64 / `top_logprobs` float32 [rows, k]."""

    token_ids: Tensor
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None

    def to_host(self, staging: HostStaging) -> SamplerOutput:
        """The same tensors copied into `staging`'s pinned host buffers without waiting for the
        device (read them only after an event recorded behind the copies); on a host device, self."""

        def copied(name: str, t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            host = staging.output(name, t)
            if host is not t:
                host.copy_(t, non_blocking=True)
            return host

        token_ids = copied("token_ids", self.token_ids)
        assert token_ids is not None
        return SamplerOutput(
            token_ids,
            copied("logprobs", self.logprobs),
            copied("top_ids", self.top_ids),
            copied("top_logprobs", self.top_logprobs),
        )

    def to_sampled_tokens(self, logprobs_requested: Sequence[int | None]) -> list[SampledToken]:
        """Host side: one `SampledToken` per requested row (the first len(...) rows; padding rows
        after them are dropped), each row's alternatives cut to what it asked for."""
        rows = len(logprobs_requested)
        if rows > self.token_ids.shape[0]:
            raise ValueError(f"logprobs_requested has {rows} rows, the output {self.token_ids.shape[0]}")
        wants_logprobs = [k for k in logprobs_requested if k is not None]
        widest = max(wants_logprobs, default=0)
        available = 0 if self.top_ids is None else int(self.top_ids.shape[1])
        if wants_logprobs and self.logprobs is None:
            raise ValueError(
                "rows ask for log-probs but the sampler ran without them (plan.num_logprobs=None)"
            )
        if widest > available:
            raise ValueError(f"a row asks for {widest} top log-probs, the sampler computed {available}")

        token_ids = self.token_ids[:rows].tolist()
        chosen = self.logprobs[:rows].tolist() if self.logprobs is not None else None
        top_ids = self.top_ids[:rows, :widest].tolist() if self.top_ids is not None else None
        top_lps = self.top_logprobs[:rows, :widest].tolist() if self.top_logprobs is not None else None

        if chosen is None:
            # No row asked for log-probs (checked above): the common step, a token per row.
            return [SampledToken(token_id) for token_id in token_ids]
        sampled = []
        for row, (token_id, requested) in enumerate(zip(token_ids, logprobs_requested, strict=True)):
            if requested is None or chosen is None:
                sampled.append(SampledToken(token_id))
                continue
            top: tuple[tuple[int, float], ...] = ()
            if requested and top_ids is not None and top_lps is not None:
                top = tuple(zip(top_ids[row][:requested], top_lps[row][:requested], strict=True))
            sampled.append(SampledToken(token_id, TokenLogprob(token_id, chosen[row], top)))
        return sampled


def sample(
    logits: Tensor, params: SamplingTensors, plan: SamplingPlan, *, triton_draw: bool = False
) -> SamplerOutput:
    """Sample one token per row of `logits` [rows, vocab] (any float dtype; computed in float32).

    `triton_draw`: the random rows' draw through the Triton kernel (CUDA, or the interpreter under
    TRITON_INTERPRET=1; `--sampling-backend triton`) rather than the spec's torch ops."""
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: expected [rows, vocab]")
    rows, vocab_size = logits.shape
    if rows != params.num_rows:
        raise ValueError(f"logits have {rows} rows, the sampling parameters {params.num_rows}")
    if plan.num_logprobs is not None and plan.num_logprobs > vocab_size:
        raise ValueError(f"num_logprobs={plan.num_logprobs!r}: more than the vocabulary ({vocab_size})")
    logits = logits.float()

    if plan.random_rows:
        keep = _top_k_top_p_keep(logits, params) if plan.sorted_filters else None
        token_ids = _draw(logits, params, keep, min_p=plan.min_p_filter, triton_draw=triton_draw)
    else:
        token_ids = logits.argmax(dim=-1)

    if plan.num_logprobs is None:
        return SamplerOutput(token_ids)
    return _with_logprobs(logits, token_ids, plan.num_logprobs)


def _draw(
    logits: Tensor, params: SamplingTensors, keep: Tensor | None, *, min_p: bool, triton_draw: bool
) -> Tensor:
    rows = DrawRows(
        temperature=params.temperature,
        min_p=params.min_p,
        greedy=params.greedy,
        seed=params.seed,
        step=params.step,
    )
    if not triton_draw:
        return reference.draw_tokens(logits, rows, keep)
    from kernels.triton.token_draw import token_draw

    return token_draw(logits, rows, keep, min_p=min_p)


def allowed_tokens(scaled_logits: Tensor, params: SamplingTensors, *, sorted_filters: bool = True) -> Tensor:
    """Which tokens survive top-k, top-p and min-p: bool [rows, vocab] over temperature-scaled
    logits. `sorted_filters=False` skips top-k and top-p (right only for rows with both off)."""
    keep = reference.min_p_keep(scaled_logits, params.min_p)
    if sorted_filters:
        keep &= _sorted_keep(scaled_logits, reference.relative_probs(scaled_logits), params)
    return keep


def _top_k_top_p_keep(logits: Tensor, params: SamplingTensors) -> Tensor:
    """What top-k and top-p keep of each row of the raw float32 `logits` (all of a row with both off)."""
    scaled = logits / params.temperature.unsqueeze(1)
    return _sorted_keep(scaled, reference.relative_probs(scaled), params)


def _fraction_bits(vocab_size: int) -> int:
    """Fixed-point fraction bits such that a full row of masses (each <= 1) sums below 2**62."""
    return 62 - vocab_size.bit_length()


def _fixed_point(relative: Tensor) -> Tensor:
    """Relative probabilities in [0, 1] as int64 multiples of 2**-bits (truncated).

    Sums of these are exact, so they do not depend on reduction order. Truncation loses under
    2**-bits per token: for a 262144-token vocabulary, under 2**-25 of the top token's mass in all.
    """
    return (relative * 2.0 ** _fraction_bits(relative.shape[-1])).to(torch.int64)


def _sorted_keep(scaled_logits: Tensor, relative: Tensor, params: SamplingTensors) -> Tensor:
    vocab_size = scaled_logits.shape[1]
    order = torch.sort(scaled_logits, dim=-1, descending=True, stable=True).indices
    rank = torch.arange(vocab_size, device=scaled_logits.device)
    top_k = params.top_k.unsqueeze(1)
    in_top_k = (rank < top_k) | (top_k <= 0)

    # Top-p sees the distribution top-k left: masses outside top-k count as zero.
    mass = torch.where(in_top_k, _fixed_point(relative.gather(1, order)), 0)
    total = mass.sum(dim=-1, keepdim=True)
    mass_before = mass.cumsum(dim=-1) - mass
    top_p = params.top_p.unsqueeze(1)
    # top_p == 1 must mean "off" exactly (not "drop the last ulp of mass"), so that a row that
    # does not filter gets the same bits whether or not the batch ran this sorted pass.
    in_top_p = (mass_before.double() < top_p.double() * total.double()) | (top_p >= 1.0)

    keep_sorted = in_top_k & in_top_p
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _with_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> SamplerOutput:
    """Raw log-probs: log_softmax(logits) with the normaliser summed exactly in fixed point."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    bits = _fraction_bits(logits.shape[1])
    total = _fixed_point(torch.exp(shifted)).sum(dim=-1, keepdim=True)
    log_normaliser = (torch.log(total.double()) - bits * _LOG_2).float()

    chosen = (shifted.gather(1, token_ids.unsqueeze(1)) - log_normaliser).squeeze(1)
    if num_top == 0:
        return SamplerOutput(token_ids, chosen)
    top_ids = torch.topk(_descending_keys(logits), num_top, dim=-1, sorted=True).indices
    top_logprobs = shifted.gather(1, top_ids) - log_normaliser
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)


def _descending_keys(logits: Tensor) -> Tensor:
    """Distinct int64 keys ordered like (logit descending, token id ascending).

    The float32 bit pattern, made monotone as a signed integer (negative floats count down, so
    their magnitude bits are flipped), fills the high word; the complemented token id the low.
    """
    bits = logits.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    ids = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)
    # Multiply rather than shift: left-shifting a negative integer is not portable.
    return ordered * 2**32 + (0xFFFFFFFF - ids)
