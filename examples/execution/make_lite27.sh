#!/usr/bin/env bash
# The 27-layer synthetic DeepSeek-V2-Lite shape (ds2 bench's synthetic checkpoint at full depth,
# random bf16 weights, 31 GB) and its `--bits 8` copy (16.4 GB): the model the execution figures
# in docs/performance.md are measured on. Usage: make_lite27.sh OUT_DIR (needs ~48 GB free).
set -euo pipefail
out="${1:?usage: make_lite27.sh OUT_DIR}"
python=${PYTHON:-python3}
mkdir -p "$out"
"$python" -c "import sys; from pathlib import Path; from ds2cli.cli.bench.synthetic import synthetic_model; \
print(synthetic_model(Path(sys.argv[1]), 27))" "$out/bench" > "$out/bf16.path"
[ -d "$out/lite27-q8" ] || "$python" -m ds2cli quantize "$(cat "$out/bf16.path")" "$out/lite27-q8" --bits 8
