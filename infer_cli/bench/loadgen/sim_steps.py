"""The sim's own step time, measured in a direct loop with no HTTP and no event loop.

`infer bench serve` over HTTP measures TPOT; subtracting the time the engine itself spends per
step at the same batch size leaves the frontend's cost. This runs the same scheduler and sim the
server runs: `batch` requests of `input_len` prompt tokens, each generating `output_len` tokens
(ignore_eos), all admitted together, and times every step once all of them are decoding.

    python -m infer_cli.bench.loadgen.sim_steps --batch 64 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from models.sim import SimOptions, build_sim


@dataclass(frozen=True, slots=True)
class StepTiming:
    batch: int
    decode_steps: int
    mean_s: float
    median_s: float

    @property
    def per_token_s(self) -> float:
        return self.mean_s / self.batch


def measure_decode_steps(
    batch: int, input_len: int, output_len: int, step_delay_s: float = 0.0, seed: int = 0
) -> StepTiming:
    # Synchronous steps: each step's time is then its own forward (under async scheduling a step
    # launches the next forward and returns the previous one's tokens).
    engine = EngineConfig(max_num_seqs=max(batch, 1), async_scheduling=False)
    model = build_sim(SimOptions(engine=engine, step_delay_s=step_delay_s))
    scheduler = model.scheduler
    rng = random.Random(seed)
    for i in range(batch):
        prompt = tuple(rng.randrange(32, 127) for _ in range(input_len))
        scheduler.submit(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=output_len, seed=i, ignore_eos=True))
        )
    decode_times: list[float] = []
    while scheduler.has_work():
        start = time.perf_counter()
        outputs = scheduler.step()
        elapsed = time.perf_counter() - start
        # Decode steps only: every request gets exactly one token, none is admitted or prefilling.
        if len(outputs.updates) == batch and all(
            len(u.new_token_ids) == 1 and u.admission is None for u in outputs.updates
        ):
            decode_times.append(elapsed)
    if not decode_times:
        raise RuntimeError("no pure decode step happened; raise --output-len")
    return StepTiming(
        batch, len(decode_times), statistics.fmean(decode_times), statistics.median(decode_times)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sim-step-delay", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=3, help="Runs per batch size; the best is kept.")
    args = parser.parse_args()
    for batch in args.batch:
        runs = [
            measure_decode_steps(batch, args.input_len, args.output_len, args.sim_step_delay, seed)
            for seed in range(args.repeat)
        ]
        best = min(runs, key=lambda t: t.mean_s)
        print(
            f"batch {batch}: {best.decode_steps} decode steps, mean {best.mean_s * 1e3:.3f} ms, "
            f"median {best.median_s * 1e3:.3f} ms, {best.per_token_s * 1e6:.2f} us per token"
        )


if __name__ == "__main__":
    main()
