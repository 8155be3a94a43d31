"""Joining a Ray cluster and probing its nodes: the address checked, each node's memory, ds2 and
Ray versions and the checkpoint at the path, and Ray's errors classified. The stages that run
on the nodes, and the passes part that drives them, are execution's (execution/stages.py).

An actor asks Ray for every CPU its node offers (`num_cpus`): Ray sets OMP_NUM_THREADS to that
for the actor, which BLAS reads, and the stage runs ds2's low-bit kernels on as many threads.
A lost node is Ray's to notice: a stage whose process ends fails its call at once, a node that
stops answering is declared dead by the head after `health_check_period_ms` times
`health_check_failure_threshold` (Ray's settings, 3 s x 5 by default; docs/cluster.md), and the
call waiting on it then fails: the request ends with a ClusterError, never a hang.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import ds2cli
from ds2cli.cluster.placement import Node
from ds2cli.errors import Ds2Error, UnavailableError
from ds2cli.wording import install_hint

CONNECT_TIMEOUT_S = 10         # an address that does not answer within this is an error
PROBE_TIMEOUT_S = 60           # a node's probe (a short task there) must answer within this


class ClusterError(UnavailableError):
    """The cluster cannot be reached, or a node was lost."""


def ray_module():
    """Ray, or one line on how to get it (it is the optional `ray` extra)."""
    # Ray's core logs warnings to stderr (no route to find its own address by, retries while it
    # connects); errors stay. Read when Ray is first imported.
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
    # a stage's failure is ds2's to report, once: not again by Ray for each reference it orphaned
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    # a head that answers TCP but not as Ray's GCS: an error after about this many tries, a second each
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(CONNECT_TIMEOUT_S))
    try:
        import ray
    except ImportError:
        raise Ds2Error(f"--ray needs Ray: {install_hint('ray', 'ray')}") from None
    return ray


def resolve_address(address: str) -> str:
    """`auto`: RAY_ADDRESS; an address as HOST:PORT (the head's GCS port, 6379 unless changed)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address:
            raise ClusterError("--ray auto reads RAY_ADDRESS, which is not set; give the head's HOST:PORT")
    address = address.removeprefix("ray://") if address.startswith("ray://") else address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"--ray takes the head's HOST:PORT (as `ray start --head` prints it), got {address!r}")
    return address


def reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """The head answers at `address` as a Ray GCS within `timeout` seconds, connection included,
    so that a wrong address is one error at once: ray.init alone retries for a minute and more,
    and against a port that accepts but is no GCS (a silent listener, another service) it waits
    with no end. A GCS is a gRPC server: to HTTP/2's client preface it answers with a SETTINGS
    frame (RFC 9113, 3.4), which a silent listener or another protocol's server does not. With RAY_USE_TLS the GCS speaks TLS first, so
    only the connection is checked; ray.init's own wait then bounds the rest."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as e:
        raise ClusterError(f"cannot reach a Ray cluster at {address}: {e.strerror or e} "
                           f"(start one with `ray start --head`, docs/cluster.md)") from None
    with s:
        if os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true"):
            return
        head = b""
        try:
            s.sendall(H2_PREFACE)
            while len(head) < 9:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                more = s.recv(9 - len(head))
                if not more:
                    break
                head += more
        except socket.timeout:
            raise ClusterError(f"{address} accepted a connection but did not answer as a Ray GCS within "
                               f"{timeout:g} s ({NOT_GCS})") from None
        except OSError:         # reset: it hung up on the preface
            pass
    if not is_settings_frame(head):
        what = "answered, but not" if head else "closed the connection without answering"
        raise ClusterError(f"{address} {what} as a Ray GCS (gRPC over HTTP/2) ({NOT_GCS})")


NOT_GCS = "is it the head's GCS port, as `ray start --head` prints it?"
# HTTP/2's client connection preface: the fixed string, then an empty SETTINGS frame
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def is_settings_frame(head: bytes) -> bool:
    """A frame header (length 3 bytes, type, flags, stream id 4 bytes) of a SETTINGS frame
    (type 4) on stream 0 that is no acknowledgement: how an HTTP/2 server's preface begins."""
    return len(head) == 9 and head[3] == 4 and not head[4] & 1 and head[5:9] == bytes(4)


def connect_timeout() -> float:
    """CONNECT_TIMEOUT_S, or RAY_gcs_server_port_wait_time_s when set (Ray's own wait for the GCS)."""
    try:
        return max(0.1, float(os.environ.get("RAY_gcs_server_port_wait_time_s", CONNECT_TIMEOUT_S)))
    except ValueError:
        return CONNECT_TIMEOUT_S


def connect(address: str):
    """Join the Ray cluster at `address` as a driver; workers' output stays on their nodes."""
    ray = ray_module()
    address = resolve_address(address)
    reachable(address, connect_timeout())
    if not ray.is_initialized():
        import logging
        try:
            with without_ray_logs(), keeping_signals():
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR,
                         configure_logging=True, namespace="ds2")
        except Exception as e:      # Ray raises ConnectionError, RuntimeError and its own
            raise ClusterError(f"cannot join the Ray cluster at {address}: {str(e).splitlines()[0]} "
                               f"(is it a Ray head's GCS port?)") from None
        errors_to_stderr()
    return ray


