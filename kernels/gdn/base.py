"""The seam every Gated DeltaNet backend implements: the causal conv and the gated delta rule of
one GDN layer over a packed token batch, each reading and writing its per-sequence state in a
slot pool in place (kernels/reference.py states what both compute).

A batch is one or more sequences back to back. `StateRows` says, per sequence, which pool slot
holds its state and whether it starts from zero (its first token is at position 0). Slot 0 is the
padding slot: CUDA-graph filler rows read and write it and nothing else reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.reference import SpecError, check_cu_seqlens


class GDNBackendError(ValueError):
    """A `--gdn-backend` value that this machine or this build cannot run; the message says why."""


@dataclass(frozen=True, slots=True)
class GDNGeometry:
    """One GDN layer's head layout: ``key_heads`` (Hk) q/k heads of ``key_dim`` (K), ``value_heads``
    (Hv, a multiple of Hk) v heads of ``value_dim`` (V)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        if min(self.key_heads, self.value_heads, self.key_dim, self.value_dim) < 1:
            raise SpecError(f"GDN geometry {self} must have positive heads and dims")
        if self.value_heads % self.key_heads:
            raise SpecError(
                f"{self.value_heads} value heads are not a multiple of {self.key_heads} key heads"
            )


@dataclass(frozen=True, slots=True)
class StateRows:
    """``slots [N]`` int64 and ``fresh [N]`` bool on the compute device; ``cu_seqlens`` the N
    sequences' token boundaries on the host, or None when every sequence is one token (a decode
    step: then N equals the token count and nothing needs the host)."""

    slots: torch.Tensor
    fresh: torch.Tensor
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.slots.shape[0])

    def boundaries(self, tokens: int) -> Sequence[int]:
        """The sequences' boundaries, decode steps included (one token each)."""
        bounds = tuple(range(self.num_sequences + 1)) if self.cu_seqlens is None else self.cu_seqlens
        check_cu_seqlens(bounds, tokens)
        return bounds


def check_state_pool(pool: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """A pool layer is ``[slots, *shape]``."""
    if pool.dim() != len(shape) + 1 or tuple(pool.shape[1:]) != shape:
        raise SpecError(
            f"{name} pool layer must be [slots, {', '.join(map(str, shape))}], got {list(pool.shape)}"
        )


def initial_states(pool: torch.Tensor, rows: StateRows) -> torch.Tensor:
    """Each sequence's state from its slot, zeros for fresh sequences (their slot may hold a
    finished request's state): a new ``[N, *pool.shape[1:]]`` tensor."""
    gathered = pool.index_select(0, rows.slots)
    keep = (~rows.fresh).view(-1, *([1] * (pool.dim() - 1)))
    return torch.where(keep, gathered, torch.zeros((), dtype=pool.dtype, device=pool.device))


class GDNBackend(ABC):
    """One implementation of the two GDN ops. Both read the state of each sequence from
    ``pool[slots]`` (zeros where ``fresh``) and write its final state back there."""

    name: str
    # Where fp32 operands meet inside a kernel's dot products: "ieee" (fp32 products), or "tf32"
    # where the kernel rounds them to TF32 whatever TRITON_F32_DEFAULT says. The agreement check
    # holds fp32 inputs to the matching unit (kernels/gdn/agreement.py).
    fp32_dots: str = "ieee"

    def warm_up(self, geometry: GDNGeometry, dtype: torch.dtype, device: torch.device) -> None:
        """Build, tune and pin whatever this backend compiles or chooses on first use for this
        geometry, so that start-up does it before KV is allocated and before graph capture rather
        than the first request. Nothing to do by default."""
        return

    def check(self, geometry: GDNGeometry, dtype: torch.dtype) -> None:
        """Refuse, with a SpecError naming the value, a geometry or q/k/v dtype this backend does
        not cover: a model line calls it before any weight is read. Everything by default."""
        return

    def describe(self) -> str:
        """What runs each phase, for logs and reports."""
        return self.name

    @abstractmethod
    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, rows: StateRows, conv_pool: torch.Tensor
    ) -> torch.Tensor:
        """``reference.causal_conv1d`` of ``x [T, D]`` with ``weight [D, W]``; ``conv_pool
        [slots, W - 1, D]`` in x's dtype."""

    def conv_pieces(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: StateRows,
        conv_pool: torch.Tensor,
        widths: Sequence[int],
    ) -> tuple[torch.Tensor, ...]:
        """``conv``'s output cut along its channels into pieces of ``widths`` (summing to D), the
        same values. Here views of one output; a backend whose kernel can write each piece dense
        does (q, k and v that a chunked kernel would otherwise copy into dense tensors)."""
        return tuple(self.conv(x, weight, rows, conv_pool).split(list(widths), dim=-1))

    @abstractmethod
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
        """``reference.gated_delta_rule`` (its L2 norm and default scale included); ``state_pool
        [slots, Hv, V, K]`` fp32. Returns ``o [T, Hv, V]`` in v's dtype."""


def warm_up_both_phases(
    backend: GDNBackend, geometry: GDNGeometry, dtype: torch.dtype, device: torch.device
) -> None:
    """One varlen prefill (lengths straddling a 64-token chunk) and one decode step on a scratch
    pool: whatever the backend compiles or tunes on first use happens here."""
    lengths = (1, 63, 130)
    sequences = len(lengths)
    pool = torch.zeros(
        (sequences + 1, geometry.value_heads, geometry.value_dim, geometry.key_dim), device=device
    )
    gen = torch.Generator(device=device).manual_seed(0)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)

    def batch(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(tokens, geometry.key_heads, geometry.key_dim, generator=gen, device=device)
        k = torch.randn(tokens, geometry.key_heads, geometry.key_dim, generator=gen, device=device)
        v = torch.randn(tokens, geometry.value_heads, geometry.value_dim, generator=gen, device=device)
        g = -torch.rand(tokens, geometry.value_heads, generator=gen, device=device)
        beta = torch.rand(tokens, geometry.value_heads, generator=gen, device=device)
        return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)

    slots = torch.arange(1, sequences + 1, device=device)
    fresh = torch.ones(sequences, dtype=torch.bool, device=device)
    backend.delta_rule(*batch(bounds[-1]), StateRows(slots, fresh, tuple(bounds)), pool)
    backend.delta_rule(*batch(sequences), StateRows(slots, ~fresh), pool)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
