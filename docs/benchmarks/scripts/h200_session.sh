#!/usr/bin/env bash
# One warm stretch on the lent H200: everything the open GPU acceptance points need, as one
# pipeline that runs in the background and outlives each 10-minute call. Run from the project root
# on the device after the two wheel installs (shared/device/README.md):
#   STAGE=all bash docs/benchmarks/scripts/h200_session.sh     (starts the pipeline, follows it)
#   STAGE=wait bash docs/benchmarks/scripts/h200_session.sh    (each next call, sent at once: a
#                                                              machine idle for 30 s is given back)
# Every call leaves $OUT/runs.tgz (every report, log and plot so far) and prints each step's end.
# Copy what matters into docs/benchmarks/ with the date, commit, device and command.
#
# Order is priority. The default PIPELINE: Qwen3-4B latency, its manifest, Gemma 4 12B latency, its
# manifest (latency first: it builds FlashInfer's kernels once for the gates after it). The gemma4
# manifest takes ~12 min on a fresh machine (synth ~45 s, FlashInfer JIT ~3 min): send each
# STAGE=wait call at once, with WAIT_S near the 600 s limit, so the machine never idles 30 s. Gate
# reports are rewritten after every gate, so each call's runs.tgz carries what has passed so far.
# `git rev-parse` on the device can name an older commit than the tree it runs (2026-12-03);
# record the commit you sent.
# Other steps run only by name: the bucket sweep (STAGE=buckets), per-policy start-up
# (STAGE=startup, STAGE=gemma4-startup), the invariance run, the GEMM bench (gemm), the host
# profile (host-profile), norms-check, the Triton decode attention (attn-triton), and Qwen3.5
# (issue 19): STAGE=qwen35 runs its steps in the foreground; for the background pipeline name
# them, e.g.
#   PIPELINE="qwen35-gpu-tests qwen35-bench-gdn qwen35-gates qwen35-latency qwen35-9b-parity" STAGE=all ...
# A PIPELINE word may join lanes that run at the same time with "+", each lane a ","-list of steps
# run in order; the next word starts when every lane has ended. Only correctness steps share the
# GPU this way (gates hold a fixed KV pool); timed steps stand alone. E.g. Qwen3.5's acceptance run:
#   PIPELINE="cutlass_dsl,qwen35-gates+qwen35-fla-tests,attn-triton-tests,qwen35-9b-parity
#             qwen35-bench-gdn qwen35-latency qwen3-latency attn-triton-latency" STAGE=all ...
# Lanes share the GPU's memory: a gate that sizes its KV pool from free memory
# (graph_memory_is_reserved) takes ~92 GiB and starves a lane beside it (2026-12-05: the 9B parity
# gate's reference ran out of memory), so give such manifests a word of their own.
# Issue 18's decode run (each timed step alone on the GPU; vLLM last, after its six staging calls):
#   PIPELINE="decode-tests sampler-timing gemm-qwen3 qwen3-decode-variants host-profile-async gemma4-decode-variants
#             qwen3-gates vllm-qwen3" STAGE=all ...
# then the qwen3 and gemma4 manifests with the flags the variants showed best, before flipping a default.
# The next stretch (prepared 2026-12-06 after the fourth session's H100s at 66bda9c and 9a5d010:
# the Triton decode attention on tensor cores passes its GPU tests and two gates but stays behind
# FlashInfer; invariant's batch-1 cost is its GEMM path, not attention; the O weight's L2 prefetch
# and the invariant GEMM's weights before the wait were measured and dropped; before building a
# lever, search docs/benchmarks/ for it: the L2 prefetch had been measured once already).
# Carrying: the tree and the 62 MB flashinfer wheel pass 64 MiB together, so the wheel travels split
# (scripts/split_flashinfer_wheel.sh after stage-wheels.sh): chunk aa in .whl-fi, chunk ab and the
# wheel's sha256 in .whl-deps/fi-tail. FlashInfer's attention modules, built on the CPU machine
# (scripts/flashinfer_aot.py build .fi-aot, ~14 MB, ~20 min on 2 cores), travel in .fi-aot and
# spare the first FlashInfer step its JIT. `infer` itself imports fastapi: no step runs before the
# second call's install. Calls:
#  1. carrying .whl-fi: `mkdir -p /tmp/fi && cp .whl-fi/fi.chunk-aa /tmp/fi/`;
#     (chunk aa is 48.2 MB since 2026-12-07, split at 46 MiB: the tracked tree, 12.0 MB then, may
#     grow to ~17.5 MB beside it and beside call 2's 49.4 MB of wheels and .fi-aot; data files still
#     keep a latency run's per-kernel timeline only where a page links it);
#  2. carrying .whl-deps and .fi-aot: `cp .whl-deps/fi-tail/* /tmp/fi/ && (cd /tmp/fi && cat
#     fi.chunk-aa fi.chunk-ab > flashinfer_python-0.7.2.post1-py3-none-any.whl && sha256sum -c
#     fi.sha) && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site
#     /tmp/fi/*.whl .whl-deps/*.whl && python3 docs/benchmarks/scripts/flashinfer_aot.py install
#     /tmp/site; PIPELINE="..." SYNTH_AHEAD=0 WAIT_S=5 STAGE=all bash docs/benchmarks/scripts/h200_session.sh
#     > /tmp/start.log 2>&1; tail -3 /tmp/start.log` (into a file: piped to `tail` straight away, the
#     call waits for the background pipeline's output and runs to its timeout, 200 s on 2026-12-06);
#  3. vLLM (for a same-session figure): six calls carrying .vllm/part1..6 (48 MiB chunks since
#     2026-12-06: with 58 MiB ones a part and the 6 MB tree passed the 64 MiB carry),
#     `bash .vllm/partN/stage.sh N`, the sixth `... 6 last` after the timed
#     steps before vllm-qwen3 (its install and smoke test would share the host with them);
#  4. STAGE=wait calls back to back (WAIT_S=540, timeout 580); give the machine back at the end.
#     Nothing runs here between two calls: a machine idle 30 s is given back with its pipeline
#     (2026-12-06: ~35 s of local tests between two calls cost a warm H100 and its running step).
# STAGE=NAME copies every JSON of /tmp/runs into $OUT: past 8 files the rest (runs.tgz too) do not
# come back, so fetch through a wait call's runs.tgz instead.
# The next stretch's call 2 picks its pipeline by the card that came (a plain call may get either):
#   if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
#     P="qwen3-table qwen35-9b-forward+qwen35-gates vllm-qwen3 lines-attn-ab attn-rows64-split-ab"; else
#     P="lines-attn-ab attn-rows64-split-ab default-attn-gates vllm-qwen3 pdl-preload-probe"; fi;
#   PIPELINE="$P" QWEN35_SELECT=all SYNTH_AHEAD=0 WAIT_S=5 STAGE=all bash docs/benchmarks/scripts/h200_session.sh ...
# On an H200 (~3 + 15 + 4 + 6 + 6 min): qwen3-table (the H200's dispatch table has no GEMV rows: copy
# skinny_dispatch_h200.json back from runs.tgz) and the H200's first decode step since f348b1c;
# the 9b's full_forward_matches_hf (never run alone on an H200) beside the whole qwen35 manifest at
# HEAD (neither sizes a KV pool from free memory; issue 19's last two GPU points); vllm-qwen3 for the
# same-session ratio (its six staging calls while the lanes run, `last` before vllm-qwen3 starts).
# Later H200 steps: invariance, numerics, gemma4-gates (its five gates that need the H200's memory),
# prefill-graphs-gates-gemma4 (what stands between --prefill-graphs and the default).
# On an H100 (~6 + 6 + 12 + 4 + 2 min): bea95fc's Triton attention (P·V in bf16, up to 16 rows), timed
# on Qwen3-4B only (38b9790), against the attention before it on Gemma 4 12B and Qwen3.5-4B; the
# kernel at 32-64 rows with longer splits against FlashInfer (batch 64's 70 % needs ~2.7 µs a layer); the
# qwen35 manifest and the gemma4 gates that fit, as shipped; vLLM beside the shipped Qwen3-4B step
# (its six staging calls during default-attn-gates); what each projection's GEMV adds past a PDL
# predecessor.
# The rest needs the H200
# (its figures, gemma4's five gates, the 9b's parity: qwen35-9b-forward). The staging
# folders are ignored, so a new checkout lacks them: scripts/stage_device.sh stages them all (~1 min)
# and starts the .fi-aot build (head dim 128: fa2 100 s alone, fa3 21 min beside a `make test`).
# - attn-split-ab (~2 min): the async step with FlashInfer's KV split as shipped and switched off.
# - gemv-sweep and gemv-layout-ab, as at 1c7ef32, where a card's GEMV rule is in question.
# Later stretches: vLLM's
# Gemma 4 figure beside gemma4-decode-variants (staged as in the 15a67ed stretch: six calls
# carrying .vllm/partN, the .whl-deps call adding `mkdir -p /tmp/parts && cp
# .whl-deps/vllm-gemma4/*.whl /tmp/parts/`); Qwen3.5's 1k prefill on FlashInfer's GDN prefill
# (host-bound on fla's ~10 launches a layer at 15a67ed: 62.6 ms for 17.7 of kernels), i.e. the
# CUTLASS DSL staged (scripts/stage_cutlass_dsl.sh, two calls carrying .cdsl/part1..2) and
# PIPELINE="cutlass_dsl qwen35-published-latency vllm-qwen35" (auto then picks FlashInfer where it
# measures faster).
# Back here, the runs.tgz reports make the pages' target tables, e.g. (from the unpacked folder)
#   infer bench table default=qwen3-4b-latency-default.json sync=qwen3-4b-latency-sync.json \
#     --vllm vllm-qwen3-4b.json --markdown
# A step that fails does not stop the ones after it. Single steps can still be run by name
# (STAGE=gemma4-gates, STAGE=buckets, ...), in the foreground.
set -uo pipefail
# The CUTLASS DSL's wheel puts its packages on the path through a .pth file, which a --target
# install never runs: its folder is named here instead.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD HF_HUB_OFFLINE=1
infer() { python3 -m infer_cli.main "$@"; }
out=${OUT:-/tmp/out}
work=/tmp/runs  # survives between calls, unlike $OUT
mkdir -p "$out" /tmp/ckpt "$work"
q3=/tmp/ckpt/q3-4b
g4=/tmp/ckpt/g4-12b
q35=/tmp/ckpt/q35-4b
q35_9b=/tmp/ckpt/q35-9b

