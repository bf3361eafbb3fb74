"""Start-up as `infer serve` does it — utilisation 0.9, every decode bucket up to 256 captured, the
KV pool sized from the measured budget — once per numeric policy. Each either starts, and then the
graph memory it reserved is set beside what the graphs took, with the KV pages and free device
memory against the margin the engine promised to leave; or it refuses at start-up, and its message
(which names the largest bucket that fits) is kept. An out-of-memory error is neither, and is
reported as a failure. Issue 7's start-up acceptance point, for every policy (the
graph_memory_is_reserved gates cover tuned and invariant, with the largest steps run too).

    python docs/benchmarks/scripts/startup_per_policy.py CHECKPOINT \
        [--policies tuned,pin,per-token,invariant] [--save FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import MAX_GRAPH_BUCKET
from engine.memory_budget import GIB, MemoryBudgetError
from engine.model_runner import PagedModelRunner
from engine.scheduler import BatchScheduler
from gates.harness.graph_memory import UTILISATION, read_margin
from models.checkpoint import WeightCache, reusing_weights
from models.registry import ModelOptions, load_model


def start_once(checkpoint: Path, policy: str, cache: WeightCache) -> dict[str, Any]:
    engine = EngineConfig(
        numeric_policy=policy, gpu_memory_utilization=UTILISATION, max_num_seqs=MAX_GRAPH_BUCKET
    )
    started = time.perf_counter()
    try:
        with reusing_weights(cache):
            loaded = load_model(str(checkpoint), ModelOptions(engine=engine, device="cuda"))
    except MemoryBudgetError as exc:
        return {"policy": policy, "outcome": "refused", "message": str(exc)}
    except torch.OutOfMemoryError as exc:
        return {"policy": policy, "outcome": "out-of-memory", "message": str(exc)[:2000]}
    seconds = time.perf_counter() - started
    scheduler = loaded.scheduler
    assert isinstance(scheduler, BatchScheduler) and isinstance(scheduler.runner, PagedModelRunner)
    graphs = scheduler.runner.graphs
    margin = read_margin(f"{policy} after start-up", UTILISATION)
    row: dict[str, Any] = {
        "policy": policy,
        "outcome": "started" if margin.holds else "margin-broken",
        "startup_s": round(seconds, 1),
        "kv_pages": scheduler.load().kv_pages_total,
        "buckets": list(graphs.buckets) if graphs else [],
        "graph_reserved_gib": None,
        "graph_measured_gib": None,
        "free_gib": margin.free / GIB,
        "margin_gib": margin.margin / GIB,
    }
    if graphs is not None:
        row["graph_measured_gib"] = graphs.captured_bytes / GIB
        if graphs.reserved_bytes is not None:
            row["graph_reserved_gib"] = graphs.reserved_bytes / GIB
    del scheduler, loaded, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--policies", default="tuned,pin,per-token,invariant")
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    cache = WeightCache()
    rows = []
    for policy in args.policies.split(","):
        row = start_once(args.checkpoint, policy, cache)
        print(json.dumps(row))
        rows.append(row)
    if args.save is not None:
        args.save.write_text(json.dumps({"checkpoint": str(args.checkpoint), "runs": rows}, indent=2))
    # Refusing at start-up by name is an accepted answer; an out-of-memory or a broken margin is not.
    return 0 if all(row["outcome"] in ("started", "refused") for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
