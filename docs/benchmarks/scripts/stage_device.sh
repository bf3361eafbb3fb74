#!/usr/bin/env bash
# Everything a GPU stretch carries, staged on the CPU machine from a new checkout (the staging
# folders are git-ignored, so a checkout never has them), from the project root:
#   bash docs/benchmarks/scripts/stage_device.sh          wheels and vLLM (~1 min), then the
#                                                         FlashInfer AOT build in the background
#   AOT=0 bash docs/benchmarks/scripts/stage_device.sh    wheels and vLLM only
# Leaves .whl-fi, .whl-deps (with fi-tail), .vllm/part1..6 and, as each module is built, .fi-aot;
# h200_session.sh's header has the calls that carry them. The AOT build writes its log to
# /tmp/fi-aot.log; head dim 128's two modules take ~4 and ~21 min beside a `make test` on 2 cores,
# the three at 256 ~4-12 min each, 512 last. A module carried before it is built is JIT-built on the
# device instead (~1.5 min each on 16 cores).
set -euo pipefail
here=$(dirname "$0")
shared=${SHARED:-../shared/device}

[ -f .whl-fi/fi.chunk-aa ] || { bash "$shared/stage-wheels.sh"; bash "$here/split_flashinfer_wheel.sh"; }
[ -f .vllm/part6/stage.sh ] || { bash "$shared/vllm/fetch.sh"; bash "$here/resplit_vllm_parts.sh"; }
grep -qx "/.fi-aot/" .git/info/exclude || echo "/.fi-aot/" >>.git/info/exclude
[ "${AOT:-1}" = 1 ] || exit 0
[ -x .venv/bin/python ] || make install

# The AOT build runs in this machine's Python (3.11) with the project's venv for torch: the staged
# flashinfer wheel, the cp311 build of the staged apache-tvm-ffi, ninja, and what flashinfer imports
# (nvidia-ml-py, einops), installed into a folder of their own.
site=/tmp/fi-aot-site
fetched=$(mktemp -d)
cat .whl-fi/fi.chunk-aa .whl-deps/fi-tail/fi.chunk-ab >"$fetched/$(cut -d' ' -f3 .whl-deps/fi-tail/fi.sha)"
(cd "$fetched" && sha256sum -c --quiet "$OLDPWD/.whl-deps/fi-tail/fi.sha")
tvm=$(ls .whl-deps/apache_tvm_ffi-*.whl | sed 's/.*apache_tvm_ffi-\([^-]*\)-.*/\1/')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --abi cp311 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$fetched" "apache-tvm-ffi==$tvm" ninja "nvidia-curand>=10.4" nvidia-ml-py einops
python3 -m pip install -q --no-index --no-deps --target "$site" "$fetched"/*.whl
rm -rf "$fetched"
# The CUDA 13 toolkit here lacks curand's headers and a libcuda.so to link against (the device's
# driver resolves the stub's soname at load time).
cuda=${CUDA_HOME:-/usr/local/cuda}
cp "$site"/nvidia/cu13/include/curand*.h "$cuda/include/"
if [ ! -f "$cuda/lib64/stubs/libcuda.so" ]; then
  mkdir -p "$cuda/lib64/stubs"
  echo "" >/tmp/libcuda-stub.c
  gcc -shared -Wl,-soname,libcuda.so.1 -o "$cuda/lib64/stubs/libcuda.so" /tmp/libcuda-stub.c
fi
PYTHONPATH=$site:$PWD PATH=$site/bin:$PATH FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME=$cuda \
  setsid .venv/bin/python "$here/flashinfer_aot.py" build .fi-aot >/tmp/fi-aot.log 2>&1 &
echo "FlashInfer AOT build started (log /tmp/fi-aot.log; modules land in .fi-aot as they finish)"
