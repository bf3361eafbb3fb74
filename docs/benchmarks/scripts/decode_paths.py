"""Where does a served decode part from a teacher-forced prefill of the same tokens? One request
per prompt length is served through each attention path (FlashInfer with CUDA graphs, FlashInfer
eager, the torch reference backend), and every decoded token's log-prob is compared with one
prefill of prompt + output on the torch backend. A path whose gap is far above the others' is
the one to read.

    python docs/benchmarks/scripts/decode_paths.py CHECKPOINT [--new-tokens 16] [--save FILE]

Written for the Gemma 4 12B gates that failed on the H200 on 2026-12-02 (serve_matches_full_forward,
greedy_matches_hf_generate) while the prefill-only layer probes passed; it runs on any paged line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.contract import Request
from gates.harness.serving import drive, greedy, random_prompt, score
from models.checkpoint import WeightCache, reusing_weights
from models.registry import LoadedModel, ModelOptions, load_model

PATHS = (
    ("flashinfer + graphs", "flashinfer", False),
    ("flashinfer eager", "flashinfer", True),
    ("torch eager", "torch", True),
)


def _load(checkpoint: Path, backend: str, eager: bool, cache: WeightCache) -> LoadedModel:
    engine = EngineConfig(num_kv_pages=2048, max_num_seqs=16, enforce_eager=eager)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with reusing_weights(cache):
        return load_model(
            str(checkpoint), ModelOptions(engine=engine, device=device, attention_backend=backend)
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    config = json.loads((args.checkpoint / "config.json").read_text())
    text = config.get("text_config", config)
    window = int(text.get("sliding_window") or 1024)
    vocab = int(text["vocab_size"])
    lengths = (max(1, window - 3), window + 5, 3 * window + 7)
    cache = WeightCache()
    paths = [p for p in PATHS if torch.cuda.is_available() or p[1] == "torch"]
    rows = []
    for label, backend, eager in paths:
        for length in lengths:
            prompt = random_prompt(length, seed=11 + length, vocab_size=vocab)
            served = drive(
                _load(args.checkpoint, backend, eager, cache), [Request("r", prompt, greedy(args.new_tokens))]
            )
            got = served["r"]
            reference = score(_load(args.checkpoint, "torch", True, cache), list(prompt) + got.tokens)
            gaps = [
                abs(lp.logprob - float(reference[length + i - 1, token]))
                for i, (token, lp) in enumerate(zip(got.tokens, got.logprobs, strict=True))
            ]
            regrets = [
                float(reference[length + i - 1].max() - reference[length + i - 1, token])
                for i, token in enumerate(got.tokens)
            ]
            row = {
                "path": label,
                "prompt": length,
                "max_gap": max(gaps),
                "mean_gap": sum(gaps) / len(gaps),
                "first_token_gap": gaps[0],
                "max_regret": max(regrets),
            }
            rows.append(row)
            print(
                f"{label:20s} prompt {length:6d}: |Δ log-prob| first {gaps[0]:.4f} mean {row['mean_gap']:.4f} "
                f"max {row['max_gap']:.4f}; max regret {row['max_regret']:.4f}",
                flush=True,
            )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.save is not None:
        args.save.write_text(
            json.dumps({"checkpoint": str(args.checkpoint), "window": window, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
