#!/usr/bin/env bash
# Run a command in a fresh cgroup-v1 memory cgroup held to LIMIT (bytes, or with K/M/G), its limit
# counting the page cache the command causes, the page cache dropped first: a machine with LIMIT
# of memory. Prints the cgroup's peak and oom_kill count on stderr after. Root only.
#   examples/execution/in_cgroup.sh 8G python examples/execution/step_times.py MODEL ...
set -euo pipefail
limit="${1:?usage: in_cgroup.sh LIMIT COMMAND...}"; shift
root=/sys/fs/cgroup/memory
group="$root/ds2-bench-$$"
mkdir "$group"
trap 'rmdir "$group" 2>/dev/null || true' EXIT
echo "$limit" > "$group/memory.limit_in_bytes"
sync; echo 3 > /proc/sys/vm/drop_caches
set +e
( echo "$BASHPID" > "$group/cgroup.procs"; exec "$@" )
rc=$?
set -e
oom=$(awk '/^oom_kill /{print $2}' "$group/memory.oom_control" 2>/dev/null || echo "?")
echo "cgroup $limit: peak $(cat "$group/memory.max_usage_in_bytes") bytes, oom_kill $oom" >&2
exit $rc
