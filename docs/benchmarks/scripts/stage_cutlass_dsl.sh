#!/usr/bin/env bash
# On the CPU machine, from the project root: stage the CUTLASS DSL (FlashInfer's SM90 GDN prefill
# needs it) in two carry folders under one call's 64 MiB each. The 92 MB cu13 libs wheel is split;
# h200_session.sh's cutlass_dsl step reassembles, checks and installs it from /tmp/parts.
#   .cdsl/part1: cu13.chunk-aa, cu13.sha256
#   .cdsl/part2: cu13.chunk-ab and the small wheels
set -euo pipefail
version=${CUTLASS_DSL_VERSION:-4.8.1}
grep -qx "/.cdsl/" .git/info/exclude 2>/dev/null || echo "/.cdsl/" >> .git/info/exclude
dl=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" \
  "nvidia-cutlass-dsl[cu13]==$version"
rm -rf .cdsl && mkdir -p .cdsl/part1 .cdsl/part2
big=nvidia_cutlass_dsl_libs_cu13-$version-cp312-cp312-manylinux_2_28_x86_64.whl
(cd "$dl" && sha256sum "$big" > cu13.sha256 && split -b 58M "$big" cu13.chunk-)
mv "$dl"/cu13.chunk-aa "$dl"/cu13.sha256 .cdsl/part1/
mv "$dl"/cu13.chunk-ab .cdsl/part2/
for whl in "$dl"/nvidia_cutlass_dsl-*.whl "$dl"/nvidia_cutlass_dsl_libs_base-*.whl \
           "$dl"/nvidia_cutlass_dsl_libs_core-*.whl "$dl"/cuda_bindings-*.whl \
           "$dl"/cuda_pathfinder-*.whl "$dl"/protobuf-*.whl; do
  mv "$whl" .cdsl/part2/
done
rm -rf "$dl"
du -sh .cdsl/part1 .cdsl/part2