def errors_to_stderr() -> None:
    """Ray's driver prints the cluster's error events (a node marked dead, a worker killed for
    memory) to stdout from a thread of its own, whatever log_to_driver says: they go to stderr,
    so that stdout holds only the generated text. (Ray 2.x: the thread calls the module's
    print_to_stdstream by name; where that is not so, nothing changes.)"""
    try:
        from ray._private import worker
    except ImportError:
        return
    shown = getattr(worker, "print_to_stdstream", None)
    if shown is None or getattr(shown, "ds2_stderr", False):
        return

    def to_stderr(data, ignore_prefix):
        shown({**data, "is_err": True}, ignore_prefix)
    to_stderr.ds2_stderr = True
    worker.print_to_stdstream = to_stderr


KEPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def keeping_signals():
    """The driver's signals as they were before ray.init: Ray sets a SIGTERM handler that exits
    15, its core installs absl's failure handler (a native stack dump on stderr, then the
    previous handler) and enables faulthandler. After the block SIGTERM, SIGINT and SIGHUP are
    the command's again (signal.signal replaces absl's handler too): a kill ends a --ray driver
    as it ends one without Ray (128 + the signal, a chat's session saved first), in silence.
    faulthandler is left as it was: a driver's exit while Ray's threads stop dumps nothing."""
    import faulthandler
    import threading
    if threading.current_thread() is not threading.main_thread():      # signals are the main thread's
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in KEPT_SIGNALS}
    dumping = faulthandler.is_enabled()
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None:          # None: set outside Python, which cannot be put back
                signal.signal(sig, handler)
        if not dumping:
            faulthandler.disable()


RAY_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [DIWE] \d+ \d+\] ")


@contextlib.contextmanager
def without_ray_logs():
    """Ray's core writes its own log lines to the file descriptor of stderr while it connects
    (retries, how it found its address); they are held back, and any other line passes."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read(1 << 20).decode("utf-8", "replace").splitlines(keepends=True):
                if not RAY_LOG_LINE.match(line):
                    sys.stderr.write(line)


def checkpoint_fingerprint(path) -> str:
    """What the driver and every node compare of the checkpoint at `path`: weights/fingerprint.py's
    digest of its config and tokenizer files, its index (with the per-tensor checksums `ds2
    quantize` records there), and every shard's name, size and header; not the weights' bytes,
    which `ds2 inspect --verify` checks on a node against those checksums."""
    from ds2cli.weights import fingerprint
    return fingerprint.fingerprint(Path(path), None)


def probe(path: str) -> dict:
    """Run on a node: what it offers ds2, whether it can read the model at `path`, and that
    model's fingerprint (checkpoint_fingerprint)."""
    import ray
    from ds2cli.weights import memory, source
    problem, print_ = "", ""
    try:
        source.open_model(path).tensors         # the config and every header, validated
        print_ = checkpoint_fingerprint(path)
    except Ds2Error as e:
        problem = f"cannot read the model at {path}: {e}"
    except Exception as e:          # noqa: BLE001 - reported, with the node's name, by the driver
        problem = f"cannot read the model at {path}: {type(e).__name__}: {e}"
    return {"node_id": ray.get_runtime_context().get_node_id(), "available": memory.available_bytes(),
            "ds2_version": ds2cli.__version__, "ray_version": ray.__version__,
            "python": "%d.%d" % sys.version_info[:2], "problem": problem, "fingerprint": print_}


def nodes(ray, path: str) -> list[Node]:
    """Every alive node with CPUs, probed in parallel (a task pinned to each, asking no CPU)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    alive = sorted((n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1),
                   key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    task = ray.remote(probe)
    refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                         max_retries=0).remote(str(path)) for n in alive]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    out = []
    for n, ref in zip(alive, refs):
        name = f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})"
        if ref not in ready:
            raise ClusterError(f"node {name} did not answer within {PROBE_TIMEOUT_S} s")
        try:
            info = ray.get(ref)
        except Exception as e:      # noqa: BLE001 - a node without ds2 installed fails to unpickle it
            raise ClusterError(f"node {name} cannot run ds2: {str(e).splitlines()[-1][:300]}") from None
        out.append(Node(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"]["CPU"]),
                        info["available"], info["ds2_version"], info["ray_version"], info["python"], info["problem"],
                        info.get("fingerprint", "")))
    return out


def causes(e: BaseException):
    """e and what it wraps: a stage's RayTaskError carries the error of the stage before it."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = getattr(e, "cause", None) if isinstance(getattr(e, "cause", None), BaseException) else e.__cause__


def LOST_TYPES(errors) -> tuple:
    """Ray's errors that say a stage's process or node is gone."""
    return tuple(getattr(errors, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                                              "NodeDiedError", "ObjectLostError", "OwnerDiedError",
                                              "WorkerCrashedError") if hasattr(errors, n))
