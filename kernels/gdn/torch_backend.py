"""The torch GDN backend: the spec's math in batched torch ops, on any device.

Decode steps (one token per sequence) run one recurrent step for every sequence at once, with no
host synchronisation, so a CUDA graph can capture them. Prefill sequences run the chunked form of
the gated delta rule: within a chunk of C tokens the recurrence is solved in closed form (a unit
lower-triangular system, the WY/UT form of DeltaNet), and the state is carried from chunk to chunk.
With ``γ`` the cumulative log-decay inside the chunk and ``S₀`` the state entering it:

- ``(I + A)·U = β⊙V − (β·e^γ ⊙ K)·S₀ᵀ`` with ``A[i, j] = β_i·e^(γ_i − γ_j)·(k_i·k_j)`` for j < i:
  ``U`` holds each token's write ``δ``;
- ``O = (e^γ ⊙ Q)·S₀ᵀ + (M ⊙ Q·Kᵀ)·U`` with ``M[t, i] = e^(γ_t − γ_i)`` for i ≤ t;
- ``S_C = e^(γ_C)·S₀ + (U ⊙ e^(γ_C − γ))ᵀ·K``.

Every exponent is ≤ 0 (g ≤ 0), so nothing overflows. It equals the per-token recurrence up to the
order of fp32 sums; tests/kernels/test_gdn_torch.py measures how far.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.gdn.base import GDNBackend, StateRows, check_state_pool, initial_states
from kernels.reference import SpecError, l2_normalize

DEFAULT_CHUNK = 64


class TorchGDN(GDNBackend):
    name = "torch"

    def __init__(self, chunk_size: int = DEFAULT_CHUNK, accumulate: torch.dtype = torch.float32) -> None:
        """``accumulate=torch.float64`` (tests only) runs the same algebra in fp64, with fp64 pools."""
        if chunk_size < 1:
            raise SpecError(f"chunk_size must be at least 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.accumulate = accumulate

    # -- conv ------------------------------------------------------------------------------------

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, rows: StateRows, conv_pool: torch.Tensor
    ) -> torch.Tensor:
        channels, width = weight.shape
        check_state_pool(conv_pool, (width - 1, channels), "conv state")
        history = initial_states(conv_pool, rows)
        acc_dtype = self.accumulate
        w = weight.to(acc_dtype).T  # [W, D]
        if rows.cu_seqlens is None:
            inputs = torch.cat([history.to(x.dtype), x[:, None]], dim=1)  # [N, W, D]
            out = _silu_stored((inputs.to(acc_dtype) * w).sum(1), x.dtype)
            conv_pool.index_copy_(0, rows.slots, inputs[:, 1:].to(conv_pool.dtype))
            return out
        bounds = rows.boundaries(x.shape[0])
        out = torch.empty_like(x)
        finals = []
        for n in range(rows.num_sequences):
            start, end = bounds[n], bounds[n + 1]
            inputs = torch.cat([history[n].to(x.dtype), x[start:end]])  # [W - 1 + L, D]
            xf = inputs.to(acc_dtype)
            length = end - start
            acc = torch.zeros((length, channels), dtype=acc_dtype, device=x.device)
            for j in range(width):
                acc = acc + xf[j : j + length] * w[j]
            out[start:end] = _silu_stored(acc, x.dtype)
            finals.append(inputs[inputs.shape[0] - (width - 1) :])
        conv_pool.index_copy_(0, rows.slots, torch.stack(finals).to(conv_pool.dtype))
        return out

    # -- delta rule ------------------------------------------------------------------------------

    def delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        state_pool: torch.Tensor,
    ) -> torch.Tensor:
        tokens, key_heads, key_dim = q.shape
        heads, value_dim = v.shape[1], v.shape[2]
        if heads % key_heads:
            raise SpecError(f"{heads} value heads are not a multiple of {key_heads} key heads")
        check_state_pool(state_pool, (heads, value_dim, key_dim), "recurrent state")
        group = heads // key_heads
        # Head-major, value heads grouped under their key head: [Hk, r, T, ·]; q and k broadcast
        # over r (size 1), never copied to Hv heads.
        acc = self.accumulate
        qh = (l2_normalize(q, dtype=acc) * key_dim**-0.5).permute(1, 0, 2)[:, None]
        kh = l2_normalize(k, dtype=acc).permute(1, 0, 2)[:, None]
        vh = v.to(acc).view(tokens, key_heads, group, value_dim).permute(1, 2, 0, 3)
        gh = g.to(acc).view(tokens, key_heads, group).permute(1, 2, 0)
        bh = beta.to(acc).view(tokens, key_heads, group).permute(1, 2, 0)
        state = initial_states(state_pool, rows).view(-1, key_heads, group, value_dim, key_dim)
        if rows.cu_seqlens is None:
            out, final = _recurrent_step(qh, kh, vh, gh, bh, state)
            out = out.permute(2, 0, 1, 3)
        else:
            out, final = self._chunked(qh, kh, vh, gh, bh, state, rows.boundaries(tokens))
        state_pool.index_copy_(0, rows.slots, final.reshape(-1, heads, value_dim, key_dim))
        return out.reshape(tokens, heads, value_dim).to(v.dtype)

    def _chunked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        bounds: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's j-th chunk in one batched solve, j = 0, 1, …: each chunk is gathered
        into a [sequences, C] grid whose empty places read a zero token (g = 0, β = 0, k = v = 0:
        no decay, no write, nothing read), so a short chunk ends with the state it had. q, k
        ``[Hk, 1, T, K]``, v ``[Hk, r, T, V]``, g, beta ``[Hk, r, T]``, state ``[N, Hk, r, V, K]``.
        Returns (o ``[T, Hk, r, V]``, final state ``[N, Hk, r, V, K]``)."""
        tokens = v.shape[2]
        size = self.chunk_size

        def token_major(t: torch.Tensor) -> torch.Tensor:
            moved = t.movedim(2, 0)  # [T, Hk, r or 1, ·] or [T, Hk, r]
            return torch.cat([moved, moved.new_zeros((1, *moved.shape[1:]))])  # row T: the zero token

        qt, kt, vt, gt, bt = (token_major(t) for t in (q, k, v, g, beta))
        out = vt.new_zeros(vt.shape)
        state = state.clone()
        lengths = [bounds[n + 1] - bounds[n] for n in range(len(bounds) - 1)]
        for first in range(0, max(lengths, default=0), size):
            seqs = [n for n, length in enumerate(lengths) if length > first]
            width = min(size, max(lengths[n] - first for n in seqs))
            grid = torch.tensor(
                [
                    [bounds[n] + first + i if first + i < lengths[n] else tokens for i in range(width)]
                    for n in seqs
                ],
                device=v.device,
            )
            picked = torch.tensor(seqs, device=v.device)
            o_chunk, state_chunk = _chunk(
                _gather(qt, grid),
                _gather(kt, grid),
                _gather(vt, grid),
                _gather(gt, grid),
                _gather(bt, grid),
                state.index_select(0, picked),
            )
            state.index_copy_(0, picked, state_chunk)
            out.index_copy_(0, grid.flatten(), o_chunk.movedim(-2, 1).flatten(0, 1))
        return out[:tokens], state


