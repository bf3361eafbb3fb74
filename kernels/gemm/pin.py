"""`pin`: one fixed kernel configuration per weight shape, chosen once and reused for every batch size.

The first call with a weight shape (N, K, dtype) picks a configuration from `PIN_CANDIDATES`, in
order, the first that can run that shape; every later call with that shape, whatever its number of
rows, runs the same configuration. A shape no candidate can run, or an explicitly pinned
configuration that cannot run the shape, is an error naming the shape: there is no fallback to
another kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kernels.triton.invariant_gemm import GemmShapeError, GemmTiles, invariant_gemm

# Unmasked-K configurations, widest first: each trades generality for a K loop without masks.
PIN_CANDIDATES: tuple[GemmTiles, ...] = (
    GemmTiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3, even_k=True),
    GemmTiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, even_k=True),
    GemmTiles(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3, even_k=True),
    GemmTiles(block_m=64, block_n=64, block_k=16, num_warps=4, num_stages=2, even_k=True),
)


class PinError(GemmShapeError):
    """A weight shape the pinned configuration cannot run."""


@dataclass(frozen=True, slots=True)
class WeightShape:
    n: int
    k: int
    dtype: torch.dtype

    @classmethod
    def of(cls, weight: torch.Tensor) -> WeightShape:
        if weight.dim() != 2:
            raise PinError(f"weight shape {tuple(weight.shape)}: must be 2-D [N, K]")
        return cls(int(weight.shape[0]), int(weight.shape[1]), weight.dtype)

    def __str__(self) -> str:
        return f"[{self.n}, {self.k}] {str(self.dtype).removeprefix('torch.')}"


class PinnedGemm:
    """A `linear(x, weight)` that pins one `GemmTiles` per weight shape on first use."""

    def __init__(self, candidates: Sequence[GemmTiles] = PIN_CANDIDATES) -> None:
        if not candidates:
            raise PinError("no candidate configurations to pin from")
        self.candidates = tuple(candidates)
        self._pinned: dict[WeightShape, GemmTiles] = {}

    @property
    def pinned(self) -> Mapping[WeightShape, GemmTiles]:
        return dict(self._pinned)

    def pin(self, shape: WeightShape, tiles: GemmTiles) -> None:
        """Pin `tiles` for `shape` explicitly; refused if it cannot run the shape or differs from a pin."""
        why = tiles.runs(shape.n, shape.k)
        if why is not None:
            raise PinError(f"weight shape {shape}: cannot pin {tiles}: {why}")
        held = self._pinned.get(shape)
        if held is not None and held != tiles:
            raise PinError(f"weight shape {shape} is already pinned to {held}; refusing {tiles}")
        self._pinned[shape] = tiles

    def choose(self, shape: WeightShape) -> GemmTiles:
        """The configuration for `shape`: the pinned one, else the first candidate that runs it (pinned)."""
        held = self._pinned.get(shape)
        if held is not None:
            return held
        reasons = []
        for tiles in self.candidates:
            why = tiles.runs(shape.n, shape.k)
            if why is None:
                self._pinned[shape] = tiles
                return tiles
            reasons.append(why)
        raise PinError(f"weight shape {shape}: no pinnable configuration runs it ({'; '.join(reasons)})")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        shape = WeightShape.of(weight)
        tiles = self.choose(shape)
        why = tiles.runs(shape.n, shape.k)
        if why is not None:  # a pin set behind our back; never fall back
            raise PinError(f"weight shape {shape}: pinned {tiles} cannot run it: {why}")
        return invariant_gemm(x, weight, tiles)
