#!/usr/bin/env bash
# One warm stretch on the lent H200, as the device README recommends: everything the open GPU
# acceptance points need, in the order that shares FlashInfer's JIT cache. Run from the project root
# on the device after the two wheel installs (shared/device/README.md), e.g.
#   STAGE=qwen3 bash docs/benchmarks/scripts/h200_session.sh      (one stage per 10-minute call)
# Results go to $OUT; copy them into docs/benchmarks/ with the date, commit, device and command.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1
infer() { python3 -m infer_cli.main "$@"; }
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/ckpt
case "${STAGE:-qwen3}" in
  qwen3)  # issue 5 re-run at HEAD, then the latency table
    [ -d /tmp/ckpt/q3-4b ] || infer synth qwen3 --preset 4b --out /tmp/ckpt/q3-4b --dtype bfloat16 --tokenizer trained --device cuda
    infer gates --manifest qwen3 --checkpoint /tmp/ckpt/q3-4b --json "$out/qwen3-gates.json" --junit "$out/qwen3-gates.xml"
    infer bench latency --model /tmp/ckpt/q3-4b --save-result "$out/qwen3-4b-latency.json" ;;
  gemma4)  # issue 6: every gate on the 12b preset, then latency (batch 1..128)
    [ -d /tmp/ckpt/g4-12b ] || infer synth gemma4 --preset 12b --out /tmp/ckpt/g4-12b --dtype bfloat16 --device cuda
    infer gates --manifest gemma4 --checkpoint /tmp/ckpt/g4-12b --json "$out/gemma4-gates.json" --junit "$out/gemma4-gates.xml"
    infer bench latency --model /tmp/ckpt/g4-12b --batch-sizes 1,8,32,64,128 --save-result "$out/gemma4-12b-latency.json" ;;
  buckets)  # issue 7: graph memory per bucket and policy, then the GPU-only numerics tests
    [ -d /tmp/ckpt/q3-4b ] || infer synth qwen3 --preset 4b --out /tmp/ckpt/q3-4b --dtype bfloat16 --tokenizer trained --device cuda
    python3 -m pytest -q tests/kernels/test_invariant_gemm.py tests/kernels/test_norm_dispatch.py tests/sampling
    infer bench --buckets all --model /tmp/ckpt/q3-4b --numeric-policy tuned,pin,per-token,invariant \
      --save-result "$out/buckets-qwen3-4b.json" --plot ;;
  kernels)  # issue 4 re-run
    infer gates --manifest kernels --tier gpu --json "$out/kernels-gates.json"
    infer bench kernels --save-result "$out/bench-kernels.json" ;;
  *) echo "unknown STAGE=${STAGE}" >&2; exit 2 ;;
esac
