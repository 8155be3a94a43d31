#!/usr/bin/env bash
# Run a command in a fresh cgroup-v1 memory cgroup held to LIMIT (bytes, or with K/M/G), its limit
# counting the page cache the command causes: a machine with LIMIT of memory. The whole page cache
# is dropped first (DROP_CACHES=0 keeps it: on a machine where others measure, or in a test).
# Prints the cgroup's peak and oom_kill count on stderr after; exits with the command's status.
# Root and the v1 memory controller (/sys/fs/cgroup/memory) only.
#   bench/in_cgroup.sh 8G python bench/step_times.py MODEL ...
set -euo pipefail
limit="${1:?usage: in_cgroup.sh LIMIT COMMAND...}"; shift
root=/sys/fs/cgroup/memory
group="$root/ds2-bench-$$"
mkdir "$group"
trap 'rmdir "$group" 2>/dev/null || true' EXIT
echo "$limit" > "$group/memory.limit_in_bytes"
if [ "${DROP_CACHES:-1}" != 0 ]; then
    sync; echo 3 > /proc/sys/vm/drop_caches
fi
set +e
( echo "$BASHPID" > "$group/cgroup.procs"; exec "$@" )
rc=$?
set -e
oom=$(awk '/^oom_kill /{print $2}' "$group/memory.oom_control" 2>/dev/null || echo "?")
echo "cgroup $limit: peak $(cat "$group/memory.max_usage_in_bytes") bytes, oom_kill $oom" >&2
exit $rc