synth_q3() { synth_wait q3-4b; [ -d $q3 ] || infer synth qwen3 --preset 4b --out $q3 --dtype bfloat16 --tokenizer trained --device cuda; }
synth_g4() { [ -d $g4 ] || infer synth gemma4 --preset 12b --out $g4 --dtype bfloat16 --device cuda; }
# The Qwen3.5 checkpoints may be written in the background at pipeline start (qwen35_synth_bg):
# a step that needs one waits for its writer (the marker $work/NAME.running) before it looks.
synth_wait() { while [ -f $work/$1.running ]; do sleep 5; done; }
synth_q35() { synth_wait q35-4b; [ -d $q35 ] || infer synth qwen35 --preset 4b --out $q35 --dtype bfloat16 --tokenizer trained --device cuda; }
synth_q35_9b() { synth_wait q35-9b; [ -d $q35_9b ] || infer synth qwen35 --preset 9b --out $q35_9b --dtype bfloat16 --tokenizer trained --device cuda; }
qwen35_synth_bg() {  # both checkpoints, one after the other, beside the first steps
  local with_q3=0
  [[ "$PIPELINE" == *qwen3-latency* || "$PIPELINE" == *attn-triton-latency* ]] && with_q3=1
  touch $work/q35-4b.running $work/q35-9b.running
  [ $with_q3 == 1 ] && touch $work/q3-4b.running
  ( { [ -d $q35 ] || infer synth qwen35 --preset 4b --out $q35 --dtype bfloat16 --tokenizer trained --device cuda; }
    rm -f $work/q35-4b.running
    { [ -d $q35_9b ] || infer synth qwen35 --preset 9b --out $q35_9b --dtype bfloat16 --tokenizer trained --device cuda; }
    rm -f $work/q35-9b.running
    if [ $with_q3 == 1 ]; then
      { [ -d $q3 ] || infer synth qwen3 --preset 4b --out $q3 --dtype bfloat16 --tokenizer trained --device cuda; }
      rm -f $work/q3-4b.running
    fi ) >$work/q35-synth.log 2>&1 &
}

# A whole manifest on this machine: every gate, less the multi-rank ones (need gpus:N) when fewer
# than N GPUs are visible, which preflight would otherwise refuse (failing closed, running nothing).
# With a subset the report says so: such a run does not stand for the whole manifest.
gate_args() {  # MANIFEST -> nothing, or a --gate for every gate this machine can run
  python3 - "$1" <<'PY'
import sys, tomllib, torch
gates = tomllib.load(open(f"manifests/{sys.argv[1]}.toml", "rb"))["gate"]
visible = torch.cuda.device_count()
ranks = lambda g: max([int(n[5:]) for n in g["needs"] if n.startswith("gpus:")] or [1])
if visible and any(ranks(g) > visible for g in gates):
    print(" ".join(f"--gate {g['id']}" for g in gates if ranks(g) <= visible))
PY
}

# One step per function; each writes its reports into $work.
gemma4-gates() {
  synth_g4
  infer gates --manifest gemma4 --shared-process --checkpoint $g4 $(gate_args gemma4) \
    --json $work/gemma4-gates.json --junit $work/gemma4-gates.xml
}
qwen3-greedy() {  # the Qwen3 gate that failed on the rounded reference at 3a1aa3d
  synth_q3
  infer gates --manifest qwen3 --checkpoint $q3 --gate qwen3.greedy_matches_hf_generate \
    --gate qwen3.full_forward_matches_hf --json $work/qwen3-parity-gates.json
}
gemma4-latency() {
  synth_g4
  infer bench latency --model $g4 --batch-sizes 1,8,64 --prefill-lens 1024,8192 --breakdown \
    --save-result $work/gemma4-12b-latency.json
}
norms-check() {  # after a change to the norms: the GPU norm tests, transformers parity, then latency
  synth_g4
  python3 -m pytest -q --tb=short tests/kernels/test_layer_ops.py tests/kernels/test_gated_act.py
  infer gates --manifest gemma4 --shared-process --checkpoint $g4 --gate gemma4.layers_match_hf_probes \
    --gate gemma4.full_forward_matches_hf --gate gemma4.greedy_matches_hf_generate \
    --gate gemma4.context_waypoints_match_hf --json $work/gemma4-parity-gates.json
  infer bench latency --model $g4 --batch-sizes 1,64 --prefill-lens 1024 --breakdown \
    --save-result $work/gemma4-12b-latency-norms.json
}
invariant-gpu-tests() {  # the invariant GEMM's GPU tests: rows across the split-K's two summing modes
  python3 -m pytest -q --tb=short tests/kernels/test_invariant_gemm.py
}
invariant-tiles-probe() {  # whether other output tiles keep the invariant GEMM's bits: larger ones
  # (prefill; 128 x 256 shipped since e29b2e4) and 16 / 32 rows (mma.sync: decode rows could take them)
  python3 docs/benchmarks/scripts/invariant_tiles_probe.py --save $work/invariant-tiles-probe.json
}
numerics() {  # issue 7's two gates on Qwen3 (Gemma 4's are in its manifest)
  synth_q3
  infer gates --manifest qwen3 --checkpoint $q3 --gate qwen3.batch_invariance_is_bitwise \
    --gate qwen3.graph_memory_is_reserved --json $work/qwen3-numerics-gates.json
}
invariant-triton-attn() {  # invariant with the Triton decode attention (a split at absolute positions,
  # batch-invariant by construction; tensor-core dots) beside `invariance`'s FlashInfer, unsplit under
  # invariant; then the invariance and graph gates with it
  synth_q3
  infer bench latency --model $q3 --numeric-policy invariant --attention-backend triton --batch-sizes 1,8,64 \
    --prefill-lens 8192 --breakdown --save-result $work/invariance-triton-attn-qwen3-4b.json
  attn-triton-gates
}
attn-triton-split-ab() {  # the Triton decode attention with SPLIT_TOKENS_AB tokens a split: at 32 (head
  # dim 128) a split is one tile, so every program's whole KV is requested before its PDL wait
  synth_q3
  local tokens
  for tokens in ${SPLIT_TOKENS_AB:-32}; do
    echo "== Triton decode attention, $tokens tokens a split"
    infer_patched "import kernels.triton.decode_attention as attention
attention.SPLIT_TOKENS = $tokens" bench latency --model $q3 --attention-backend triton --batch-sizes 1,8,64 \
      --prefill-lens 1024 --breakdown --save-result $work/qwen3-4b-latency-attn-triton-split$tokens.json
  done
}
attn-triton-gates() {  # the two qwen3 gates that hold the Triton decode attention's batch invariance
  synth_q3
  infer gates --manifest qwen3 --checkpoint $q3 --attention-backend triton --gate qwen3.batch_invariance_is_bitwise \
    --gate qwen3.graph_replay_matches_eager --json $work/qwen3-gates-triton-attn.json
}
invariance() {  # invariant against tuned (docs/benchmarks/invariance.md)
  synth_q3
  infer bench latency --model $q3 --numeric-policy tuned,invariant --batch-sizes 1,8,64 \
    --prefill-lens 8192 --breakdown --save-result $work/invariance-qwen3-4b.json
}
buckets() {  # graph memory per bucket and policy, then the GPU-only numerics tests
  synth_q3
  infer bench --buckets all --model $q3 --numeric-policy tuned,pin,per-token,invariant \
    --save-result $work/buckets-qwen3-4b.json --plot
  gpu-tests
}
gpu-tests() {  # the kernel and sampling tests that run on the GPU when there is one
  python3 -m pytest -q -s --tb=short tests/kernels/test_layer_ops.py tests/kernels/test_gated_act.py \
    tests/kernels/test_invariant_gemm.py tests/kernels/test_skinny_gemm.py tests/sampling
}
host-profile() {  # where the host time of a decode step (bs 1, 8, 64) and a 1k prefill goes
  synth_q3
  python3 docs/benchmarks/scripts/host_profile.py $q3 --save $work/qwen3-4b-host-profile.json
}
startup() {  # issue 7's start-up point on Qwen3-4B, every policy
  synth_q3
  python3 docs/benchmarks/scripts/startup_per_policy.py $q3 --save $work/startup-per-policy-qwen3-4b.json
}
gemma4-startup() {  # issue 7's start-up point on the 12b, every policy
  synth_g4
  python3 docs/benchmarks/scripts/startup_per_policy.py $g4 --save $work/startup-per-policy-gemma4-12b.json
}
qwen3-gates() {
  synth_q3
  infer gates --manifest qwen3 --shared-process --checkpoint $q3 $(gate_args qwen3) \
    --json $work/qwen3-gates.json --junit $work/qwen3-gates.xml
}
qwen3-latency() {  # decode and prefill at the current commit, beside the 0e80bdd/2c80cbe figures
  synth_q3
  infer bench latency --model $q3 --batch-sizes 1,8,64 --prefill-lens 1024,8192 --breakdown \
    --save-result $work/qwen3-4b-latency.json
}
gemm() {  # the skinny GEMM's and fused decode kernels' GPU tests, then cuBLAS against them per shape and M
  python3 -m pytest -q -s tests/kernels/test_skinny_gemm.py tests/kernels/test_fused_gemv.py tests/kernels/test_fused_mma.py
  for model in qwen3-4b gemma4-12b; do
    COLUMNS=200 infer bench gemm --model $model --rows ${GEMM_ROWS:-1,2,4,8,16,32,64} \
      --save-result $work/gemm-$model.json --save-dispatch $work/skinny-dispatch-$model.json
  done
}
decode-paths() {  # where a served decode parts from a teacher-forced prefill, per attention path
  synth_g4
  python3 docs/benchmarks/scripts/decode_paths.py $g4 --save $work/gemma4-decode-paths.json
}
attn-triton() { attn-triton-tests; attn-triton-latency; }  # the split-KV Triton decode attention
attn-triton-tests() {
  python3 -m pytest -q -s --tb=short tests/kernels/test_decode_attention.py tests/kernels/test_triton_decode_backend.py
}
attn-triton-latency() {  # Qwen3-4B with it, beside qwen3-latency (FlashInfer) at the same commit
  synth_q3
  infer bench latency --model $q3 --attention-backend triton --batch-sizes 1,8,64 --prefill-lens 1024 \
    --breakdown --save-result $work/qwen3-4b-latency-attn-triton.json
}
attn-split-sizes() {  # one layer's decode attention alone: FlashInfer (fa2) beside the Triton kernel
  # at each tokens-per-split size, batches 1-64 (what SPLIT_TOKENS_BY_ROWS may pick), ~2 min
  python3 docs/benchmarks/scripts/decode_attention_backends.py --geometries "qwen3-4b,gemma4-12b sliding" \
    --backends fa2 --batch-sizes 1,2,4,8,16,64 --triton-splits 32,64,128,256,512 --save $work/attn-split-sizes.json
}
attn-split-size-ab() {  # the whole step with the Triton kernel up to SPLIT_ROWS rows at the split sizes
  # SPLIT_TABLE names per batch against the default, twice each; unset, both come from this session's
  # attn-split-sizes (per batch its fastest split; the kernel up to the last batch it beats fa2)
  synth_q3
  local run
  if [ -z "${SPLIT_TABLE:-}" ] && [ -f $work/attn-split-sizes.json ]; then
    read -r SPLIT_ROWS SPLIT_TABLE < <(python3 - $work/attn-split-sizes.json <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["geometry"] == "qwen3-4b" and "ms" in r]
table, kernel_rows, ahead = [], 1, True
for batch in sorted({r["batch"] for r in rows}):
    fa2 = min(r["ms"] for r in rows if r["batch"] == batch and not r["backend"].startswith("triton"))
    best = min((r for r in rows if r["batch"] == batch and r["backend"].startswith("triton")), key=lambda r: r["ms"])
    table.append((batch, int(best["backend"].removeprefix("triton-s"))))
    ahead = ahead and best["ms"] < fa2  # the kernel's batches: those up to its first loss
    kernel_rows = batch if ahead else kernel_rows
print(kernel_rows, repr(tuple(table)).replace(" ", ""))
PY
)
    echo "== from attn-split-sizes: SPLIT_ROWS=$SPLIT_ROWS SPLIT_TABLE=$SPLIT_TABLE"
  fi
  for run in 1 2; do
    infer bench latency --model $q3 --batch-sizes 1,2,4,8,16,64 --prefill-lens 1024 \
      --save-result $work/qwen3-4b-latency-split-default-$run.json
    infer_patched "import kernels.attention.triton_decode_backend as backend
