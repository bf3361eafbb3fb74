"""The engine's sampler on the GPU: the Triton token draw against the spec's torch ops, per batch size
and row mix, on one vocabulary (Qwen3's by default), with the tokens of both compared.

    python docs/benchmarks/scripts/sampler_timing.py [--vocab 151936] [--batch-sizes 1,8,64,256] [--save FILE]

Each line: the mix, the batch, `sample(...)` in ms through the kernel and through the spec (the
median of `infer_cli.bench.timing.device_ms`, L2 flushed before each call), the wall time per call
of 200 back-to-back calls (where launches, not the device, bound a small batch), and how many rows' tokens
differ between the two (the kernel and torch's CUDA kernels call the same libdevice functions, so 0
is expected; tests/kernels/test_token_draw.py says what a difference may be). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.contract import SamplingParams
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch
from infer_cli.bench.timing import cuda_device, device_ms, versions

MIXES = {
    "temperature": SamplingParams(temperature=0.8),
    "min-p": SamplingParams(temperature=0.8, min_p=0.05),
    "top-p + min-p": SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05),
    "greedy": SamplingParams(temperature=0.0),
}


def wall_ms(fn: Callable[[], object], calls: int = 200) -> float:
    """Mean wall milliseconds per call of `calls` calls queued back to back, synchronised at the end."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def measure(mix: str, params: SamplingParams, batch_size: int, vocab: int, device: torch.device) -> dict:
    logits = torch.randn(batch_size, vocab, device=device) * 4
    batch = SamplingBatch.pack([RowSampling(params, seed=1000 + i, step=i) for i in range(batch_size)])
    tensors = batch.to(device)

    def through(kernel: bool) -> torch.Tensor:
        return sample(logits, tensors, batch.plan, triton_draw=kernel).token_ids

    return {
        "mix": mix,
        "batch": batch_size,
        "kernel_ms": device_ms(lambda: through(True)),
        "spec_ms": device_ms(lambda: through(False)),
        "kernel_wall_ms": wall_ms(lambda: through(True)),
        "spec_wall_ms": wall_ms(lambda: through(False)),
        "rows_differing": int((through(True) != through(False)).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    device = cuda_device()
    results = []
    for mix, params in MIXES.items():
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            row = measure(mix, params, batch_size, args.vocab, device)
            results.append(row)
            print(
                f"{mix:>14}  batch {batch_size:>4}  kernel {row['kernel_ms']:.4f} ms "
                f"(wall {row['kernel_wall_ms']:.4f})  spec {row['spec_ms']:.4f} ms "
                f"(wall {row['spec_wall_ms']:.4f})  rows differing {row['rows_differing']}"
            )
    if args.save:
        meta = {"device": torch.cuda.get_device_name(device), "vocab": args.vocab, **versions()}
        args.save.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
