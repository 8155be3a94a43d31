#!/usr/bin/env bash
# Source trees side by side with no memory limit and no budget (docs/performance.md, "Unlimited"):
# each round runs bench/step_times.py in every TREE in turn, as separate processes importing ds2
# from that tree (PYTHONPATH), the order rotating from round to round; each run is MODEL's decode
# step after CONTEXT tokens (default 128), the median of STEPS steps (default 15), no prefill or
# pass figure. Prints each run's step, then each tree's steps over the rounds. Trees are
# checkouts of ds2 (`git worktree add ../at-0dcf156 0dcf156`, ...); MODEL: the model the figures
# are of (bench/make_lite.sh makes the 27-layer shape's 8-bit copy).
#   bench/unlimited_ab.sh ROUNDS MODEL TREE...          (PYTHON: the interpreter, default python3)
set -euo pipefail
rounds="${1:?usage: unlimited_ab.sh ROUNDS MODEL TREE...}"
model="${2:?usage: unlimited_ab.sh ROUNDS MODEL TREE...}"
shift 2
trees=("$@")
[ ${#trees[@]} -ge 1 ] || { echo "usage: unlimited_ab.sh ROUNDS MODEL TREE..." >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
declare -A steps_of
for round in $(seq 1 "$rounds"); do
    for k in $(seq 0 $((${#trees[@]} - 1))); do
        tree="${trees[$(((k + round - 1) % ${#trees[@]}))]}"
        json=$(PYTHONPATH="$(cd "$tree" && pwd)" "${PYTHON:-python3}" "$here/step_times.py" "$model" \
               --context "${CONTEXT:-128}" --steps "${STEPS:-15}" --prefill 0 --pass-tokens 0 | tail -n 1)
        step=$("${PYTHON:-python3}" -c 'import json, sys; print(format(json.loads(sys.argv[1])["decode_step_s"], ".4f"))' "$json")
        echo "round $round, $tree: decode step $step s"
        steps_of[$tree]="${steps_of[$tree]:-} $step"
    done
done
for tree in "${trees[@]}"; do
    echo "$tree:${steps_of[$tree]}"
done
