#!/usr/bin/env bash
# The synthetic DeepSeek-V2-Lite shape the figures of docs/performance.md and docs/cluster.md are
# measured on: `ds2 bench`'s synthetic checkpoint (V2-Lite's exact layer shapes, random bf16
# weights, about 1.1 GB of disk a layer) LAYERS deep, in OUT_DIR/bench, and its `ds2 quantize`
# copies OUT_DIR/liteLAYERS-q8 and OUT_DIR/liteLAYERS-q4 (BITS: which copies, default "8 4").
# At 27 layers (the default, the full shape) that is 31 GB of bf16, a 16.4 GB 8-bit copy and a
# 9.5 GB 4-bit one; `make_lite.sh OUT 4` makes the 4-layer slice (lite4-q8, lite4-q4). What
# exists already is kept. Prints the copies' paths, one a line.
#   bench/make_lite.sh OUT_DIR [LAYERS]        (PYTHON: the interpreter with ds2, default python3)
set -euo pipefail
out="${1:?usage: make_lite.sh OUT_DIR [LAYERS]}"
layers="${2:-27}"
python=${PYTHON:-python3}
mkdir -p "$out"
bf16=$("$python" -c "import sys; from pathlib import Path; from ds2cli.cli.bench.synthetic import synthetic_model; \
print(synthetic_model(Path(sys.argv[1]), int(sys.argv[2])))" "$out/bench" "$layers")
for bits in ${BITS:-8 4}; do
    copy="$out/lite$layers-q$bits"
    [ -d "$copy" ] || "$python" -m ds2cli quantize "$bf16" "$copy" --bits "$bits" >&2
    echo "$copy"
done
