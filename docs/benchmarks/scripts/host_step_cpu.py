"""The engine's host work per decode step on the CPU, with the model's forward taken out.

    PYTHONPATH=. python3 docs/benchmarks/scripts/host_step_cpu.py CKPT [--batch-sizes 1,8,64,256]
        [--runs 5] [--steps 20] [--context 512] [--profile-batch 64] [--top 25]

CKPT is a Qwen3 checkpoint (`infer synth qwen3 --preset tiny --out DIR`). For each batch size B and
each mode (synchronous, `--async-scheduling`) it loads the model on the CPU, replaces the model's
forward and logits with zeros of the right shapes (every sampled token is then 0; requests ignore
EOS), prefills B requests of `--context` random tokens, warms 3 steps, and times `runs` runs of
`steps` decode steps each. What is left in a step is the engine's host work: scheduling, page
accounting, packing the step's tensors, the torch attention backend's plan, packing the sampling
batch, sampling zero logits, the ledger. It reports the median over runs of each run's mean µs per
step, then cProfile's top functions (by self time) over `steps` steps at `--profile-batch`.

CPU figures only: they rank host costs against each other and before/after a change; the GPU's
host gaps (docs/benchmarks/qwen3.md) are measured with docs/benchmarks/scripts/host_profile.py.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.scheduler import BatchScheduler
from models.registry import ModelOptions, load_model

WARM_STEPS = 3


def _scheduler(ckpt: str, batch: int, context: int, steps: int, asynchronous: bool) -> BatchScheduler:
    """A scheduler with `batch` requests prefilled and warmed, its model's forward stubbed out."""
    config = EngineConfig(
        max_num_seqs=batch,
        num_kv_pages=batch * (context // 16 + steps + 8) + 64,
        max_num_batched_tokens=8192,
        async_scheduling=asynchronous,
    )
    loaded = load_model(ckpt, ModelOptions(engine=config, device="cpu"))
    scheduler = loaded.scheduler
    model = scheduler.runner.model  # type: ignore[attr-defined]
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    model.forward = lambda step: torch.zeros(step.sample_index.shape[0], hidden)
    model.logits = lambda h: torch.zeros(h.shape[0], vocab)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=context, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = tuple(torch.randint(10, 1000, (context,), generator=generator).tolist())
        scheduler.submit(Request(f"r{i}", prompt, params))
    while scheduler.load().waiting or scheduler.prefilling_count():
        scheduler.step()
    for _ in range(WARM_STEPS):
        scheduler.step()
    return scheduler


def _time_steps(scheduler: BatchScheduler, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        scheduler.step()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--profile-batch", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    # Every timed step must be a decode step of every request: none may finish meanwhile.
    total_steps = WARM_STEPS + args.runs * args.steps + args.steps
    if total_steps >= args.context:
        parser.error(
            f"--context {args.context} is too short for {total_steps} decode steps (max_tokens=context)"
        )
    torch.set_grad_enabled(False)

    print(f"host µs per decode step (forward stubbed), median of {args.runs} runs x {args.steps} steps")
    print(f"{'batch':>6} {'sync':>10} {'async':>10}")
    for batch in batches:
        figures = []
        for asynchronous in (False, True):
            scheduler = _scheduler(args.checkpoint, batch, args.context, total_steps, asynchronous)
            runs = [_time_steps(scheduler, args.steps) for _ in range(args.runs)]
            figures.append(statistics.median(runs))
        print(f"{batch:>6} {figures[0]:>10.0f} {figures[1]:>10.0f}", flush=True)

    scheduler = _scheduler(args.checkpoint, args.profile_batch, args.context, total_steps, False)
    profile = cProfile.Profile()
    profile.enable()
    _time_steps(scheduler, args.steps)
    profile.disable()
    print(f"\ncProfile, synchronous, batch {args.profile_batch}, {args.steps} steps, by self time:")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
