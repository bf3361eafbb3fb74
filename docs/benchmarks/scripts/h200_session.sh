#!/usr/bin/env bash
# One warm stretch on the lent H200, as the device README recommends: everything the open GPU
# acceptance points need, in the order that shares FlashInfer's JIT cache. Run from the project root
# on the device after the two wheel installs (shared/device/README.md), e.g.
#   STAGE=qwen3 bash docs/benchmarks/scripts/h200_session.sh      (one stage per 10-minute call)
# Results go to $OUT; copy them into docs/benchmarks/ with the date, commit, device and command.
#
# A run longer than one call (the whole gemma4 manifest on the 12b preset) starts in the background
# in its own session, which outlives the call while the machine stays warm; `STAGE=wait` in the
# next call (sent within 30 s, or the machine is given back) follows it and copies its reports.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1
infer() { python3 -m infer_cli.main "$@"; }
out=${OUT:-/tmp/out}
work=/tmp/runs  # survives between calls, unlike $OUT
mkdir -p "$out" /tmp/ckpt "$work"
q3=/tmp/ckpt/q3-4b
g4=/tmp/ckpt/g4-12b
synth_q3() { [ -d $q3 ] || infer synth qwen3 --preset 4b --out $q3 --dtype bfloat16 --tokenizer trained --device cuda; }
synth_g4() { [ -d $g4 ] || infer synth gemma4 --preset 12b --out $g4 --dtype bfloat16 --device cuda; }

# Follow background runs until they finish or this call's time is nearly spent (WAIT_S), then
# copy every report and log so far into $OUT.
follow() {
  local deadline=$((SECONDS + ${WAIT_S:-540}))
  while ls "$work"/*.running >/dev/null 2>&1 && [ $SECONDS -lt $deadline ]; do sleep 5; done
  for log in "$work"/*.log; do [ -f "$log" ] && { echo "== $log"; grep -E "^ *(passed|failed|timeout|error|skipped) |^        " "$log" | tail -60; }; done
  ls "$work"/*.running 2>/dev/null && echo "still running: $(ls "$work"/*.running)"
  cp "$work"/*.json "$work"/*.log "$out"/ 2>/dev/null
  true
}

# background NAME COMMAND...: run in a new session, marking $work/NAME.running while it lives.
background() {
  local name=$1; shift
  touch "$work/$name.running"
  setsid bash -c "export PYTHONPATH=$PYTHONPATH HF_HUB_OFFLINE=1; $*; rm -f $work/$name.running" \
    >"$work/$name.log" 2>&1 </dev/null &
}

case "${STAGE:-qwen3}" in
  qwen3)  # issue 5: the manifest, then the latency table
    synth_q3
    infer gates --manifest qwen3 --shared-process --checkpoint $q3 --json "$out/qwen3-gates.json" --junit "$out/qwen3-gates.xml"
    infer bench latency --model $q3 --save-result "$out/qwen3-4b-latency.json" ;;
  gemma4)  # issue 6: every gate on the 12b preset, in the background; follow with STAGE=wait
    synth_g4
    background gemma4-gates "python3 -m infer_cli.main gates --manifest gemma4 --shared-process --checkpoint $g4 --json $work/gemma4-gates.json --junit $work/gemma4-gates.xml"
    follow ;;
  gemma4-latency)  # issue 6: decode at batch 1..128 and prefill 1k/8k against their floors
    synth_g4
    infer bench latency --model $g4 --batch-sizes 1,8,32,64,128 --save-result "$out/gemma4-12b-latency.json" ;;
  decode-paths)  # where a served decode parts from a teacher-forced prefill, per attention path
    synth_g4
    python3 docs/benchmarks/scripts/decode_paths.py $g4 --save "$out/gemma4-decode-paths.json" ;;
  wait) follow ;;
  buckets)  # issue 7: graph memory per bucket and policy, then the GPU-only numerics tests
    synth_q3
    python3 -m pytest -q tests/kernels/test_invariant_gemm.py tests/kernels/test_norm_dispatch.py tests/sampling
    infer bench --buckets all --model $q3 --numeric-policy tuned,pin,per-token,invariant \
      --save-result "$out/buckets-qwen3-4b.json" --plot ;;
  numerics)  # issue 7: the two GPU gates of each line, then invariant against tuned
    synth_q3
    infer gates --manifest qwen3 --checkpoint $q3 --gate qwen3.batch_invariance_is_bitwise \
      --gate qwen3.graph_memory_is_reserved --json "$out/qwen3-numerics-gates.json"
    infer bench latency --model $q3 --numeric-policy tuned,invariant --batch-sizes 1,8,64 \
      --prefill-lens 8192 --save-result "$out/invariance-qwen3-4b.json" ;;
  kernels)  # issues 4 and 6: prep and FlashInfer attention gates (JIT-builds every geometry once)
    infer gates --manifest kernels --tier gpu --json "$out/kernels-gates.json"
    infer bench kernels --save-result "$out/bench-kernels.json" ;;
  *) echo "unknown STAGE=${STAGE}" >&2; exit 2 ;;
esac
