"""vLLM's decode step per batch size, from one engine start (run with vLLM on the path, infer off it).

It measures what `shared/device/vllm/bench.sh` measures, the way `vllm bench latency` does it: each
batch of random 512-token prompts generated to 1 and to 129 output tokens (ignore_eos, temperature
1.0, no detokenization), mean over --iters after --warmup, and decode per step = (t129 - t1) / 128.
bench.sh starts a fresh vLLM process for each of those runs (~1.5 min each on a 4B model); this
starts one and reuses it, with bench.sh's engine arguments, so a device session spends its minutes
on the measurement.

    python3 vllm_decode.py MODEL_DIR --batch-sizes 1,8,64 --save OUT.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--save", required=True)
    # A multimodal checkpoint (Qwen3.5's published form): every modality limit 0, so vLLM builds
    # no vision tower and profiles no encoder; the decode measured is the language model's.
    parser.add_argument("--language-model-only", action="store_true")
    # Qwen3.5: vLLM 0.24 takes FlashInfer's GDN prefill on sm_90 unless told otherwise, and the
    # staging carries no FlashInfer for vLLM (it failed there on 2026-12-05); "triton" is its own.
    parser.add_argument("--gdn-prefill-backend", choices=("auto", "triton", "flashinfer"))
    # vLLM 0.24's attention backend for every layer (its AttentionConfig.backend; the names are its
    # sm_90 candidates, vllm/platforms/cuda.py). Unset, vLLM picks per layer, and for Gemma 4 forces
    # FlashAttention 4 (CuTe, needs nvidia-cutlass-dsl) on every layer.
    parser.add_argument(
        "--attention-backend", choices=("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
    )
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    import vllm
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        load_format="safetensors",
        max_model_len=1024,
        gpu_memory_utilization=0.90,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=32768,
        **({"language_model_only": True} if args.language_model_only else {}),
        **(
            {"additional_config": {"gdn_prefill_backend": args.gdn_prefill_backend}}
            if args.gdn_prefill_backend
            else {}
        ),
        **({"attention_config": {"backend": args.attention_backend}} if args.attention_backend else {}),
    )
    start_s = time.perf_counter() - started
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)

    def mean_latency(batch: int, output_len: int) -> float:
        prompts = [
            {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]} for _ in range(batch)
        ]
        params = SamplingParams(
            n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len, detokenize=False
        )
        for _ in range(args.warmup):
            llm.generate(prompts, params, use_tqdm=False)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        return statistics.mean(times)

    rows = []
    for batch in batch_sizes:
        t1, t129 = mean_latency(batch, 1), mean_latency(batch, 129)
        decode_ms = (t129 - t1) / 128 * 1e3
        rows.append(
            {"batch": batch, "decode_ms_per_step": decode_ms, "t1_ms": t1 * 1e3, "t129_ms": t129 * 1e3}
        )
        print(
            f"vllm batch {batch}: decode {decode_ms:.3f} ms/step (t1 {t1 * 1e3:.1f} ms, t129 {t129 * 1e3:.1f} ms)"
        )
    with open(args.save, "w") as f:
        json.dump(
            {
                "vllm": vllm.__version__,
                "model": args.model,
                "input_len": args.input_len,
                "warmup": args.warmup,
                "iters": args.iters,
                "engine_start_s": start_s,
                "language_model_only": args.language_model_only,
                "gdn_prefill_backend": args.gdn_prefill_backend,
                "attention_backend": args.attention_backend,
                "rows": rows,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
