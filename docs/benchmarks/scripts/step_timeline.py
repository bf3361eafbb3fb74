"""Where a profiled step's time went, kernel by kernel, from `infer bench latency --breakdown
--save-result` (the breakdown's timeline of the last profiled step):

    python3 docs/benchmarks/scripts/step_timeline.py RESULT.json [--top 12]

Per decode batch and prefill length: each kernel name's count, summed duration, advance (how far it
moved the step's last completion on: the advances sum to the busy time, PDL's overlap counted once)
and the device's idle time just before it (`infer_cli.bench.step_profile.timeline_shares`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infer_cli.bench.step_profile import timeline_shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--top", type=int, default=12, help="kernel names per step")
    args = parser.parse_args()
    saved = json.loads(args.result.read_text())
    for phase, size in (("decode", "batch"), ("prefill", "tokens")):
        for row in saved.get(phase, []):
            timeline = (row.get("breakdown") or {}).get("timeline")
            if not timeline:
                continue
            shares = timeline_shares(timeline)
            busy = sum(s.advance_us for s in shares)
            idle = sum(s.idle_before_us for s in shares)
            head = f"{phase} {size}={row.get(size)} {row.get('policy', '')}: {len(timeline)} kernels,"
            print(f"{head} busy {busy:.1f} us, idle between kernels {idle:.1f} us")
            print(f"  {'kernel':56} {'n':>4} {'duration':>9} {'advance':>9} {'idle before':>11}")
            for s in shares[: args.top]:
                print(
                    f"  {s.name[:56]:56} {s.count:4} {s.duration_us:9.1f} {s.advance_us:9.1f} {s.idle_before_us:11.1f}"
                )


if __name__ == "__main__":
    main()