backend.KERNEL_ROWS = ${SPLIT_ROWS:-64}
backend.SPLIT_TOKENS_BY_ROWS = ${SPLIT_TABLE:-((4, 64), (16, 128), (64, 256))}" bench latency --model $q3 \
      --batch-sizes 1,2,4,8,16,64 --prefill-lens 1024 --save-result $work/qwen3-4b-latency-split-table-$run.json
  done
}
# The gate/up GEMV's gated epilogue declined in a process: the linear and the activation kernel
# composed, as before ec7f68b.
GATED_DECLINED="import kernels.gemm.skinny_dispatch as d
d.SkinnyDispatch.linear_gated = lambda self, x, weight, kind: None"
gate-act-head-ab() {  # the decode step as shipped (the gate/up GEMV's SiLU·mul epilogue where the table
  # sends the gate/up to the GEMV, ec7f68b) against it declined, interleaved; run 1 with the kernel
  # timeline; then the qwen3 manifest as shipped, then run 2
  synth_q3
  local run
  for run in 1 2; do
    infer bench latency --model $q3 --batch-sizes 1,2,4,8,16,64 --prefill-lens 1024 \
      $([ $run == 1 ] && echo --breakdown) --save-result $work/qwen3-4b-latency-gated-$run.json
    infer_patched "$GATED_DECLINED" bench latency --model $q3 \
      --batch-sizes 1,2,4,8,16,64 --prefill-lens 1024 $([ $run == 1 ] && echo --breakdown) \
      --save-result $work/qwen3-4b-latency-composed-$run.json
    [ $run == 1 ] && qwen3-gates
  done
  python3 -m pytest -q -s --tb=short tests/kernels/test_skinny_gemm.py -k "gated or gemv_bucket"
}
lines-attn-ab() {  # bea95fc's Triton decode attention (P·V in bf16, up to 16 rows; timed on Qwen3-4B
  # only) against the attention before it (tf32x3 P·V up to 4 rows, FlashInfer above) on Gemma 4
  # 12B's sliding layers and Qwen3.5-4B's attention layers, batches 1 and 8, interleaved, twice
  # each (~6 min)
  synth_g4
  synth_q35
  local run before="import kernels.attention.triton_decode_backend as backend
backend.KERNEL_ROWS = 4
backend.PV_STORAGE = False"
  for run in 1 2; do
    infer bench latency --model $g4 --batch-sizes 1,8 --prefill-lens 1024 \
      --save-result $work/gemma4-12b-latency-attn-shipped-$run.json
    infer_patched "$before" bench latency --model $g4 --batch-sizes 1,8 --prefill-lens 1024 \
      --save-result $work/gemma4-12b-latency-attn-before-$run.json
    infer bench latency --model $q35 --batch-sizes 1,8 --prefill-lens 1024 \
      --save-result $work/qwen35-4b-latency-attn-shipped-$run.json
    infer_patched "$before" bench latency --model $q35 --batch-sizes 1,8 --prefill-lens 1024 \
      --save-result $work/qwen35-4b-latency-attn-before-$run.json
  done
}
attn-rows64-split-ab() {  # the Triton kernel (P·V in bf16) at 17-64 rows with a longer split than
  # 64 tokens (at 64 rows rows × KV heads already fill the SMs, and 16 partials a query head cost
  # the merge 8.2 µs a layer at 38b9790, where the kernel lost to FlashInfer, 6.41 against 6.18 ms)
  # against FlashInfer as shipped, Qwen3-4B at batches 32 and 64, interleaved, twice each, run 1
  # with the kernel timeline (~6 min)
  synth_q3
  local run split
  for run in 1 2; do
    local timeline=$([ $run == 1 ] && echo --breakdown)
    infer bench latency --model $q3 --batch-sizes 32,64 --prefill-lens 1024 $timeline \
      --save-result $work/qwen3-4b-latency-rows64-flashinfer-$run.json
    for split in 128 256 512; do
      infer_patched "import kernels.attention.triton_decode_backend as backend
backend.KERNEL_ROWS = 64
backend.SPLIT_TOKENS_BY_ROWS = ((16, 64), (64, $split))" bench latency --model $q3 --batch-sizes 32,64 \
        --prefill-lens 1024 $timeline --save-result $work/qwen3-4b-latency-rows64-split$split-$run.json
    done
  done
}
gate-act-lines-ab() {  # the same question on the other lines the H100 table sends to the gated GEMV,
  # untimed so far: Gemma 4 12B's gate/up at M = 1-2 (GELU-tanh) and Qwen3.5-4B's at M = 1, as
  # shipped against declined, interleaved, twice each (~5 min)
  synth_g4
  synth_q35
  local run
  for run in 1 2; do
    infer bench latency --model $g4 --batch-sizes 1,2 --prefill-lens 1024 \
      --save-result $work/gemma4-12b-latency-gated-$run.json
    infer_patched "$GATED_DECLINED" bench latency --model $g4 --batch-sizes 1,2 --prefill-lens 1024 \
      --save-result $work/gemma4-12b-latency-composed-$run.json
    infer bench latency --model $q35 --batch-sizes 1 --prefill-lens 1024 \
      --save-result $work/qwen35-4b-latency-gated-$run.json
    infer_patched "$GATED_DECLINED" bench latency --model $q35 --batch-sizes 1 --prefill-lens 1024 \
      --save-result $work/qwen35-4b-latency-composed-$run.json
  done
}
pdl-preload-probe() {  # how much of each Qwen3-4B projection's weight stream a PDL predecessor hides,
  # per GEMV layout (the O projection's question in docs/benchmarks/qwen3.md, 2026-12-07), ~2 min
  PYTHONPATH=. python3 docs/benchmarks/scripts/pdl_preload_probe.py --save $work/pdl-preload-probe.json
}
default-attn-gates() {  # the Triton attention as the CUDA default: the qwen3 manifest, and the gates of
  # qwen35 and gemma4 whose engines decode through it that fit an H100 (gemma4's hf-reference gates
  # run out of its memory beside the others, and its graph gate even alone: da31a49, 112a45b)
  synth_q3
  infer gates --manifest qwen3 --shared-process --checkpoint $q3 $(gate_args qwen3) \
    --json $work/qwen3-gates.json --junit $work/qwen3-gates.xml
  synth_q35
  local q35_gates=${QWEN35_SELECT:-"--gate qwen35.greedy_matches_hf_generate \
    --gate qwen35.mixed_step_matches_serial --gate qwen35.batch_row_order_does_not_matter \
    --gate qwen35.graph_replay_matches_eager --gate qwen35.prefix_restore_matches_cold \
    --gate qwen35.preemption_recompute_matches"}
  [ "$q35_gates" == all ] && q35_gates=$(gate_args qwen35)  # every gate this machine can run
  infer gates --manifest qwen35 --shared-process --checkpoint $q35 $q35_gates \
    --json $work/qwen35-gates.json --junit $work/qwen35-gates.xml
  synth_g4
  infer gates --manifest gemma4 --shared-process --checkpoint $g4 ${GEMMA4_SELECT:---gate gemma4.greedy_matches_hf_generate \
    --gate gemma4.serve_matches_full_forward --gate gemma4.mixed_step_matches_serial \
    --gate gemma4.batch_row_order_does_not_matter --gate gemma4.prefix_restore_matches_cold \
    --gate gemma4.lifecycle_completes} --json $work/gemma4-gates.json --junit $work/gemma4-gates.xml
}
attn-rows-ab() {  # where the Triton decode attention stops beating FlashInfer (KERNEL_ROWS, 1 since
  # a0e5a73: faster at batch 1, slower at 8 and 64): batches 1-8 with FlashInfer, and with the kernel
  # on every decode step (KERNEL_ROWS patched to 8), twice each, interleaved
  synth_q3
  local run
  for run in 1 2; do
    echo "== FlashInfer, run $run"
    infer bench latency --model $q3 --batch-sizes 1,2,4,8 --prefill-lens 1024 \
      --save-result $work/qwen3-4b-latency-rows-flashinfer-$run.json
    echo "== Triton decode attention on every decode step up to 8 rows, run $run"
    infer_patched "import kernels.attention.triton_decode_backend as backend
backend.KERNEL_ROWS = 8" bench latency --model $q3 --attention-backend triton --batch-sizes 1,2,4,8 \
      --prefill-lens 1024 --save-result $work/qwen3-4b-latency-rows-triton-$run.json
  done
}
decode-tests() {  # issue 18: every decode kernel's GPU tests (fused GEMV and MMA, prep, split-KV attention,
  # skinny GEMM) and the fused-path model tests, before any timing
  python3 -m pytest -q -s --tb=short tests/kernels/test_fused_gemv.py tests/kernels/test_decode_attention.py \
    tests/kernels/test_triton_decode_backend.py tests/kernels/test_prep_kernel_small.py \
    tests/kernels/test_skinny_gemm.py tests/models/ -k "fusion or fused or decode or prep or skinny" \
    --ignore=tests/models/test_gguf.py --ignore=tests/models/test_gguf_gemma3_270m.py \
    $(ls tests/kernels/test_fused_mma*.py 2>/dev/null)
}
fused-compose-check() {  # the fused GEMV's and MMA's composition tests alone, with their assertions
  # (docs/kernels.md: every dtype passes since 27dcee1)
  python3 -m pytest -q --tb=long tests/kernels/test_fused_gemv.py tests/kernels/test_fused_mma.py \
    -k composed_bit_for_bit
}
gemm-qwen3() {  # cuBLAS / skinny / fused GEMV / fused MMA per Qwen3-4B projection and M, and the chains
  COLUMNS=200 infer bench gemm --model qwen3-4b --rows ${GEMM_ROWS:-1,2,4,8,16,64} \
    --save-result $work/gemm-qwen3-4b.json --save-dispatch $work/skinny-dispatch-qwen3-4b.json
}
gemm-gemma4() {  # the same for Gemma 4 12B's projections: the H100's shipped table has Qwen3-4B's only
  COLUMNS=200 infer bench gemm --model gemma4-12b --rows ${GEMM_ROWS:-1,2,4,8,16,64} \
    --save-result $work/gemm-gemma4-12b.json --save-dispatch $work/skinny-dispatch-gemma4-12b.json
}
gemm-qwen35() {  # Qwen3.5-4B's projections: neither shipped table has them (only its O projection
  # matches a Qwen3-4B shape), so its decode runs cuBLAS where the other lines take the GEMV
  COLUMNS=200 infer bench gemm --model qwen35-4b --rows ${GEMM_ROWS:-1,2,4,8,16,64} \
    --save-result $work/gemm-qwen35-4b.json --save-dispatch $work/skinny-dispatch-qwen35-4b.json
}
# Qwen3-4B decode per path, one model load each (issue 18). NAME|FLAGS; the first is the default
# (async scheduling since 2026-12-06), the second the synchronous step.
DECODE_VARIANTS=${DECODE_VARIANTS:-"default| sync|--no-async-scheduling
  sampled|--sampling-backend=triton,--temperature=1.0 fused|--decode-fusion
  fused-triton|--decode-fusion,--attention-backend=triton"}
qwen3-decode-variants() {
  synth_q3
  local variant
  for variant in $DECODE_VARIANTS; do
    local name=${variant%%|*} flags=${variant#*|}
    echo "== $name: ${flags//,/ }"
    infer bench latency --model $q3 ${flags//,/ } --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
      --save-result $work/qwen3-4b-latency-$name.json
  done
}
# NAME|FLAGS words, as DECODE_VARIANTS (unquoted where they are used, so the words split).
GEMMA4_VARIANTS=${GEMMA4_VARIANTS:-"default| sync|--no-async-scheduling fused|--decode-fusion"}
gemma4-decode-variants() {  # the same for Gemma 4 12B (fused steps where its line takes the seam)
  synth_g4
  local variant
  for variant in $GEMMA4_VARIANTS; do
    local name=${variant%%|*} flags=${variant#*|}
    echo "== $name: ${flags//,/ }"
    infer bench latency --model $g4 ${flags//,/ } --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
      --save-result $work/gemma4-12b-latency-$name.json
  done
}
sampler-timing() {  # the token-draw kernel against the torch spec: device and wall time, batch 1-256
  python3 -m pytest -q -s --tb=short tests/kernels/test_token_draw.py tests/sampling
  python3 docs/benchmarks/scripts/sampler_timing.py --save $work/sampler-timing.json
}
host-profile-async() {  # where async scheduling's steps still wait on the device (sync sites counted)
  synth_q3
  python3 docs/benchmarks/scripts/host_profile.py $q3 --async-scheduling \
    --save $work/qwen3-4b-host-profile-async.json
  python3 docs/benchmarks/scripts/host_profile.py $q3 --async-scheduling --attention-backend triton \
    --save $work/qwen3-4b-host-profile-async-triton.json
}
vllm-qwen3() {  # vLLM 0.24's decode step on the same checkpoint (shared/device/vllm: staged by six
  # calls carrying .vllm/part1..6 first; never beside an infer step: it takes 90 % of the memory).
  # One engine start for every batch size (vllm_decode.py); bench.sh's process per run if that fails.
  synth_q3
  local waited=0
  while [ ! -f /tmp/vsite/vllm/__init__.py ] && [ $waited -lt 300 ]; do sleep 5; waited=$((waited + 5)); done
  [ -f /tmp/vsite/vllm/__init__.py ] || { echo "vLLM is not staged (.vllm/part1..6 not carried)"; return 1; }
  PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 \
    DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    python3 docs/benchmarks/scripts/vllm_decode.py $q3 --batch-sizes 1,8,64 --save $work/vllm-qwen3-4b.json ||
    bash ${ORIGIN:-.}/.vllm/part6/bench.sh $q3 $work/vllm 1,8,64
}
vllm-gemma4() {  # vLLM 0.24's decode step on the synthetic Gemma 4 12B. The image's transformers
  # (5.15+) moves `global_head_dim` into `per_layer_config`, whose `head_dim` vLLM 0.24 cannot read;
  # 5.14 keeps the published spelling. Stage it once on the CPU machine (vLLM's process only):
  #   pip download --no-deps transformers==5.14.0 -d .whl-deps/vllm-gemma4
  # with the tokenizers it accepts (<= 0.23.0; the image has 0.23.2, refused at import on 2026-12-05):
  #   pip download --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 --python-version 3.12 \
  #     tokenizers==0.22.2 -d .whl-deps/vllm-gemma4
  # and copy them to /tmp/parts in the call that carries .whl-deps (`cp .whl-deps/vllm-gemma4/*.whl /tmp/parts/`).
  synth_g4
  local tf=$parts/transformers-5.14.0-py3-none-any.whl tok=$(ls $parts/tokenizers-0.22.*.whl 2>/dev/null | head -1)
  [ -f $tf ] && [ -n "$tok" ] || { echo "transformers 5.14 or tokenizers 0.22 not staged in $parts"; return 1; }
  [ -d /tmp/vsite-tf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite-tf $tf $tok
  [ -f /tmp/vsite/vllm/__init__.py ] || { echo "vLLM is not staged (.vllm/part1..6 not carried)"; return 1; }
  # TRITON_ATTN: unset, vLLM runs every Gemma 4 layer on FA4 (CuTe: needs cutlass, not staged; 2026-12-05).
  PYTHONPATH=/tmp/vsite-tf:/tmp/vsite HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 \
    DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    python3 docs/benchmarks/scripts/vllm_decode.py $g4 --batch-sizes ${VLLM_GEMMA4_BATCHES:-1,8,64} \
    --attention-backend TRITON_ATTN --save $work/vllm-gemma4-12b.json
}
decode-attention-backends() {  # FlashInfer's decode kernel per backend (fa2, fa3) at the serving geometries
  python3 docs/benchmarks/scripts/decode_attention_backends.py --cuda-cores --save $work/decode-attention-backends.json
}
attn-layouts() {  # FlashInfer's decode (fa2) over the pool as laid out now (NHD, 16-token pages) and in
  # the layouts a change could give it (HND; 32- and 64-token pages), before making one
  python3 docs/benchmarks/scripts/decode_attention_backends.py --geometries "qwen3-4b,gemma4-12b sliding" \
    --backends fa2 --layouts NHD,HND --page-sizes 16,32,64 --batch-sizes 1,8,64 --save $work/attn-layouts.json
}
host-launch-costs() {  # what one eager launch costs the host (F.linear per BLAS backend, Triton dispatch)
  python3 docs/benchmarks/scripts/host_launch_costs.py --save $work/host-launch-costs.json
}
plan-async-tests() {  # FlashInfer planning never waits for the stream; FastLaunch; Qwen3.5 through the GDN decode mixer
  # and the Triton conv kernels; the split-KV attention's spec bounds against the host's spec
  python3 -m pytest -q -s --tb=short tests/kernels/test_flashinfer_plan_async.py tests/kernels/test_gdn_decode_mixer.py \
    tests/kernels/test_gdn_conv_varlen.py tests/models/test_decode_fusion.py -k "plan or mixer or conv or qwen35"
  python3 -m pytest -q --tb=short tests/kernels/test_triton_launch.py tests/kernels/test_triton_launch_gpu.py tests/kernels/test_gdn_gates.py
  python3 -m pytest -q --tb=short tests/kernels/test_decode_attention.py -k "spec"
}
qwen3-gates-decode-path() {  # the qwen3 manifest with every opt-in decode path on (before a default flips);
  # GATE_SELECT="--gate qwen3.X ..." runs only those gates (the report then says it is a subset)
  synth_q3
  infer gates --manifest qwen3 --shared-process --checkpoint $q3 ${GATE_SELECT:-$(gate_args qwen3)} ${GATE_DECODE_PATH:---decode-fusion \
    --attention-backend triton --sampling-backend triton} \
    --json $work/qwen3-gates-decode-path.json --junit $work/qwen3-gates-decode-path.xml
}
# A manifest with --async-scheduling named on every gate's engine (the default since 2026-12-06,
# so the same run as the plain manifest steps; gemma4's five gates that need the H200's memory have
# not yet run with it). One pipeline word per manifest, so each is timed and fails alone.
async-gates() {  # MANIFEST
  local ckpt
  case $1 in
    qwen3) synth_q3; ckpt=$q3 ;;
    qwen35) synth_q35; ckpt=$q35 ;;
    gemma4) synth_g4; ckpt=$g4 ;;
    *) echo "async-gates: no checkpoint for manifest $1"; return 2 ;;
  esac
  infer gates --manifest $1 --shared-process --checkpoint $ckpt $(gate_args $1) --async-scheduling \
    --json $work/$1-gates-async.json --junit $work/$1-gates-async.xml
}
async-gates-qwen3() { async-gates qwen3; }
async-gates-qwen35() { async-gates qwen35; }
async-gates-gemma4() { async-gates gemma4; }
conv-pieces-tests() {  # the varlen GDN conv writing q, k and v dense (conv_pieces), and FastLaunch
  python3 -m pytest -q --tb=short tests/kernels/test_gdn_conv_varlen.py tests/kernels/test_triton_launch_gpu.py
}
prefill-calls() {  # the 1k prefill synchronous and async, with the host's calls into CUDA counted: the
  # synchronous step spent 16.5 ms of host gap at 15a67ed against async's 3.6 ms, cause not found
  synth_q3
  infer bench latency --model $q3 --no-async-scheduling --batch-sizes 1 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen3-4b-prefill-calls-sync.json
  infer bench latency --model $q3 --async-scheduling --batch-sizes 1 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen3-4b-prefill-calls-async.json
  python3 docs/benchmarks/scripts/host_profile.py $q3 --batch-sizes 1 --prefill 1024 \
    --save $work/qwen3-4b-host-profile-sync.json
}
gemv-ab() {  # the decode step with the shipped H100 table (the plain GEMV at M <= 2) against the same
  # table with every "gemv" row set back to the faster of cuBLAS and ours in the same data; one session
  synth_q3
  local table=kernels/gemm/skinny_dispatch_h100.json
  cp $table $work/skinny-dispatch-h100-gemv.json
  for model in qwen3 gemma4; do
    [ $model = gemma4 ] && synth_g4
    local ckpt=$q3; [ $model = gemma4 ] && ckpt=$g4
    cp $work/skinny-dispatch-h100-gemv.json $table
    infer bench latency --model $ckpt --async-scheduling --batch-sizes 1,8 --breakdown \
      --save-result $work/$model-latency-async-gemv.json
    python3 - $table <<'PY'
import json, sys
from dataclasses import fields
from pathlib import Path
from infer_cli.bench.gemm_timing import GemmTiming
from kernels.gemm.skinny_dispatch import Backend, ChoiceTable, ShapeChoice
path = Path(sys.argv[1])
table = ChoiceTable.load(path)
names = {f.name for f in fields(GemmTiming)}
timed = {}
for data in sorted(Path("docs/benchmarks/data").glob("2026-12-05-gemm-*-h100-*.json")):
    for t in json.loads(data.read_text())["timings"]:
        t = GemmTiming(**{k: v for k, v in t.items() if k in names})
        timed[(t.n, t.k, t.rows)] = Backend.OURS if t.ours_us < t.cublas_us else Backend.CUBLAS
# A GEMV row of a shape that data has no timing for (Qwen3.5's, measured later) falls to cuBLAS.
shapes = tuple(
    ShapeChoice(c.n, c.k, c.dtype, c.settings,
                tuple((m, timed.get((c.n, c.k, m), Backend.CUBLAS) if b is Backend.GEMV else b)
                      for m, b in c.rows), c.mma)
    for c in table.shapes
)
ChoiceTable(shapes, table.device, table.measured_at + " (no gemv)").save(path)
PY
    infer bench latency --model $ckpt --async-scheduling --batch-sizes 1,8 --breakdown \
      --save-result $work/$model-latency-async-nogemv.json
  done
  cp $work/skinny-dispatch-h100-gemv.json $table
  # What PDL buys the whole step (every Triton kernel's, the norms and activation included):
  INFER_PDL=0 infer bench latency --model $q3 --async-scheduling --batch-sizes 1,8 --breakdown \
    --save-result $work/qwen3-latency-async-gemv-nopdl.json
}
prefill-graphs-tests() {  # a replay of the prefill graphs against the padded eager run (tiny Qwen3)
  python3 -m pytest -q --tb=short tests/engine/test_prefill_graphs.py
}
prefill-spread() {  # the 1k prefill's host gap spreads 5.6-18.6 ms between processes of one build
  # (busy 14.1-14.2 ms in each; tight within a process): the machine's CPU layout, then the prefill in
  # processes pinned to each half of the cores in turn, so a gap that follows the cores shows it
  synth_q3
  nvidia-smi topo -m; lscpu | grep -E "^(CPU\(s\)|NUMA|Model name|Thread|Core|Socket|CPU max MHz|CPU MHz)"
  local n half run cores
  n=$(nproc); half=$((n / 2))
  for run in 1 2 3; do
    for cores in "0-$((half - 1))" "$half-$((n - 1))"; do
      echo "== run $run on cores $cores"
      taskset -c $cores python3 -m infer_cli.main bench latency --model $q3 --batch-sizes 1 \
        --prefill-lens 1024 --breakdown --save-result $work/qwen3-4b-prefill-cores-$cores-$run.json |
        grep -E "prefill 1024|1024 "
    done
  done
}
prefill-host-ab() {  # the 1k prefill's host gap, still spreading 19-30 ms between processes with
  # 11.5-12 ms busy (not the cores: prefill-spread at 3aca86e): three processes each as shipped, with
  # OMP_NUM_THREADS=1 (torch's intra-op threads), and with the heap frozen out of Python's cyclic GC
  # after load (gc.freeze, as vLLM does); every run prints the time the GC took inside the timed steps
  synth_q3
  local run variant patch
  local gc_timer="import gc, time, atexit
import infer_cli.bench.latency as latency
gc_spent = {'ms': 0.0, 'runs': 0}
def on_gc(phase, info, _t=[0.0]):
    if phase == 'start': _t[0] = time.perf_counter()
    else: gc_spent['ms'] += (time.perf_counter() - _t[0]) * 1e3; gc_spent['runs'] += 1
shipped_prefill = latency.bench_prefill
def timed_prefill(*args, **kwargs):
    FREEZE
    gc.callbacks.append(on_gc)
    try: return shipped_prefill(*args, **kwargs)
    finally:
        gc.callbacks.remove(on_gc)
        print(f\"gc inside the prefill runs: {gc_spent['ms']:.2f} ms over {gc_spent['runs']} collections\")
latency.bench_prefill = timed_prefill"
  for run in 1 2 3; do
    for variant in shipped omp1 frozen; do
      echo "== run $run: $variant"
      patch=${gc_timer/FREEZE/$([ $variant = frozen ] && echo 'gc.collect(); gc.freeze()' || echo 'pass')}
      ( [ $variant = omp1 ] && export OMP_NUM_THREADS=1
        infer_patched "$patch" bench latency --model $q3 --batch-sizes 1 --prefill-lens 1024 --breakdown \
          --save-result $work/qwen3-4b-prefill-host-$variant-$run.json ) | grep -E "gc inside|│  tuned │   1024"
    done
  done
}
prefill-graphs-latency() {  # Qwen3-4B's 1k and 8k prefill with and without --prefill-graphs, both schedulers
  synth_q3
  local mode
  for mode in sync async; do
    local flags="--no-async-scheduling"; [ $mode = async ] && flags="--async-scheduling"
    infer bench latency --model $q3 $flags --batch-sizes 1 --prefill-lens 1024,8192 --breakdown \
      --save-result $work/qwen3-4b-prefill-$mode.json
    infer bench latency --model $q3 $flags --prefill-graphs --batch-sizes 1 --prefill-lens 1024,8192 \
      --breakdown --save-result $work/qwen3-4b-prefill-$mode-graphs.json
  done
}
qwen35-prefill-graphs-latency() {  # Qwen3.5-4B's 1k prefill (host-bound at 15a67ed) with and without them
  synth_q35
  infer bench latency --model $q35 --async-scheduling --batch-sizes 1 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen35-4b-prefill-async.json
  infer bench latency --model $q35 --async-scheduling --prefill-graphs --batch-sizes 1 --prefill-lens 1024 \
    --breakdown --save-result $work/qwen35-4b-prefill-async-graphs.json
}
prefill-graphs-gates-qwen3() {  # the qwen3 manifest with --prefill-graphs (and the H100 table's GEMV rows)
  synth_q3
  infer gates --manifest qwen3 --shared-process --checkpoint $q3 $(gate_args qwen3) --prefill-graphs \
    --json $work/qwen3-gates-prefill-graphs.json --junit $work/qwen3-gates-prefill-graphs.xml
}
prefill-graphs-gates-qwen35() {  # the qwen35 manifest with --prefill-graphs (before it may be the default)
  synth_q35
  infer gates --manifest qwen35 --shared-process --checkpoint $q35 $(gate_args qwen35) --prefill-graphs \
    --json $work/qwen35-gates-prefill-graphs.json --junit $work/qwen35-gates-prefill-graphs.xml
}
prefill-graphs-gates-gemma4() {  # the gemma4 manifest with --prefill-graphs (five gates need the H200's memory)
  synth_g4
  infer gates --manifest gemma4 --shared-process --checkpoint $g4 $(gate_args gemma4) --prefill-graphs \
    --json $work/gemma4-gates-prefill-graphs.json --junit $work/gemma4-gates-prefill-graphs.xml
}
sync-probe() {  # gemma4.chunked_prefill_leaves_headroom did not finish in 150-200 s synchronously on
  # an H100 at da31a49 (twice; 8 s under async scheduling between them), with nothing logged past
  # preflight: run it with faulthandler dumping every thread's stack when the timeout sends SIGABRT,
  # then the synchronous Qwen3-4B step, so a synchronous default that hangs shows where.
  synth_g4; synth_q3
  PYTHONFAULTHANDLER=1 timeout -s ABRT 150 python3 -m infer_cli.main gates --manifest gemma4 --shared-process --no-async-scheduling \
    --checkpoint $g4 --gate gemma4.chunked_prefill_leaves_headroom --json $work/gemma4-headroom-sync.json
  echo "headroom sync rc=$?"
  PYTHONFAULTHANDLER=1 timeout -s ABRT 300 python3 -m infer_cli.main bench latency --model $q3 --no-async-scheduling --batch-sizes 1,8 \
    --prefill-lens 1024 --breakdown --save-result $work/qwen3-4b-latency-sync.json
  echo "qwen3 sync latency rc=$?"
}
gemv-sweep() {  # the decode GEMV's rows per program and warps per Qwen3-4B projection at M = 1, plain
  # and as --decode-fusion fuses it (norm prologue, SiLU·mul and residual epilogues), cuBLAS beside
  python3 docs/benchmarks/scripts/gemv_sweep.py --save $work/gemv-sweep-m1.json
}
qwen3-timeline() {  # async decode steps with each kernel's start and duration (the breakdown's
  # timeline): the shipped kernels, --decode-fusion, the Triton decode attention
  DECODE_VARIANTS="async|--async-scheduling fusedasync|--async-scheduling,--decode-fusion
    tritonasync|--async-scheduling,--attention-backend=triton" qwen3-decode-variants
}
qwen3-table() {  # this card's Qwen3-4B dispatch rows measured anew (the H200's table predates the decode
  # GEMV), written over the running tree's table for the card (copy it back from the run), then the
  # async decode step that follows them
  synth_q3
  gemm-qwen3
  python3 - $work/skinny-dispatch-qwen3-4b.json <<'PY'
import sys
from pathlib import Path
import torch
import kernels.gemm.skinny_dispatch as dispatch
from kernels.gemm.skinny_dispatch import ChoiceTable
fresh = ChoiceTable.load(Path(sys.argv[1]))
path = Path(dispatch.__file__).with_name(dispatch.MEASURED_TABLES[torch.cuda.get_device_name()])
new = {(c.n, c.k, c.dtype) for c in fresh.shapes}
old = ChoiceTable.load(path)
kept = ChoiceTable(tuple(c for c in old.shapes if (c.n, c.k, c.dtype) not in new), old.device, old.measured_at)
ChoiceTable.merged([kept, fresh]).save(path)
print(f"{path}: {len(fresh.shapes)} shapes measured now, {len(kept.shapes)} kept")
PY
  cp kernels/gemm/skinny_dispatch_h*.json $work/
  infer bench latency --model $q3 --async-scheduling --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen3-4b-latency-async-table.json
}
# infer in a process whose modules PATCH (Python statements, run first) has changed: an A/B of one
# setting inside the shipped code without a flag for it.
infer_patched() {
  local patch=$1; shift
  python3 - "$@" <<PY
import sys
$patch
from infer_cli.main import app
sys.argv[0] = "infer"
app()
PY
}
# NAME|K_TAIL words: the layouts gemv-layout-ab times the decode GEMV in; NAME|FLAGS words: the
# projections it times them under (FLAGS ","-separated).
GEMV_LAYOUTS=${GEMV_LAYOUTS:-"oneblock|False tail|True"}
GEMV_PATHS=${GEMV_PATHS:-"plain| fused|--decode-fusion"}
gemv-layout-ab() {  # Qwen3-4B's async decode step with the decode GEMV in each layout, plain (every
  # projection at M <= 2 sent to it, whatever the card's table says: the H200's has no GEMV rows) and
  # as --decode-fusion fuses it; each process wraps gemv_settings to impose its layout
  synth_q3
  local layout path
  for path in $GEMV_PATHS; do
    IFS='|' read -r pname flags <<<"$path"
    for layout in $GEMV_LAYOUTS; do
      IFS='|' read -r name tail <<<"$layout"
      echo "== $pname $name: k_tail=$tail"
      infer_patched "import dataclasses
import kernels.gemm.skinny_dispatch as dispatch
import kernels.triton.fused_gemv as gemv
shipped = gemv.gemv_settings
gemv.gemv_settings = lambda n, k, *, gated=False: dataclasses.replace(
    shipped(n, k, gated=gated), k_tail=$tail)
table_backend = dispatch.ShapeChoice.backend
dispatch.ShapeChoice.backend = lambda self, m: (2, dispatch.Backend.GEMV) if m <= 2 else table_backend(self, m)" \
        bench latency --model $q3 --async-scheduling ${flags//,/ } --batch-sizes 1,8 --prefill-lens 1024 \
        --breakdown --save-result $work/qwen3-4b-latency-async-$pname-$name.json
    done
  done
}
attn-split-ab() {  # Qwen3-4B's async decode step with FlashInfer's KV split as shipped (`tuned`:
  # the planner's split, off in graph buckets that fill the SMs) and with it off everywhere (what
  # `invariant` plans): at 957843a, off cost batch 1 0.07 ms and gave batch 64 0.18 ms (H100)
  synth_q3
  local split patch
  for split in shipped off; do
    echo "== KV split: $split"
    patch=""
    [ $split = off ] && patch="import kernels.attention.flashinfer_backend as backend
backend.FlashInferAttention.split_kwargs = lambda self, *plan: {'disable_split_kv': True}"
    infer_patched "$patch" bench latency --model $q3 --async-scheduling --batch-sizes 1,8,64 --prefill-lens 1024 \
      --breakdown --save-result $work/qwen3-4b-latency-async-split-$split.json
  done
}
attn-chunk-ab() {  # Qwen3-4B's async decode step at batch 1 and 8 with FlashInfer's KV split as the
  # planner sizes it (shipped), pinned to SPLIT_PAGES pages a chunk (fixed_split_size), or off
  # (disable_split_kv: no merge kernel) in graph buckets below the SMs' fill, where the split and its
  # merge kernel run (2.4 us a layer at batch 1)
  synth_q3
  local pages patch kwargs
  for pages in shipped ${SPLIT_PAGES:-off 2 4 8 16}; do
    echo "== KV chunk: $pages"
    patch=""
    kwargs="{'fixed_split_size': $pages}"
    [ $pages = off ] && kwargs="{'disable_split_kv': True}"
    [ $pages = shipped ] || patch="import kernels.attention.flashinfer_backend as backend
shipped = backend.FlashInferAttention.split_kwargs
def split_kwargs(self, layer, graph_bucket=None):
    kwargs = shipped(self, layer, graph_bucket)
    return kwargs if kwargs or graph_bucket is None else $kwargs
backend.FlashInferAttention.split_kwargs = split_kwargs"
    infer_patched "$patch" bench latency --model $q3 --batch-sizes 1,8 --prefill-lens 1024 --breakdown \
      --save-result $work/qwen3-4b-latency-attn-chunk-$pages.json
  done
}
mma-rows-ab() {  # Qwen3-4B's async decode step at batch 8 and 16 as shipped, with the QKV projection
  # at 5-16 rows on the fused MMA (plain; 14.9 against cuBLAS's 15.6 us at M = 8 per shape, 6d505ba),
  # and with the down projection there on the skinny GEMM too (PDL; 24.1 against 23.8); two runs each.
  # Run at 27dcee1 (docs/benchmarks/qwen3.md); since 9b704c0 the H100's shipped table puts the QKV
  # (and the LM head) at M = 8 and 16 on the MMA already, so "shipped" is no longer cuBLAS there.
  synth_q3
  local run variant
  local mma="import kernels.gemm.skinny_dispatch as dispatch
from kernels.triton.fused_mma import MmaSettings, fused_mma
from kernels.triton.fused_gemv import Fusion
from kernels.triton.skinny_gemm import skinny_gemm
table_call = dispatch.SkinnyDispatch.__call__
def call(self, x, weight):
    m = x.reshape(-1, x.shape[-1]).shape[0]
    shape = tuple(weight.shape)
    if 4 < m <= 16 and shape == (6144, 2560):
        return fused_mma(x.reshape(-1, 2560), weight, Fusion(), MmaSettings(block_n=32, block_k=128)).reshape(*x.shape[:-1], 6144)
    if 4 < m <= 16 and shape == (2560, 9728) and DOWN:
        choice = self.table.lookup(2560, 9728, weight.dtype)
        return skinny_gemm(x.reshape(-1, 9728), weight, choice.settings).reshape(*x.shape[:-1], 2560)
    return table_call(self, x, weight)
dispatch.SkinnyDispatch.__call__ = call"
  for run in 1 2; do
    for variant in shipped qkv qkv-down; do
      echo "== $variant, run $run"
      local patch=""
      [ $variant = qkv ] && patch="DOWN = False
$mma"
      [ $variant = qkv-down ] && patch="DOWN = True
$mma"
      infer_patched "$patch" bench latency --model $q3 --batch-sizes 8,16 --prefill-lens 1024 --breakdown \
        --save-result $work/qwen3-4b-latency-mma-$variant-$run.json
    done
  done
}
gemv-rows-ab() {  # Qwen3-4B's decode step at batch 1-8 as shipped, with the decode GEMV taking every
  # projection up to 4 rows (its MAX_ROWS), and up to 8 (MAX_ROWS patched): at 957843a batch 8 ran
  # the skinny GEMM and cuBLAS, 3.27 ms of projections against the GEMV's 2.87 at batch 1
  synth_q3
  infer bench latency --model $q3 --batch-sizes 1,2,4,8 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen3-4b-latency-gemv-rows-shipped.json
  local rows
  for rows in 4 8; do
    echo "== the GEMV up to $rows rows"
    infer_patched "import kernels.gemm.skinny_dispatch as dispatch
import kernels.triton.fused_gemv as gemv
gemv.MAX_ROWS = $rows
table_backend = dispatch.ShapeChoice.backend
dispatch.ShapeChoice.backend = lambda self, m: (m, dispatch.Backend.GEMV) if m <= $rows else table_backend(self, m)" \
      bench latency --model $q3 --batch-sizes 1,2,4,8 --prefill-lens 1024 --breakdown \
      --save-result $work/qwen3-4b-latency-gemv-rows$rows.json
  done
}
# NAME|KWARGS words: the decode wrappers decode-kernel-ab times (KWARGS forced on every
# BatchDecodeWithPagedKVCacheWrapper; empty: as shipped, tensor cores with backend "auto", which
# FlashInfer resolves to fa2 for bf16). On H100s both lost at batch 1, 8 and 64: the CUDA-core kernel
# (`cc|use_tensor_cores=False`, vLLM's FlashInfer choice at 4 query heads per KV head) at f917641, fa3
# at 74bd4e8 (docs/benchmarks/qwen3.md).
DECODE_KERNELS=${DECODE_KERNELS:-"tc| fa3|backend='fa3'"}
decode-kernel-ab() {  # Qwen3-4B's decode step with each of DECODE_KERNELS' FlashInfer decode kernels,
  # twice each, interleaved. A module not in .fi-aot is JIT-compiled (~1-2 min) before the first run
  # that needs it times anything.
  synth_q3
  local round word name kwargs patch
  for round in 1 2; do
    for word in $DECODE_KERNELS; do
      name=${word%%|*} kwargs=${word#*|}
      echo "== decode attention: $name ($round)"
      patch=""
      [ -n "$kwargs" ] && patch="import flashinfer
shipped_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper
class VariantDecode(shipped_wrapper):
    def __init__(self, *args, **kwargs):
        kwargs.update(dict($kwargs))
        super().__init__(*args, **kwargs)
flashinfer.BatchDecodeWithPagedKVCacheWrapper = VariantDecode"
      infer_patched "$patch" bench latency --model $q3 --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
        --save-result $work/qwen3-4b-latency-decode-$name$round.json
    done
  done
}
split-rule-check() {  # HEAD's async step with the graph-mode KV-split rule (fed81a7: the split off
  # once a bucket's rows x KV heads fill the SMs), and the graph gate a plan change could break
  synth_q3
  infer bench latency --model $q3 --async-scheduling --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen3-4b-latency-async-split-rule.json
  infer gates --manifest qwen3 --checkpoint $q3 --gate qwen3.graph_replay_matches_eager \
    --gate qwen3.batch_invariance_is_bitwise --json $work/qwen3-split-rule-gates.json
}
pdl-tests() {  # the norms and the activation against their specs on the GPU (PDL on), a PDL chain in a
  # graph against eager, FastLaunch
  python3 -m pytest -q --tb=short tests/kernels/test_layer_ops.py tests/kernels/test_gated_act.py \
    tests/kernels/test_triton_launch_gpu.py tests/kernels/test_fused_gemv.py
}
q35p=/tmp/ckpt/q35-4b-published
synth_q35p() { [ -d $q35p ] || infer synth qwen35 --preset 4b --form published --out $q35p --dtype bfloat16 --tokenizer trained --device cuda; }
qwen35-published-latency() {  # infer's side of the vLLM row, on the directory vLLM reads: default and async
  synth_q35p
  infer bench latency --model $q35p --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen35-4b-published-latency.json
  infer bench latency --model $q35p --async-scheduling --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen35-4b-published-latency-async.json
}
vllm-qwen35() {  # issue 19's vLLM row: vLLM 0.24 serves Qwen3.5 only in its published multimodal form
  # (`infer synth qwen35 --form published`), here as a language model only; the Qwen3.5 code needs
  # the staging extras (`VSTAGE_EXTRAS=1 bash .vllm/part6/stage.sh 6 last`). infer's side of the row
  # is qwen35-published-latency.
  synth_q35p
  [ -f /tmp/vsite/vllm/__init__.py ] || { echo "vLLM is not staged (.vllm/part1..6 not carried)"; return 1; }
  PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 \
    DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    python3 docs/benchmarks/scripts/vllm_decode.py $q35p --language-model-only --gdn-prefill-backend triton \
    --batch-sizes 1,8,64 \
    --save $work/vllm-qwen35-4b.json
}
kernels() {
  infer gates --manifest kernels --tier gpu --json $work/kernels-gates.json
  infer bench kernels --save-result $work/bench-kernels.json
}
# Carried parts land in /tmp/parts: each call that carries `.g3/partN` or `.cdsl/partN` copies it
# there first (`cp -r .g3/partN/. /tmp/parts/`), so a step can wait for what later calls bring.
parts=/tmp/parts
await_part() {  # FILE [SECONDS]: wait for a carried part to arrive
  local waited=0
  while [ ! -f "$parts/$1" ] && [ $waited -lt "${2:-600}" ]; do sleep 5; waited=$((waited + 5)); done
  [ -f "$parts/$1" ] || { echo "part $1 never arrived" >&2; return 1; }
}
g3=/tmp/ckpt/g3-270m
real_g3() {  # the real Gemma 3 270M: its GGUF carried in five parts (.g3/part1..5), converted here
  [ -d $g3 ] && return 0
  await_part g3.sha256 && await_part g3.chunk-ae || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $parts/gguf-*.whl
  cat $parts/g3.chunk-a? > /tmp/gemma3-270m.gguf && (cd /tmp && sha256sum -c $parts/g3.sha256) || return 1
  infer convert gguf /tmp/gemma3-270m.gguf --out $g3 &&
    python3 -c "import sys; from pathlib import Path; from models.gguf.embedded import add_gemma3_chat; add_gemma3_chat(Path(sys.argv[1]))" $g3
}
g3s=/tmp/ckpt/g3-270m-synth
gemma3-latency() {  # Gemma 3 270M's shapes (synthetic weights, the published vocabulary): latency;
  # it builds FlashInfer's head-dim-256 kernels while the real weights convert beside it
  [ -d $g3s ] || infer synth gemma3 --preset 270m --out $g3s --dtype bfloat16 --device cuda
  infer bench latency --model $g3s --batch-sizes 1,8,64 --prefill-lens 1024,8192 --breakdown \
    --save-result $work/gemma3-270m-latency.json
}
gemma3-gates() {  # the gemma3 manifest on the real 270M weights (bf16, FlashInfer)
  # The pipeline starts the conversion beside the steps before this one (CPU only).
  while [ -f $work/real-g3.running ]; do sleep 5; done
  real_g3 || return 1
  infer gates --manifest gemma3 --shared-process --checkpoint $g3 $(gate_args gemma3) \
    --json $work/gemma3-gates.json --junit $work/gemma3-gates.xml
}
cutlass_dsl() {  # FlashInfer's SM90 GDN prefill needs the CUTLASS DSL: carried in .cdsl/part1..2
  # (scripts/stage_cutlass_dsl.sh makes them)
  python3 -c "import cutlass" 2>/dev/null && return 0
  await_part cu13.sha256 && await_part cu13.chunk-ab && await_part cu13.chunk-aa || return 1
  local whl=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  cat $parts/cu13.chunk-a? > $parts/$whl && (cd $parts && sha256sum -c cu13.sha256) || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $parts/nvidia_cutlass_dsl*.whl \
    $parts/cuda_bindings-*.whl $parts/cuda_pathfinder-*.whl || return 1
  python3 -c "import google.protobuf" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $parts/protobuf-*.whl
  python3 -c "import cutlass; print('cutlass dsl', cutlass.__version__ if hasattr(cutlass, '__version__') else 'ok')"
}
qwen35-agree() {  # the GDN backends' agreement gate alone, on the 4b
  synth_q35
  infer gates --manifest qwen35 --checkpoint $q35 --tier gpu --gate qwen35.gdn_backends_agree \
    --json $work/qwen35-gdn-gate.json
}
async-check() {  # async against sync scheduling on Qwen3-4B: step time and token identity
  synth_q3
  python3 docs/benchmarks/scripts/async_check.py $q3 --batch-sizes 1,8,64 --context 512 \
    --save $work/async-check.json
}
qwen35-gpu-tests() {  # the GDN kernel tests that run on the GPU when there is one (fla-core staged)
  cutlass_dsl || echo "no CUTLASS DSL: FlashInfer's GDN prefill is not checked"
  python3 -m pytest -q -s --tb=short tests/kernels/test_gdn_decode.py tests/kernels/test_gdn_fla.py \
    tests/kernels/test_gdn_torch.py
}
qwen35-fla-tests() {  # the fla backend's GPU tests and the agreement check's own
  python3 -m pytest -q -s --tb=short tests/kernels/test_gdn_fla.py tests/kernels/test_gdn_agreement.py
}
qwen35-bench-gdn() {  # one GDN layer per backend, 4B and 9B geometry (the JSON on stdout)
  infer bench gdn --json >$work/qwen35-bench-gdn.json
}
qwen35-gates() {  # the whole manifest, GPU tier included, on the 4b
  synth_q35
  infer gates --manifest qwen35 --shared-process --checkpoint $q35 $(gate_args qwen35) \
    --json $work/qwen35-gates.json --junit $work/qwen35-gates.xml
}
qwen35-latency() {  # decode and prefill on the 4b, one load per GDN backend (auto picks one of them)
  synth_q35
  for backend in ${GDN_BACKENDS:-fla flashinfer}; do
    infer bench latency --model $q35 --gdn-backend $backend --batch-sizes 1,8,64 \
      --prefill-lens 1024,8192 --breakdown --save-result $work/qwen35-4b-latency-$backend.json
  done
}
qwen35-decode-fused() {  # the 4b with --decode-fusion (fused projections and the 3-launch GDN decode
  # mixer): its GPU tests, then decode beside qwen35-latency's default
  synth_q35
  python3 -m pytest -q -s --tb=short tests/kernels/test_gdn_decode_mixer.py tests/models/test_decode_fusion.py
  infer bench latency --model $q35 --decode-fusion --batch-sizes 1,8,64 --prefill-lens 1024 --breakdown \
    --save-result $work/qwen35-4b-latency-fused.json
}
qwen35-parity() {  # CHECKPOINT NAME [GATE...]: transformers-parity gates alone (both by default)
  local checkpoint=$1 name=$2; shift 2
  local gates=("${@:-full_forward_matches_hf greedy_matches_hf_generate}")
  infer gates --manifest qwen35 --shared-process --checkpoint "$checkpoint" \
    $(printf -- "--gate qwen35.%s " ${gates[*]}) \
    --json $work/qwen35-$name-parity-gates.json --junit $work/qwen35-$name-parity-gates.xml
}
qwen35-4b-parity() { synth_q35; qwen35-parity $q35 4b; }
qwen35-9b-parity() { synth_q35_9b; qwen35-parity $q35_9b 9b; }
# The 9b's teacher-forced gate alone: its greedy gate passed at 9c95829, this one never reached a verdict.
qwen35-9b-forward() { synth_q35_9b; qwen35-parity $q35_9b 9b-forward full_forward_matches_hf; }
qwen35() {  # every Qwen3.5 step, cheapest first; a step that fails does not stop the next
  for step in qwen35-gpu-tests qwen35-bench-gdn qwen35-gates qwen35-latency qwen35-9b-parity; do
    echo "== $step"; "$step" || echo "$step failed rc=$?"
  done
}
PIPELINE=${PIPELINE:-"qwen3-latency qwen3-gates gemma4-latency gemma4-gates"}

# The pipeline, in its own session so it outlives the call; $work/STEP.log per step, and
# $work/steps.txt a line as each step ends.
pipeline() {
  touch $work/pipeline.running
  echo $$ >$work/pipeline.pid  # a session leader (setsid): its process group is the whole pipeline
  if [[ " $PIPELINE " == *" gemma3-gates "* ]] && [ ! -d $g3 ]; then
    touch $work/real-g3.running
    (real_g3 >$work/real-g3.log 2>&1; rm -f $work/real-g3.running) &
  fi
  # SYNTH_AHEAD=0 when timed steps come first: a checkpoint written beside them would skew them.
  [[ "$PIPELINE" == *qwen35-* && ${SYNTH_AHEAD:-1} == 1 ]] && qwen35_synth_bg
  for group in $PIPELINE; do
    local lane
    for lane in ${group//+/ }; do
      ( for step in ${lane//,/ }; do run_step "$step"; done ) &
    done
    wait
  done
  rm -f $work/pipeline.running
}
run_step() {
  local started=$SECONDS
  echo "$(date -u +%T) start $1" >>$work/steps.txt
  "$1" >$work/$1.log 2>&1
  local rc=$?
  echo "$(date -u +%T) end $1 rc=$rc in $((SECONDS - started)) s" >>$work/steps.txt
}

# Follow until the pipeline ends or this call's time is nearly spent (WAIT_S), then pack $work.
follow() {
  local deadline=$((SECONDS + ${WAIT_S:-540}))
  while [ -f $work/pipeline.running ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  cat $work/steps.txt 2>/dev/null
  for log in $work/*.log; do
    [ -f "$log" ] && { echo "== $log"; grep -E "^ *(passed|failed|timeout|error|skipped) |^        |rc=|Error" "$log" | tail -25; }
  done
  [ -f $work/pipeline.running ] && echo "pipeline still running"
  tar czf "$out/runs.tgz" -C $work --exclude='*.running' . 2>/dev/null
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  true
}

case "${STAGE:-all}" in
  all)
    # A restart (after a fix sent in the same stretch) first stops the pipeline already running.
    if [ -f $work/pipeline.pid ]; then
      kill -- -"$(cat $work/pipeline.pid)" 2>/dev/null && sleep 5
      rm -f $work/pipeline.pid $work/pipeline.running
    fi
    rm -f $work/steps.txt
    # Every call copies the working tree anew, and a step that imports while that happens can find
    # modules missing (2026-12-05): the pipeline runs from a copy of its own.
    rm -rf /tmp/tree && mkdir -p /tmp/tree
    tar -C "$PWD" --exclude=./.vllm --exclude=./.whl-fi --exclude=./.whl-deps --exclude=./.cdsl --exclude=./.g3 --exclude=./.fi-aot \
      -cf - . | tar -C /tmp/tree -xf -
    (cd /tmp/tree && ORIGIN=$OLDPWD STAGE=pipeline setsid bash docs/benchmarks/scripts/h200_session.sh \
      </dev/null >/dev/null 2>&1 &)
    sleep 2
    follow ;;
  pipeline) pipeline ;;
  wait) follow ;;
  gemma4-gates | gpu-tests | host-profile | qwen3-greedy | gemma4-latency | norms-check | numerics | invariance | buckets | startup | gemma4-startup | qwen3-gates | qwen3-latency | attn-triton | attn-triton-tests | attn-triton-latency | gemm | decode-paths | kernels | gemma3-latency | gemma3-gates | qwen35-agree | async-check | qwen35 | decode-tests | sampler-timing | gemm-qwen3 | qwen3-decode-variants | gemma4-decode-variants | host-profile-async | vllm-qwen3 | vllm-gemma4 | vllm-qwen35 | qwen3-gates-decode-path | qwen35-gpu-tests | qwen35-fla-tests | qwen35-bench-gdn | qwen35-gates | qwen35-latency | qwen35-4b-parity | qwen35-9b-parity | qwen35-decode-fused | host-launch-costs | async-gates-qwen3 | async-gates-qwen35 | async-gates-gemma4 | prefill-calls | decode-attention-backends | gemm-gemma4 | gemm-qwen35 | conv-pieces-tests | gemv-ab | pdl-tests | sync-probe | qwen3-table | gemv-sweep | gemv-layout-ab | attn-split-ab | decode-kernel-ab | invariant-gpu-tests | invariant-tiles-probe | invariant-triton-attn | prefill-host-ab | split-rule-check | gemv-rows-ab | prefill-spread | qwen3-timeline | prefill-graphs-tests | prefill-graphs-latency | prefill-graphs-gates-qwen3 | prefill-graphs-gates-qwen35 | prefill-graphs-gates-gemma4 | qwen35-prefill-graphs-latency | attn-layouts | qwen35-9b-forward | mma-rows-ab | attn-chunk-ab | fused-compose-check | default-attn-gates | pdl-preload-probe | attn-split-sizes | attn-split-size-ab | gate-act-head-ab | gate-act-lines-ab | lines-attn-ab | attn-rows64-split-ab)
    "$STAGE"; cp $work/*.json "$out"/ 2>/dev/null; true ;;
  *) echo "unknown STAGE=${STAGE}" >&2; exit 2 ;;
esac
