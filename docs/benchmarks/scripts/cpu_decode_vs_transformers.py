"""CPU decode of one checkpoint: infer's scheduler against transformers' `generate`, interleaved.

    python docs/benchmarks/scripts/cpu_decode_vs_transformers.py CHECKPOINT_DIR [ROUNDS]

Both run fp32 on the CPU, greedy, 64 new tokens after the same short prompt; the figure is new
tokens over wall time, the prefill included. Rounds alternate the two, so load from other jobs
falls on both; the medians and their ratio are printed.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.contract import Request, SamplingParams
from models.registry import ModelOptions, load_model

NEW_TOKENS = 64
PROMPT = "The capital of France is"


def main(checkpoint: str, rounds: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    scheduler = load_model(checkpoint, ModelOptions(device="cpu")).scheduler
    ids = tokenizer(PROMPT)["input_ids"]

    def infer_rate(name: str) -> float:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        scheduler.submit(Request(name, tuple(ids), params))
        while scheduler.has_work():
            scheduler.step()
        return NEW_TOKENS / (time.perf_counter() - start)

    def transformers_rate() -> float:
        x = torch.tensor([ids])
        with torch.no_grad():
            start = time.perf_counter()
            reference.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        return NEW_TOKENS / (time.perf_counter() - start)

    infer_rate("warm-up")
    transformers_rate()
    ours, theirs = [], []
    for i in range(rounds):
        ours.append(infer_rate(f"round-{i}"))
        theirs.append(transformers_rate())
        print(f"round {i}: infer {ours[-1]:.2f} tok/s, transformers {theirs[-1]:.2f} tok/s", flush=True)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(
        f"median: infer {a:.2f}, transformers {b:.2f} tok/s, ratio {a / b:.2f} (torch threads {torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
