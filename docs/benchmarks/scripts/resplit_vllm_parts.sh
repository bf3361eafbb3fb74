#!/usr/bin/env bash
# After ../shared/device/vllm/fetch.sh, on the CPU machine, from the project root: its 58 MiB parts
# and this tree (~9 MB tracked) pass one device call's 64 MiB together, so the vLLM wheel is cut
# again into 48 MiB chunks, six parts (.vllm/part1..6; the wheels vLLM needs in part6), each with a
# stage.sh that expects six chunks. Calls: `bash .vllm/partN/stage.sh N` carrying .vllm/partN, the
# sixth `bash .vllm/part6/stage.sh 6 last`.
set -euo pipefail
src=.vllm
[ -f "$src/part1/stage.sh" ] || { echo "run ../shared/device/vllm/fetch.sh first" >&2; exit 1; }
whl=$(sed -n 's/^WHL=//p' "$src/part1/stage.sh")
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for p in 1 2 3 4 5; do cat "$src/part$p/$whl".chunk-*; done > "$work/$whl"
sha=$(sed -n 's/^WHL_SHA256=\([0-9a-f]*\).*/\1/p' "$src/part1/stage.sh")
echo "$sha  $work/$whl" | sha256sum -c --quiet
mkdir -p "$work/deps"
cp -r "$src/part5"/*.whl "$src/part5/optional" "$work/deps/"
cp "$src/part1/stage.sh" "$src/part1/bench.sh" "$work/"
(cd "$work" && split -b 48M "$whl" "$whl.chunk-")
chunks=$(cd "$work" && ls "$whl".chunk-* | sed 's/.*chunk-//' | tr '\n' ' ' | sed 's/ $//')
n=$(wc -w <<<"$chunks")
sed -i -e "s/^CHUNKS=\"[a-z ]*\"/CHUNKS=\"$chunks\"/" -e "s/^NPARTS=[0-9]*/NPARTS=$n/" \
  -e "s/split -b 58M suffixes/split -b 48M suffixes/" "$work/stage.sh"
rm -rf "$src"; mkdir -p "$src"
i=0
for c in $chunks; do
  i=$((i + 1)); mkdir -p "$src/part$i"; mv "$work/$whl.chunk-$c" "$src/part$i/"
  cp "$work/stage.sh" "$work/bench.sh" "$src/part$i/"
done
cp -r "$work/deps"/* "$src/part$n/"
for p in "$src"/part*; do (cd "$p" && find . -type f ! -name SHA256SUMS | sed 's|^\./||' | sort | xargs sha256sum > SHA256SUMS); done
du -sh "$src"/part*
