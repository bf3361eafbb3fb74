"""A numeric policy by name → the `linear(x, weight)` a model applies to every projection and its LM head."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.gemm.cpu_gemv import CpuLinear
from kernels.gemm.names import NumericPolicy, parse_policy
from kernels.gemm.per_token import per_token_linear
from kernels.gemm.pin import PinnedGemm
from kernels.gemm.skinny_dispatch import SkinnyDispatch, measured_table
from kernels.triton.invariant_gemm import PREFILL_TILES, PREFILL_TILES_CUT, GemmTiles, invariant_gemm

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

log = logging.getLogger("infer.gemm")

# The one configuration `invariant` runs for every shape and every row count. K is cut per weight
# shape so that one row block spreads over at least 264 programs (two per SM of a 132-SM H100 or
# H200): at one row Qwen3-4B's O and down projections have 40 column tiles, so 7 chunks each.
# Launches with rows enough to fill those programs in the many-rows tiles take them (prefill:
# 128 × 256 for a whole K, 128 × 128 for a cut one; the same bits: docs/numerics.md).
INVARIANT_TILES = GemmTiles(
    block_m=64,
    block_n=64,
    block_k=64,
    num_warps=4,
    num_stages=3,
    split_programs=264,
    many_rows=PREFILL_TILES,
    many_rows_cut=PREFILL_TILES_CUT,
)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return invariant_gemm(x, weight, INVARIANT_TILES)


def policy_linear(policy: NumericPolicy | str, device: torch.device | None = None) -> Linear:
    """The linear of a policy on `device`. `tuned`: the skinny-GEMM dispatch where a table was
    measured on this device (`skinny_dispatch.measured_table`), cuBLAS otherwise; on the CPU,
    `CpuLinear` (a column-major copy for a few rows against a large weight). `pin` gets a fresh
    `PinnedGemm` (its pins live as long as the model)."""
    chosen = parse_policy(policy) if isinstance(policy, str) else policy
    if chosen is NumericPolicy.TUNED:
        table = None
        if device is not None and device.type == "cpu":
            return CpuLinear()
        if device is not None and device.type == "cuda":
            table = measured_table(torch.cuda.get_device_name(device))
            if table is None:
                log.info("no skinny-GEMM table for %s: cuBLAS for every projection", device)
        return F.linear if table is None else SkinnyDispatch(table)
    if chosen is NumericPolicy.PIN:
        return PinnedGemm()
    if chosen is NumericPolicy.PER_TOKEN:
        return per_token_linear
    return invariant_linear
