"""A real Ray cluster on this machine, inside a private network namespace, for the cluster tests (tests/cluster).

The namespace is held by one `unshare -n sleep` process; its loopback is brought up, and every
node (`ray start`), driver (`ds2 ... --ray`) and client runs in it through `nsenter`, so nothing
leaves 127.0.0.1 (outside a namespace, Ray binds the machine's own address). The head and one
worker start once a session (two nodes); a test adds nodes of its own (a third for parity over
three, one to kill, one that cannot see the checkpoint) and removes them. Each node offers
NODE_MEMORY to ds2 (DS2_MEMORY_AVAILABLE in its environment, which its probe reads) and 1 CPU.
Needs root (unshare, nsenter, mount) and Ray: skipped without them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PORT = 6399
ADDRESS = f"127.0.0.1:{PORT}"
NODE_MEMORY = "2G"
BIN = Path(sys.executable).parent
CALL_TIMEOUT = 180          # no command a test runs in the namespace may take longer

LO_UP = """
import fcntl, socket, struct
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))[:18])[1]
fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
"""


def usable() -> str | None:
    """Why the cluster tests (tests/cluster) cannot run here, or None."""
    if os.geteuid() != 0:
        return "a private network namespace needs root (CI runs as root)"
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return "unshare and nsenter (util-linux) are needed"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install '.[test]')"
    return None


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.keeper = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
        self.prefix = ["nsenter", "-t", str(self.keeper.pid), "-n"]
        self.nodes: list[subprocess.Popen] = []      # the tests' own nodes
        self.own: list[subprocess.Popen] = []        # the session's head and worker
        self.env = {**os.environ, "DS2_MEMORY_AVAILABLE": NODE_MEMORY, "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_gcs_server_port_wait_time_s": "3",
                    "PYTHONUNBUFFERED": "1"}
        time.sleep(0.2)
        self.run([sys.executable, "-c", LO_UP], check=True)

    def run(self, args: list[str], check: bool = False, env: dict | None = None, timeout: float = CALL_TIMEOUT,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.prefix + args, capture_output=True, text=True, timeout=timeout,
                              check=check, env=env or self.env, **kw)

    def popen(self, args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.prefix + args, env=env or self.env, start_new_session=True, **kw)

    def ds2(self, *args: str, env: dict | None = None, timeout: float = CALL_TIMEOUT, **kw) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-m", "ds2cli", *args], env=env, timeout=timeout, **kw)

    def start_head(self, cpus: int = 1) -> None:
        """The head node; `cpus` 0: a head that holds no stage (bench/cluster_streams.py)."""
        # a node that stops answering is declared dead after 1 s x 3 here (Ray's default is
        # 3 s x 5): the tests that kill a node wait for that before the next test places layers
        head_env = {**self.env, "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                    "RAY_health_check_timeout_ms": "1000"}
        self.own.append(self.popen([str(BIN / "ray"), "start", "--head", "--port", str(PORT), "--num-cpus", str(cpus),
                                    "--include-dashboard=false", "--disable-usage-stats", "--block",
                                    "--temp-dir", str(self.tmp / "ray")], env=head_env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        started(self.own[0])        # it says so once its GCS answers (no driver started to ask)

    def add_node(self, hide: Path | None = None, memory: str | None = NODE_MEMORY, cgroup: str | None = None,
                 extra: tuple[str, ...] = (), cpus: int = 1) -> subprocess.Popen:
        """A worker node (`ray start --block` in a process group of its own, so a test can kill
        it whole). `hide`: a directory this node cannot see (an empty one mounted over it, in
        a mount namespace of the node's own): a node without the checkpoint. `memory`: what it
        offers ds2 (DS2_MEMORY_AVAILABLE; None: what its memory cgroup or machine has);
        `cgroup`: a v1 memory cgroup's directory it runs in, with every process it starts;
        `extra`: more `ray start` options; `cpus`: the CPUs it offers."""
        cmd = [str(BIN / "ray"), "start", "--address", ADDRESS, "--num-cpus", str(cpus), "--block", "--disable-usage-stats",
               *extra]
        if cgroup is not None:
            cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
        if hide is not None:
            empty = self.tmp / f"empty-{len(self.nodes)}"
            empty.mkdir()
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   f"mount --bind {empty} {hide} && exec \"$@\"", "sh", *cmd]
        env = {k: v for k, v in self.env.items() if k != "DS2_MEMORY_AVAILABLE"}
        node = self.popen(cmd, env={**env, **({"DS2_MEMORY_AVAILABLE": memory} if memory else {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.nodes.append(node)
        started(node)
        return node

    def kill(self, node: subprocess.Popen) -> None:
        """The node dies at once, as a machine that lost power: its `ray start`, raylet and
        workers, SIGKILL. The workers (a stage's actor among them) run in process groups of their
        own, so every descendant is killed too: left alive, a stage answers calls until the
        head counts its node dead."""
        doomed = descendants(node.pid)
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.wait(timeout=30)

    def remove(self, node: subprocess.Popen) -> None:
        before = self.running()
        self.kill(node)
        self.nodes.remove(node)
        self.wait_for(before - 1)

    def running(self) -> int:
        """The nodes whose `ray start` still runs: what the head counts alive once it has seen
        every loss (asking the head costs a driver's start, a second or two)."""
        return sum(1 for node in self.own + self.nodes if node.poll() is None)

    def count(self) -> int:
        out = self.run([sys.executable, "-c", COUNT, ADDRESS], check=True).stdout
        return int(next(line for line in out.splitlines() if line.startswith("alive ")).split()[1])

    def wait_for(self, n: int, within: float = 60) -> None:
        """Until the head counts `n` alive nodes: one driver that joins once and asks every
        0.2 s (a driver a question took a second or two of starting Python and Ray each)."""
        r = self.run([sys.executable, "-c", WAIT, ADDRESS, str(n), str(within)], timeout=within + 60)
        if r.returncode != 0:
            raise RuntimeError(f"the cluster did not reach {n} alive nodes in {within} s: {r.stderr[-500:]}")

    def stop(self) -> None:
        """Every process of this cluster, by its process group (never `ray stop`, which ends
        every Ray process of the machine)."""
        for node in self.nodes + self.own[::-1]:
            self.kill(node)
        self.keeper.kill()
        self.keeper.wait()


def started(node: subprocess.Popen, within: float = 60) -> None:
    """Until a worker node's `ray start` says it started: it says so once the head has
    registered its raylet (Ray waits for that before printing), so the head counts it alive
    without a driver started to ask (a second or two each). Its later output is read and
    dropped, so that it never blocks on a full pipe."""
    seen, said = threading.Event(), []

    def read() -> None:
        for line in node.stdout:
            if b"Ray runtime started" in line:
                said.append(line)
                seen.set()
        seen.set()          # its output ended: it did not start, or has stopped

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(within) or not said:
        raise RuntimeError(f"a Ray node did not start within {within} s (exit {node.poll()})")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


WAIT = """
import logging, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)
deadline = time.monotonic() + float(sys.argv[3])
while sum(1 for n in ray.nodes() if n["Alive"]) != int(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.2)
"""

COUNT = """
import logging, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)   # exits 1 until the head is up
print("alive", sum(1 for n in ray.nodes() if n["Alive"]))   # Ray may print its own lines too
"""


