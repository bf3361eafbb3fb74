"""What a bf16-rounded RoPE inv_freq does to transformers' bf16 model, on the CPU: Qwen3-4B's
dimensions (8 of its 36 layers, random init), one 700-token random prompt, log-probs against the
same model in fp32. Casting a loaded model with `.to(torch.bfloat16)` rounds the buffer;
`from_pretrained(dtype=torch.bfloat16)` keeps it in fp32 (gates/harness/hf_reference.py).

    python docs/benchmarks/scripts/rope_buffer_rounding.py      (~3 min on 2 cores, ~10 GB RAM)
"""

from __future__ import annotations

import copy

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def logprobs(model: Qwen3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(ids).logits[0].float(), dim=-1)


def main() -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    )
    fp32 = Qwen3ForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 700))
    reference = logprobs(fp32, ids)
    kept = copy.deepcopy(fp32)
    for p in kept.parameters():  # parameters only: inv_freq stays fp32, as from_pretrained leaves it
        p.data = p.data.bfloat16()
    rounded = copy.deepcopy(fp32).to(torch.bfloat16)  # buffers too
    for name, model in (("bf16, inv_freq fp32", kept), ("bf16, inv_freq bf16", rounded)):
        got = logprobs(model, ids)
        for lo, hi in ((0, 100), (100, 300), (300, 700)):
            delta = (got[lo:hi] - reference[lo:hi]).abs()
            top = got[lo:hi].argmax(-1)
            best = reference[lo:hi].max(-1).values
            regret = best - reference[lo:hi].gather(1, top[:, None])[:, 0]
            agree = (top == reference[lo:hi].argmax(-1)).float().mean()
            p99 = delta.flatten().kthvalue(int(0.99 * delta.numel())).values
            print(
                f"{name}: positions {lo}-{hi}: mean |Δ| {delta.mean():.4f}, p99 {p99:.4f}, "
                f"argmax {agree:.3f}, max regret {regret.max():.3f}"
            )


if __name__ == "__main__":
    main()
