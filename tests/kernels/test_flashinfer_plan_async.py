"""FlashInfer planning never waits for the stream (CUDA only).

Under async scheduling the host plans step N+1 while step N runs; a plan that synchronises makes
the step wait for its predecessor and the pipeline gains nothing (the H100 host profile at df50211
found FlashInfer's graph planner copying the page indices with a blocking copy). Each plan below is
queued behind a kernel that spins for a while: the stream must still be busy when the plan returns.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention.base import AttentionLayerSpec, GroupBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Qwen3-4B's geometry: the FlashInfer modules a Qwen3 run builds anyway.
LAYER = AttentionLayerSpec(num_heads=32, num_kv_heads=8, head_dim=128, scale=128**-0.5)
DECODE = GroupBatch(q_lens=(1, 1), kv_lens=(17, 40), page_tables=((5, 6), (2, 3, 4)), page_size=16)
MIXED = GroupBatch(q_lens=(5, 1), kv_lens=(5, 40), page_tables=((1,), (2, 3, 4)), page_size=16)
SPIN_CYCLES = 1_000_000_000  # ~0.5 s at the H100's clock: far longer than any plan


@pytest.mark.parametrize(
    ("batch", "bucket"), [(DECODE, 2), (DECODE, None), (MIXED, None)], ids=["graph-decode", "decode", "mixed"]
)
def test_a_plan_queued_behind_running_work_returns_before_it_ends(
    batch: GroupBatch, bucket: int | None
) -> None:
    from kernels.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(torch.device("cuda"), torch.bfloat16, max_pages_per_seq=8)
    for group in (0, 1):  # the first plan builds FlashInfer's module; a second group has its own buffers
        backend.plan(group, batch, LAYER, graph_bucket=bucket)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    for group in (0, 1):
        backend.plan(group, batch, LAYER, graph_bucket=bucket)
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running, "planning waited for the kernel queued before it"
