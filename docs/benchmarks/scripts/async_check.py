"""Async scheduling on the GPU: step time and token identity against synchronous scheduling.

    python docs/benchmarks/scripts/async_check.py CHECKPOINT [--batch-sizes 1,8,64] [--context 512]
        [--steps 64] [--save FILE]

The checkpoint is loaded twice, once per mode (`EngineConfig.async_scheduling` off, then on), with
CUDA graphs and the same fixed KV pool. Two workloads run in each:

- steady decode, per batch size B: B requests with C-token prompts decode together (half greedy,
  half seeded at temperature 0.8 with top-p 0.9, every row asking for its log-prob). The step time
  is the median wall time of one `scheduler.step()` over the steps where every row got its token,
  with no synchronisation between steps (a synchronous step ends on its token readback anyway; an
  async one launches the next forward and returns the previous one's tokens, so its time is the
  steady interval between tokens). Both modes run the same batches, so tokens and log-probs must
  be identical bit for bit.
- mixed: staggered arrivals, different max_tokens, stop tokens left on, two aborts mid-stream,
  seeded and greedy rows. The batches differ between the modes (a finished request leaves a step
  later under async scheduling), so under the `tuned` policy log-probs may differ in the last bits
  and a near-tie could flip a token: the table counts mismatching requests instead of asserting.

The exit status is 1 when a steady-decode stream differs (tokens or log-probs) or pages are left
in use; the mixed workload only reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.scheduler import BatchScheduler
from models.checkpoint import WeightCache, reusing_weights
from models.registry import ModelOptions, load_model

NUM_KV_PAGES = 8192


@dataclass
class Streams:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    pages_left: int = 0
    step_ms: float = 0.0
    steps_timed: int = 0

    def absorb(self, updates: tuple) -> None:
        for u in updates:
            self.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            self.logprobs.setdefault(u.request_id, []).extend(lp.logprob for lp in u.logprobs or ())


def _prompt(length: int, salt: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(salt)
    return tuple(torch.randint(10, 1000, (length,), generator=generator).tolist())


def _load(
    checkpoint: Path, async_scheduling: bool, max_seqs: int, cache: WeightCache, device: str
) -> BatchScheduler:
    engine = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        num_kv_pages=NUM_KV_PAGES,
        async_scheduling=async_scheduling,
    )
    with reusing_weights(cache):
        loaded = load_model(str(checkpoint), ModelOptions(engine=engine, device=device))
    assert isinstance(loaded.scheduler, BatchScheduler)
    return loaded.scheduler


def _steady(scheduler: BatchScheduler, batch: int, context: int, steps: int) -> Streams:
    for i in range(batch):
        sampling = (
            SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, logprobs=1)
            if i % 2 == 0
            else SamplingParams(
                max_tokens=steps + 8, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True, logprobs=1
            )
        )
        scheduler.submit(Request(f"b{batch}-{i}", _prompt(context, 1000 * batch + i), sampling))
    out = Streams()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    while scheduler.has_work():
        start = time.perf_counter()
        updates = scheduler.step().updates
        elapsed = (time.perf_counter() - start) * 1e3
        out.absorb(updates)
        # Steady decode: every row got its token and none finished.
        if sum(1 for u in updates if u.new_token_ids) == batch and not any(u.terminal for u in updates):
            times.append(elapsed)
    steady = times[5:] or times  # the first few warm up
    out.step_ms = statistics.median(steady)
    out.steps_timed = len(steady)
    out.pages_left = scheduler.load().kv_pages_used
    return out


ABORTS = {7: "m3", 15: "m10"}


def _mixed(scheduler: BatchScheduler, context: int) -> Streams:
    arrivals = []
    for i in range(24):
        sampling = SamplingParams(
            max_tokens=(4, 9, 17, 33)[i % 4],
            temperature=0.0 if i % 3 == 0 else 0.9,
            top_k=0 if i % 2 else 20,
            seed=None if i % 3 == 0 else 100 + i,
            logprobs=1,
        )
        arrivals.append(Request(f"m{i}", _prompt(16 + (i * 37) % context, 50_000 + i), sampling))
    out = Streams()
    step = 0
    while arrivals or scheduler.has_work():
        if arrivals and step % 2 == 0:
            scheduler.submit(arrivals.pop(0))
        if step in ABORTS:
            scheduler.abort(ABORTS[step])
        out.absorb(scheduler.step().updates)
        step += 1
    out.pages_left = scheduler.load().kv_pages_used
    return out


def _gap(a: dict[str, list[float]], b: dict[str, list[float]], skip: list[str]) -> float:
    gaps = [abs(x - y) for rid in a if rid not in skip for x, y in zip(a[rid], b.get(rid, []), strict=False)]
    return max(gaps, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--save", type=Path)
    # cpu: a dry run of the script's logic on a tiny checkpoint (no graphs, nothing overlaps).
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("async_check.py needs a CUDA GPU (or --device cpu for a dry run)")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cache = WeightCache()
    steady: dict[bool, dict[int, Streams]] = {}
    mixed: dict[bool, Streams] = {}
    stats: dict[str, int] = {}
    for mode in (False, True):
        scheduler = _load(args.checkpoint, mode, max(batches), cache, args.device)
        steady[mode] = {b: _steady(scheduler, b, args.context, args.steps) for b in batches}
        mixed[mode] = _mixed(scheduler, args.context)
        if mode:
            stats = dataclasses.asdict(scheduler.async_stats)
        del scheduler
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    failed = False
    rows = []
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{args.checkpoint.name} · {device_name} · context {args.context}")
    print(f"{'batch':>5} {'sync ms':>9} {'async ms':>9} {'speed-up':>9} {'tokens':>8} {'max |Δlp|':>10}")
    for b in batches:
        sync, pipelined = steady[False][b], steady[True][b]
        same_tokens = sync.tokens == pipelined.tokens
        gap = _gap(sync.logprobs, pipelined.logprobs, [])
        failed |= not same_tokens or gap != 0.0 or bool(sync.pages_left) or bool(pipelined.pages_left)
        row = {
            "batch": b,
            "sync_step_ms": sync.step_ms,
            "async_step_ms": pipelined.step_ms,
            "speedup": sync.step_ms / pipelined.step_ms,
            "steps_timed": [sync.steps_timed, pipelined.steps_timed],
            "tokens_identical": same_tokens,
            "max_logprob_gap": gap,
            "pages_left": [sync.pages_left, pipelined.pages_left],
        }
        rows.append(row)
        print(
            f"{b:>5} {sync.step_ms:>9.3f} {pipelined.step_ms:>9.3f} {row['speedup']:>8.2f}× "
            f"{'same' if same_tokens else 'DIFFER':>8} {gap:>10.2e}"
        )
    aborted = sorted(ABORTS.values())
    finished = [rid for rid in mixed[False].tokens if rid not in aborted]
    mismatched = [rid for rid in finished if mixed[False].tokens[rid] != mixed[True].tokens.get(rid)]
    mixed_gap = _gap(mixed[False].logprobs, mixed[True].logprobs, aborted + mismatched)
    print(
        f"mixed workload: {len(mismatched)} of {len(finished)} streams differ {mismatched}; max |Δ log-prob| "
        f"over the matching streams {mixed_gap:.2e}; pages left {mixed[False].pages_left}/{mixed[True].pages_left}"
    )
    print(f"async stats: {stats}")
    failed |= bool(mixed[True].pages_left)
    if args.save is not None:
        payload = {
            "checkpoint": str(args.checkpoint),
            "device": device_name,
            "context": args.context,
            "steady": rows,
            "mixed": {"mismatched": mismatched, "max_logprob_gap": mixed_gap},
            "async_stats": stats,
        }
        args.save.write_text(json.dumps(payload, indent=1))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
