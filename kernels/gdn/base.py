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


class GDNBackend(ABC):
    """One implementation of the two GDN ops. Both read the state of each sequence from
    ``pool[slots]`` (zeros where ``fresh``) and write its final state back there."""

    name: str

    @abstractmethod
    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, rows: StateRows, conv_pool: torch.Tensor
    ) -> torch.Tensor:
        """``reference.causal_conv1d`` of ``x [T, D]`` with ``weight [D, W]``; ``conv_pool
        [slots, W - 1, D]`` in x's dtype."""

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
