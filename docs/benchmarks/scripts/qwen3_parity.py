"""The one-off run behind docs/benchmarks/qwen3.md's parity table: infer (bf16) and transformers
(bf16) each against transformers in fp32, teacher-forced on random prompts.

    PYTHONPATH=$PWD python docs/benchmarks/scripts/qwen3_parity.py /tmp/q3-4b   # on the GPU machine
"""

import json
import os
import sys
from pathlib import Path

import torch

from gates.harness.compare import logprob_delta
from gates.harness.hf_reference import hf_logprobs, hf_model
from gates.harness.serving import load_for_gate, random_prompt, score


def main(checkpoint: Path) -> None:
    out = {}
    served = load_for_gate(checkpoint)
    cuda = torch.device("cuda")
    for length in (256, 1024):
        tokens = random_prompt(length, seed=length, vocab_size=151936)
        reference_model = hf_model(checkpoint, cuda, torch.float32)
        reference = hf_logprobs(reference_model, tokens)
        del reference_model
        torch.cuda.empty_cache()
        baseline_model = hf_model(checkpoint, cuda, torch.bfloat16)
        baseline = logprob_delta(hf_logprobs(baseline_model, tokens), reference, tokens)
        del baseline_model
        torch.cuda.empty_cache()
        candidate = logprob_delta(score(served, tokens), reference, tokens)
        out[f"len{length}_vs_hf_float32"] = {k: getattr(candidate, k) for k in candidate.__slots__}
        out[f"len{length}_hf_bf16_vs_hf_fp32"] = {k: getattr(baseline, k) for k in baseline.__slots__}
    print(json.dumps(out, indent=1))
    Path(os.environ.get("OUT", "/tmp"), "qwen3-parity.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
