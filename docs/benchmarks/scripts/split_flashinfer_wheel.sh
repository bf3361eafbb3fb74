#!/usr/bin/env bash
# After ../shared/device/stage-wheels.sh, on the CPU machine, from the project root: the tree, .git
# and the 62 MB flashinfer wheel together pass one device call's 64 MiB, so the wheel travels in two
# pieces. Leaves .whl-fi/fi.chunk-aa (first call) and .whl-deps/fi-tail/{fi.chunk-ab,fi.sha} (second
# call, beside the other wheels); h200_session.sh's header has the two calls that join, check and
# install it.
set -euo pipefail
wheel=$(ls .whl-fi/flashinfer_python-*.whl)
name=$(basename "$wheel")
work=$(mktemp -d)
cp "$wheel" "$work/"
(cd "$work" && sha256sum "$name" > fi.sha && split -b 46M "$name" fi.chunk-)
[ "$(ls "$work"/fi.chunk-* | wc -l)" -eq 2 ] || { echo "expected two pieces of $name" >&2; exit 1; }
rm -f .whl-fi/*
mkdir -p .whl-deps/fi-tail
mv "$work/fi.chunk-aa" .whl-fi/
mv "$work/fi.chunk-ab" "$work/fi.sha" .whl-deps/fi-tail/
rm -rf "$work"
du -sh .whl-fi .whl-deps
