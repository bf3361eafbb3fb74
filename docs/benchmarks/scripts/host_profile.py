"""Where a step's host time goes: cProfile over whole engine steps of a served model, decode at each
batch size (CUDA graphs on) and one prefill, printing the functions that take the most host time.

    python3 docs/benchmarks/scripts/host_profile.py CKPT [--batch-sizes 1,8,64] [--prefill 1024]
        [--async-scheduling] [--attention-backend flashinfer|triton] [--save FILE.json]

With `--async-scheduling` a step launches the next forward before it waits for the last, so the
one call that should hold the host is the wait for step N's tokens (`Event.synchronize`); any other
call with a large self time is where the host blocks on the device and the overlap is lost. The
decode steps then also run under `torch.cuda.set_sync_debug_mode("warn")`, and every synchronising
torch call is counted by the line that made it ("syncs" in the report; torch sees its own ops only,
not a library's C++ copies). One more prefill, in either mode, is counted the same way.

Each decode batch: B requests of a 512-token prompt, prefilled, warmed 5 steps, then 20 profiled
steps. The prefill: one fresh 1k-token prompt in one step after a warm-up prefill. cProfile adds
its own cost per Python call, so compare functions against each other, not against the untimed
step; the untimed median of the same steps is printed beside it.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from models.registry import ModelOptions, load_model

CONTEXT = 512
STEPS = 20


def _prompt(length: int, salt: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(salt)
    return tuple(torch.randint(10, 1000, (length,), generator=g).tolist())


def _top(profile: cProfile.Profile, steps: int, limit: int = 25) -> list[dict[str, object]]:
    stats = pstats.Stats(profile)
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(filename).name}:{line}({name})",
                "calls_per_step": calls / steps,
                "self_us_per_step": 1e6 * tottime / steps,
                "cumulative_us_per_step": 1e6 * cumtime / steps,
            }
        )
    rows.sort(key=lambda r: -float(r["self_us_per_step"]))  # type: ignore[arg-type]
    return rows[:limit]


def _print(title: str, rows: list[dict[str, object]], untimed_ms: float) -> None:
    print(f"\n== {title}: untimed median step {untimed_ms:.3f} ms; by self time per step")
    for r in rows:
        print(
            f"  {r['self_us_per_step']:9.1f} us self  {r['cumulative_us_per_step']:9.1f} us cum  "
            f"{r['calls_per_step']:7.1f} calls  {r['function']}"
        )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_steps(step, n: int, overlapped: bool) -> float:  # type: ignore[no-untyped-def]
    """Median step time; overlapped (async) steps are timed back to back, since a sync before each
    would remove the overlap being measured."""
    if overlapped:
        _sync()
        start = time.perf_counter()
        for _ in range(n):
            step()
        _sync()
        return (time.perf_counter() - start) * 1e3 / n
    times = []
    for _ in range(n):
        _sync()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _sync_sites(step, n: int) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """The synchronising torch calls of n steps, counted per call site (the innermost frame in this
    project's code), most frequent first."""
    if not torch.cuda.is_available():
        return []
    counts: collections.Counter[str] = collections.Counter()
    root = Path(__file__).resolve().parents[3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(n):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" not in str(warning.message).lower():
            continue
        site = f"{Path(warning.filename).name}:{warning.lineno}"
        for frame in reversed(traceback.extract_stack()):
            if str(root) in frame.filename and "host_profile" not in frame.filename:
                site = f"{Path(frame.filename).relative_to(root)}:{frame.lineno}"
                break
        counts[f"{site} · {str(warning.message).splitlines()[0][:80]}"] += 1
    return [{"site": site, "per_step": count / n} for site, count in counts.most_common()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--attention-backend")
    parser.add_argument("--save")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = EngineConfig(max_num_seqs=max(batches), async_scheduling=args.async_scheduling)
    loaded = load_model(
        args.checkpoint, ModelOptions(engine=engine, attention_backend=args.attention_backend)
    )
    scheduler = loaded.scheduler
    report: dict[str, object] = {}
    for batch in batches:
        params = SamplingParams(max_tokens=5 + 3 * STEPS + 2, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            scheduler.submit(Request(f"d{batch}-{i}", _prompt(CONTEXT, 1000 * batch + i), params))
        while scheduler.load().waiting or scheduler.prefilling_count():
            scheduler.step()
        for _ in range(5):
            scheduler.step()
        untimed = _timed_steps(scheduler.step, STEPS, args.async_scheduling)
        profile = cProfile.Profile()
        _sync()
        profile.enable()
        for _ in range(STEPS):
            scheduler.step()
        profile.disable()
        rows = _top(profile, STEPS)
        _print(f"decode batch {batch}", rows, untimed)
        syncs = _sync_sites(scheduler.step, STEPS) if args.async_scheduling else []
        for site in syncs:
            print(f"  sync {site['per_step']:5.1f}/step  {site['site']}")
        report[f"decode-{batch}"] = {"untimed_step_ms": untimed, "top": rows, "syncs": syncs}
        while scheduler.has_work():
            scheduler.step()
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(2):  # the first warms this shape
        scheduler.submit(Request(f"p{i}", _prompt(args.prefill, 7_000 + i), once))
        _sync()
        start = time.perf_counter()
        profile = cProfile.Profile()
        if i:
            profile.enable()
        scheduler.step()
        _sync()
        profile.disable()
        elapsed = (time.perf_counter() - start) * 1e3
        while scheduler.has_work():
            scheduler.step()
    rows = _top(profile, 1)
    _print(f"prefill {args.prefill} (profiled step {elapsed:.2f} ms)", rows, elapsed)

    def prefill_once() -> None:
        scheduler.submit(Request("p-sync", _prompt(args.prefill, 7_002), once))
        while scheduler.has_work():
            scheduler.step()

    # A synchronous step syncs once to read its token; any other site is where the host waited for
    # the device mid-step (the steps after the prefill's, draining it, are counted too).
    syncs = _sync_sites(prefill_once, 1)
    for site in syncs:
        print(f"  sync {site['per_step']:5.1f}/prefill  {site['site']}")
    report[f"prefill-{args.prefill}"] = {"profiled_step_ms": elapsed, "top": rows, "syncs": syncs}
    report["options"] = {
        "async_scheduling": args.async_scheduling,
        "attention_backend": args.attention_backend,
    }
    if args.save:
        Path(args.save).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