def _gather(token_major: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Rows of a token-major tensor at ``grid [M, C]``, with the grid's C axis moved next to last
    (``[M, Hk, r, C, ·]``) or last (``[M, Hk, r, C]`` for g and beta)."""
    return token_major[grid].movedim(1, -2 if token_major.dim() == 4 else -1)


def _silu_stored(conv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The conv's sum stored, then its SiLU stored (the spec's two roundings)."""
    return F.silu(conv.to(dtype).to(conv.dtype)).to(dtype)


def _recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (the T axis is the sequence axis): the spec's recurrence, batched.
    q, k ``[Hk, 1, N, K]``; v ``[Hk, r, N, V]``; g, beta ``[Hk, r, N]``; state ``[N, Hk, r, V, K]``."""
    qn, kn = q.permute(2, 0, 1, 3)[:, :, :, None], k.permute(2, 0, 1, 3)[:, :, :, None]  # [N, Hk, 1, 1, K]
    vn = v.permute(2, 0, 1, 3)  # [N, Hk, r, V]
    gn, bn = g.permute(2, 0, 1), beta.permute(2, 0, 1)  # [N, Hk, r]
    state = state * gn.exp()[..., None, None]
    predicted = (state * kn).sum(-1)
    delta = bn[..., None] * (vn - predicted)
    state = state + delta[..., None] * kn
    out = (state * qn).sum(-1)  # [N, Hk, r, V]
    return out.permute(1, 2, 0, 3), state


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk in closed form (module doc), batched over leading dims: q, k ``[..., 1, C, K]``,
    v ``[..., r, C, V]``, g, beta ``[..., r, C]``, state ``[..., r, V, K]``."""
    size = v.shape[-2]
    gamma = g.cumsum(-1)  # [Hk, r, C]
    diff = gamma[..., :, None] - gamma[..., None, :]  # γ_i − γ_j
    lower = torch.ones(size, size, dtype=torch.bool, device=v.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    neg_inf = torch.tensor(float("-inf"), device=v.device)
    decay_incl = torch.where(lower, diff, neg_inf).exp()
    decay_strict = torch.where(strict, diff, neg_inf).exp()
    kt = k.transpose(-1, -2)
    system = beta[..., :, None] * decay_strict * (k @ kt)  # strictly lower; the unit diagonal is implied
    rhs = torch.cat(
        [beta[..., None] * v, (beta * gamma.exp())[..., None] * k.expand(*v.shape[:-1], k.shape[-1])], -1
    )
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    value_dim = v.shape[-1]
    state_t = state.transpose(-1, -2)  # [Hk, r, K, V]
    writes = solved[..., :value_dim] - solved[..., value_dim:] @ state_t
    out = (gamma.exp()[..., None] * q) @ state_t + (decay_incl * (q @ kt)) @ writes
    tail = (gamma[..., -1:] - gamma).exp()[..., None]  # e^(γ_C − γ_i)
    state = gamma[..., -1].exp()[..., None, None] * state + (writes * tail).transpose(-1, -2) @ k
    return out, state
