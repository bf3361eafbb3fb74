"""The engine's host work per decode step on the CPU, with the model's forward taken out.

    PYTHONPATH=. python3 docs/benchmarks/scripts/host_step_cpu.py CKPT [--batch-sizes 1,8,64,256]
        [--runs 5] [--steps 20] [--context 512] [--profile-batch 64] [--top 25]
        [--phases 64,256]

CKPT is a Qwen3 checkpoint (`infer synth qwen3 --preset tiny --out DIR`). For each batch size B and
each mode (synchronous, `--async-scheduling`) it loads the model on the CPU, replaces the model's
forward and logits with zeros of the right shapes (every sampled token is then 0; requests ignore
EOS), prefills B requests of `--context` random tokens, warms 3 steps, and times `runs` runs of
`steps` decode steps each. What is left in a step is the engine's host work: scheduling, page
accounting, packing the step's tensors, the torch attention backend's plan, packing the sampling
batch, sampling zero logits, the ledger. It reports the median over runs of each run's mean µs per
step, then cProfile's top functions (by self time) over `steps` steps at `--profile-batch`.

`--phases B,...` instead times the phases of a step at each batch size B, both modes: timers
wrapped around the engine's functions by name (each adds about 1 µs a call, so the per-call phases
of a step's loop are not wrapped), mean µs per step over 3 × 60 steps, the set with the least
total. Phases nest (see `_PHASES`).

CPU figures only: they rank host costs against each other and before/after a change; the GPU's
host gaps (docs/benchmarks/qwen3.md) are measured with docs/benchmarks/scripts/host_profile.py.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

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
    if not isinstance(scheduler, BatchScheduler):
        raise SystemExit(f"{ckpt}: {type(scheduler).__name__} is not a paged model's scheduler")
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


# (owner module, attribute path, label): the phases `--phases` times. Under async scheduling the
# launch contains packing, the sampling batch and sampling, and the collect contains the sampled
# tokens and the landing; in a synchronous step they run inside the runner's `execute`.
_PHASES = (
    ("engine.scheduler", "BatchScheduler._schedule", "scheduling"),
    ("engine.scheduler", "BatchScheduler._launch_step", "launch (async)"),
    ("engine.model_runner", "pack_step", "packing and attention plan"),
    ("engine.sampling_batch", "SamplingBatch.of_step", "sampling batch"),
    ("engine.model_runner", "sample", "sampling (argmax of zeros, mostly)"),
    ("engine.scheduler", "BatchScheduler._collect", "collect (async)"),
    ("engine.model_runner", "_LaunchedStep.collect", "sampled tokens (async)"),
    ("engine.scheduler", "BatchScheduler._land", "landing (async)"),
    ("engine.scheduler", "BatchScheduler._apply", "applying the tokens (sync)"),
    ("engine.ledger", "RequestLedger.drain", "ledger drain"),
)


def _time_phases(scheduler: BatchScheduler, steps: int) -> dict[str, float]:
    """Mean µs per step of each phase, with timers wrapped around the functions `_PHASES` names."""
    import importlib

    spent: dict[str, float] = {}
    undo = []
    for module_name, path, label in _PHASES:
        owner: object = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        original = getattr(owner, name, None)
        if original is None:
            continue

        def timed(
            *args: object, _original: Callable[..., object] = original, _label: str = label, **kwargs: object
        ) -> object:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)
        undo.append((owner, name, original))
    best: dict[str, float] = {}
    try:
        for _ in range(3):
            spent.clear()
            total = _time_steps(scheduler, steps)
            if not best or total < best["step"]:
                best = {"step": total, **{k: v / steps * 1e6 for k, v in spent.items()}}
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
    return best


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
    parser.add_argument("--phases", default=None, help="batch sizes whose step phases are timed instead")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    # Every timed step must be a decode step of every request: none may finish meanwhile.
    total_steps = WARM_STEPS + args.runs * args.steps + args.steps
    if total_steps >= args.context:
        parser.error(
            f"--context {args.context} is too short for {total_steps} decode steps (max_tokens=context)"
        )
    torch.set_grad_enabled(False)

    if args.phases is not None:
        phase_steps = 60
        for batch in [int(b) for b in args.phases.split(",")]:
            for asynchronous in (False, True):
                # 3 timed sets of `phase_steps` after the warm steps: room for them in the context.
                scheduler = _scheduler(args.checkpoint, batch, args.context, 4 * phase_steps, asynchronous)
                phases = _time_phases(scheduler, phase_steps)
                mode = "async" if asynchronous else "sync"
                print(f"\nbatch {batch}, {mode}: µs per step (timers included) {phases.pop('step'):.0f}")
                for _, _, label in _PHASES:
                    if label in phases:
                        print(f"  {label:<40} {phases[label]:>8.0f}")
        return

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
