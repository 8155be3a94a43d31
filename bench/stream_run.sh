#!/usr/bin/env bash
# Streamed against memory-mapped under memory limits (docs/performance.md, "Bigger than memory"):
# for each LIMIT:BUDGET of LIMITS (default "8G:7G 6G:5G"), one run streamed within BUDGET
# (`--memory-budget`) and one memory-mapped, each in a fresh cgroup held to LIMIT with the page
# cache dropped first (bench/stream_one.sh), STEPS greedy decode steps each, the two alternating
# which goes first from round to round; then each run's step median and, per round, memory-mapped
# over streamed. Every run's figures stay in OUT_DIR (rROUND-LIMIT-streamed.json, ...). Root and
# the v1 memory controller only.
#   bench/stream_run.sh MODEL OUT_DIR [ROUNDS=1] [STEPS=12]            (PYTHON: default python3)
set -euo pipefail
model="${1:?usage: stream_run.sh MODEL OUT_DIR [ROUNDS] [STEPS]}"
out="${2:?usage: stream_run.sh MODEL OUT_DIR [ROUNDS] [STEPS]}"
rounds="${3:-1}"
steps="${4:-12}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for pair in ${LIMITS:-8G:7G 6G:5G}; do
        limit="${pair%%:*}"; budget="${pair#*:}"
        runs=("streamed budget:$budget" "mapped local")
        if [ $((round % 2)) = 0 ]; then runs=("${runs[1]}" "${runs[0]}"); fi
        for run in "${runs[@]}"; do
            how="${run%% *}"; target="${run#* }"
            echo "round $round, $limit, $how:"
            MODEL="$model" "$here/stream_one.sh" "$limit" "$target" "$steps" "$out/r$round-$limit-$how"
        done
    done
done
"${PYTHON:-python3}" - "$out" "$rounds" <<'PY'
import json, sys
from pathlib import Path
runs = {}
for p in sorted(Path(sys.argv[1]).glob("r*-*-*.json")):
    round_, limit, how = p.stem.split("-", 2)
    if int(round_[1:]) > int(sys.argv[2]):
        continue                    # an earlier, longer series' in the same folder
    runs.setdefault(limit, {}).setdefault(how, {})[int(round_[1:])] = json.loads(p.read_text())
for limit, hows in runs.items():
    ids = {tuple(r["ids"]) for by_round in hows.values() for r in by_round.values()}
    print(f"held to {limit}: step median (s) by round; "
          + ("every run gave the same ids" if len(ids) == 1 else "the runs' ids differ"))
    for how, by_round in hows.items():
        print(f"  {how:>8}: " + " ".join(f"{r['step_median_s']:.3f}" for _, r in sorted(by_round.items())))
    if {"streamed", "mapped"} <= set(hows):
        both = sorted(set(hows["streamed"]) & set(hows["mapped"]))
        print("  mapped / streamed: " + " ".join(
            f"{hows['mapped'][k]['step_median_s'] / hows['streamed'][k]['step_median_s']:.2f}x" for k in both))
PY
