"""A numeric policy by name → the `linear(x, weight)` a model applies to every projection and its LM head."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.gemm.names import NumericPolicy, parse_policy
from kernels.gemm.per_token import per_token_linear
from kernels.gemm.pin import PinnedGemm
from kernels.triton.invariant_gemm import GemmTiles, invariant_gemm

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The one configuration `invariant` runs for every shape and every row count.
INVARIANT_TILES = GemmTiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return invariant_gemm(x, weight, INVARIANT_TILES)


def policy_linear(policy: NumericPolicy | str) -> Linear:
    """The linear of a policy. `pin` gets a fresh `PinnedGemm` (its pins live as long as the model)."""
    chosen = parse_policy(policy) if isinstance(policy, str) else policy
    if chosen is NumericPolicy.TUNED:
        return F.linear
    if chosen is NumericPolicy.PIN:
        return PinnedGemm()
    if chosen is NumericPolicy.PER_TOKEN:
        return per_token_linear
    return invariant_linear
