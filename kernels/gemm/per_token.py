"""`per-token`: one GEMM per row. A row's result is the same 1-row GEMM alone or in any batch, so
this is batch-invariant by construction; it is a diagnostic oracle, slow, and its decode graphs
hold rows × projections GEMM nodes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_token_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return F.linear(x, weight)
    out = torch.cat([F.linear(rows[i : i + 1], weight) for i in range(rows.shape[0])])
    return out.reshape(*lead, weight.shape[0])
