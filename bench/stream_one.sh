#!/usr/bin/env bash
# One run of bench/cluster_target.py in a fresh memory cgroup held to LIMIT (bench/in_cgroup.sh:
# the limit counts the page cache, which is dropped first unless DROP_CACHES=0), as on a machine
# with LIMIT of memory: MODEL (from the environment) decoded STEPS greedy steps TARGET's way
# (budget:SIZE streamed within SIZE, local memory-mapped; a local run's memory check is forced
# with DS2_MEMORY_AVAILABLE=100G unless it is set). The figures go to NAME.json, the run's stderr
# and the cgroup's peak and oom kills to NAME.log; the summary line and the cgroup's to stdout.
# Root and the v1 memory controller only.
#   MODEL=DIR bench/stream_one.sh LIMIT TARGET STEPS NAME        (PYTHON: default python3)
set -euo pipefail
limit="${1:?usage: MODEL=DIR stream_one.sh LIMIT TARGET STEPS NAME}"
target="${2:?usage: MODEL=DIR stream_one.sh LIMIT TARGET STEPS NAME}"
steps="${3:?usage: MODEL=DIR stream_one.sh LIMIT TARGET STEPS NAME}"
name="${4:?usage: MODEL=DIR stream_one.sh LIMIT TARGET STEPS NAME}"
model="${MODEL:?MODEL: the checkpoint to run (bench/make_lite.sh makes the 27-layer shape)}"
here="$(cd "$(dirname "$0")" && pwd)"
if [ "$target" = local ]; then
    export DS2_MEMORY_AVAILABLE="${DS2_MEMORY_AVAILABLE:-100G}"
fi
rc=0
"$here/in_cgroup.sh" "$limit" "${PYTHON:-python3}" "$here/cluster_target.py" "$model" "$target" "$steps" \
    "$name.json" 2> "$name.log" || rc=$?
tail -n 1 "$name.log"
exit $rc
