"""A model spread over a Ray cluster by ranges of layers: the driver's executor and the nodes'
stages.

The driver (the `ds2` process) keeps the tokenizer, sampling, the server and its scheduler; it
holds no weights. Each stage is a Ray actor pinned to its node, which loads its range of layers
(and the embedding or the head) from that node's own disk with ds2's loader and keeps its part
of every latent cache. A forward pass is the same Model.compute on every stage: the pass's
description (transformer.Pass, with each cache named by a number) goes to every stage, the
hidden state from stage to stage as an object reference (Ray hands it on between the nodes
without a round trip through the driver), and the driver waits once, for the last stage's logits.

An actor asks Ray for every CPU its node offers (`num_cpus`): Ray sets OMP_NUM_THREADS to that
for the actor, which BLAS reads, and the stage runs ds2's low-bit kernels on as many threads.
A lost node is Ray's to notice: a stage whose process ends fails its call at once, a node that
stops answering is declared dead by the head after `health_check_period_ms` times
`health_check_failure_threshold` (Ray's settings, 3 s x 5 by default; docs/cluster.md), and the
call waiting on it then fails: the request ends with a ClusterError, never a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import sys
import tempfile
import time
import weakref

import numpy as np

import ds2cli
from ds2cli.cluster import experts as spread
from ds2cli.cluster.placement import Node, Placement
from ds2cli.errors import Ds2Error, UnavailableError
from ds2cli.model.cache import LatentCache
from ds2cli.model.executor import Executor
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


def reachable(address: str) -> None:
    """One TCP connection to the head within CONNECT_TIMEOUT_S, so that a wrong address is one
    error at once (ray.init alone retries for a minute and more)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterError(f"cannot reach a Ray cluster at {address}: {e.strerror or e} "
                           f"(start one with `ray start --head`, docs/cluster.md)") from None


def connect(address: str):
    """Join the Ray cluster at `address` as a driver; workers' output stays on their nodes."""
    ray = ray_module()
    address = resolve_address(address)
    reachable(address)
    if not ray.is_initialized():
        import logging
        try:
            with without_ray_logs():
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR,
                         configure_logging=True, namespace="ds2")
        except Exception as e:      # Ray raises ConnectionError, RuntimeError and its own
            raise ClusterError(f"cannot join the Ray cluster at {address}: {str(e).splitlines()[0]} "
                               f"(is it a Ray head's GCS port?)") from None
    return ray


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


def probe(path: str) -> dict:
    """Run on a node: what it offers ds2 and whether it can read the model at `path`."""
    import ray
    from ds2cli.weights import memory, source
    problem = ""
    try:
        source.open_model(path).tensors         # the config and every header, validated
    except Ds2Error as e:
        problem = f"cannot read the model at {path}: {e}"
    except Exception as e:          # noqa: BLE001 - reported, with the node's name, by the driver
        problem = f"cannot read the model at {path}: {type(e).__name__}: {e}"
    return {"node_id": ray.get_runtime_context().get_node_id(), "available": memory.available_bytes(),
            "ds2_version": ds2cli.__version__, "ray_version": ray.__version__,
            "python": "%d.%d" % sys.version_info[:2], "problem": problem}


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
                        info["available"], info["ds2_version"], info["ray_version"], info["python"], info["problem"]))
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


class StageActor:
    """A node's range of layers: its weights, loaded from its own disk, and its part of every
    cache (by the driver's cache number). Made a Ray actor by RayExecutor."""

    def __init__(self, path: str, first: int, stop: int, quantize, threads: int, experts: tuple | None = None):
        from ds2cli.parallel import cores
        from ds2cli.weights.loader import load
        cores.use_workers(cores.Workers(threads))
        self.layers = range(first, stop)
        # spread by experts: its routed experts of every MoE layer too, computed where asked
        own = None if experts is None else range(*experts)
        executor = None if own is None else spread.ExpertsExecutor(own)
        self.model = load(path, quantize=quantize, memory_check=False, layers=self.layers, experts=own,
                          executor=executor)
        self.caches: dict[int, LatentCache] = {}

    def connect(self, peers: list) -> None:
        """Spread by experts: the other stages, [(first expert, stop, actor)], asked for theirs."""
        self.model.executor.connect([(range(a, b), actor) for a, b, actor in peers])

    def experts(self, layer: int, ids, rows, where):
        return spread.compute_experts(self.model, layer, ids, rows, where)

    def ready(self) -> int:
        return os.getpid()

    def cache(self, number: int, capacity: int) -> LatentCache:
        if number not in self.caches:
            cfg = self.model.config
            self.caches[number] = LatentCache(cfg.num_hidden_layers, capacity, cfg.kv_lora_rank,
                                              cfg.qk_rope_head_dim, layers=self.layers)
        return self.caches[number]

    def compute(self, p, x):
        caches = [self.cache(*c) for c in p.caches]
        trace = [] if p.trace is not None else None
        with self.model.executor.forward_pass(int(sum(p.lengths))):
            out = self.model.compute(p.with_caches(caches, trace), self.layers, x)
        sent = self.model.executor.take_traffic() if hasattr(self.model.executor, "take_traffic") else {}
        return out, (trace, sent)

    def prefix(self, number: int, capacity: int, n: int):
        return self.cache(number, capacity).prefix(n)

    def set_prefix(self, number: int, capacity: int, latent, k_pe) -> None:
        self.cache(number, capacity).set_prefix(latent, k_pe)

    def copy_prefix(self, src: tuple, dst: tuple, n: int) -> None:
        self.cache(*dst).copy_prefix(self.cache(*src), n)

    def repeat(self, number: int, capacity: int, n: int, at: int) -> None:
        self.cache(number, capacity).repeat(n, at)

    def drop(self, number: int) -> None:
        self.caches.pop(number, None)

    def memory(self) -> dict:
        """This process's resident and peak resident bytes (Linux)."""
        out = {}
        try:
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith(("VmRSS:", "VmHWM:")):
                        out[line.split(":")[0]] = int(line.split()[1]) * 1024
        except OSError:
            pass
        return out


class ClusterCache(LatentCache):
    """A latent cache whose layers live on the stages: the driver keeps its length and capacity;
    each stage holds its range's slots under this cache's number, made when first used and
    dropped when this object goes."""

    _numbers = itertools.count()

    def __init__(self, executor: "RayExecutor", num_layers: int, capacity: int, kv_lora_rank: int,
                 qk_rope_head_dim: int):
        if capacity < 1:
            super().__init__(num_layers, capacity, kv_lora_rank, qk_rope_head_dim)   # its error
        self.layers, self.capacity, self.length = range(num_layers), capacity, 0
        self.width = kv_lora_rank + qk_rope_head_dim
        self.number = next(self._numbers)
        self.executor = executor
        weakref.finalize(self, executor.drop, self.number)

    @property
    def ref(self) -> tuple[int, int]:
        return self.number, self.capacity

    @property
    def bytes_per_token(self) -> int:
        return len(self.layers) * self.width * 4

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_token

    def layer(self, i: int):
        raise Ds2Error("a cluster's cache lives on its nodes: only a stage reads its layers")

    def prefix(self, n: int):
        parts = self.executor.each("prefix", *self.ref, n)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def set_prefix(self, latent: np.ndarray, k_pe: np.ndarray) -> None:
        n = latent.shape[1]
        if n > self.capacity:
            super().set_prefix(latent, k_pe)      # its error
        self.executor.each("set_prefix", *self.ref, split=(latent, k_pe))
        self.length = n

    def copy_prefix(self, src: "ClusterCache", n: int) -> None:
        self.executor.each("copy_prefix", src.ref, self.ref, n)
        self.length = n

    def repeat(self, n: int, at: int) -> None:
        self.executor.each("repeat", *self.ref, n, at)


class RayExecutor(Executor):
    """The driver's side: runs each pass over the stages in order, waits for the last."""

    def __init__(self, ray, placement: Placement, path: str, quantize=None):
        self.ray, self.placement, self.path, self.quantize = ray, placement, str(path), quantize
        self.stages = []
        self.lost: str | None = None          # why the cluster is degraded, once a node is lost
        # what the passes sent, for bench: actor calls, bytes of hidden states and logits moved
        # between processes (the pass's description aside), seconds the driver waited
        # spread by experts also the stages' calls for experts (cluster/experts.py), their bytes
        # of hidden rows and outputs, and the seconds the stages waited for them
        self.traffic = {"passes": 0, "tokens": 0, "calls": 0, "bytes": 0, "seconds": 0.0, **spread.empty_traffic()}

    def start(self, model) -> None:
        """Create a stage on each node of the placement and wait until every one has loaded."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        actor = self.ray.remote(StageActor)
        by_experts = self.placement.spread == "experts"
        for s in self.placement.stages:
            # spread by experts a stage answers other stages' calls for its experts while its own
            # pass waits on theirs: two threads (a pass visits one stage at a time)
            self.stages.append(actor.options(
                num_cpus=s.node.cpus, max_restarts=0, max_task_retries=0, max_concurrency=2 if by_experts else 1,
                scheduling_strategy=NodeAffinitySchedulingStrategy(s.node.node_id, soft=False),
            ).remote(self.path, s.layers.start, s.layers.stop, self.quantize, s.node.cpus,
                     (s.experts.start, s.experts.stop) if s.experts is not None else None))
        self.get([a.ready.remote() for a in self.stages])
        if by_experts:
            peers = [(s.experts.start, s.experts.stop, a) for s, a in zip(self.placement.stages, self.stages)]
            self.get([a.connect.remote([p for p in peers if p[2] is not a]) for a in self.stages])

    def stop(self) -> None:
        for a in self.stages:
            try:
                self.ray.kill(a)
            except Exception:       # noqa: BLE001 - already gone with its node
                pass
        self.stages = []

    def new_cache(self, model, capacity: int):
        cfg = model.config
        return ClusterCache(self, cfg.num_hidden_layers, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def run_pass(self, model, p):
        return self.start_pass(model, p)()

    def pipeline_depth(self) -> int:
        """By layers, as many passes as stages may be under way: each stage runs the passes in
        the order they were sent, and a later pass's first stages work while an earlier one is
        on the last. By experts one: a stage answering expert calls is not also computing."""
        return len(self.computing()) if self.placement.spread == "layers" else 1

    def start_pass(self, model, p):
        """Every stage's call for pass p sent (each hands its hidden state to the next as an
        object reference); the call returned waits for the logits."""
        wire = p.with_caches([c.ref for c in p.caches], [] if p.trace is not None else None)
        x, infos = None, []
        stages = self.computing()
        for a in stages:
            x, info = a.compute.options(num_returns=2).remote(wire, x)
            infos.append(info)
        return lambda: self.finish_pass(model, p, stages, infos, x)

    def finish_pass(self, model, p, stages: list, infos: list, x):
        t0 = time.perf_counter()
        *infos, logits = self.get(infos + [x])
        n, D = int(sum(p.lengths)), model.config.hidden_size
        t = self.traffic
        t["passes"], t["tokens"], t["calls"] = t["passes"] + 1, t["tokens"] + n, t["calls"] + len(stages)
        t["bytes"] += (len(stages) - 1) * n * D * 4 + (0 if logits is None else logits.nbytes)
        t["seconds"] += time.perf_counter() - t0
        for _, sent in infos:
            for k, v in sent.items():
                t[k] += v
        if p.trace is not None:
            for trace, _ in infos:
                p.trace.extend(trace)
        return logits

    def computing(self) -> list:
        """The stages a pass visits, in order: those holding layers (spread by experts, a node
        may hold experts alone)."""
        return [a for s, a in zip(self.placement.stages, self.stages) if len(s.layers)]

    def each(self, method: str, *args, split=None) -> list:
        """`method` on every stage, all at once; `split`: arrays (L, ...) each stage gets its rows of."""
        refs = []
        for s, a in zip(self.placement.stages, self.stages):
            if not len(s.layers):
                continue        # experts alone: no part of any cache
            part = () if split is None else tuple(arr[s.layers.start:s.layers.stop] for arr in split)
            refs.append(getattr(a, method).remote(*args, *part))
        return self.get(refs)

    def drop(self, number: int) -> None:
        if self.lost is None and self.ray.is_initialized():
            for a in self.stages:
                try:
                    a.drop.remote(number)
                except Exception:   # noqa: BLE001 - a lost stage's caches went with it
                    pass

    def health(self) -> str | None:
        """None while every stage's node is alive; else what was lost."""
        if self.lost is None and self.stages:
            alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
            gone = [s.node.name for s in self.placement.stages if s.node.node_id not in alive]
            if gone:
                self.lost = f"node {', '.join(gone)} left the cluster"
        return self.lost

    def get(self, refs):
        """ray.get, with a lost node or stage as one ClusterError naming it; a ds2 error a stage
        raised (a bug's, or a full context's) as itself."""
        if self.lost is not None:
            raise ClusterError(f"the cluster is degraded: {self.lost}")
        try:
            return self.ray.get(refs)
        except Exception as e:      # noqa: BLE001 - Ray's errors, classified below
            errors = self.ray.exceptions
            if not isinstance(e, errors.RayError):
                raise
            chain = list(causes(e))
            gone = any(isinstance(c, LOST_TYPES(errors)) for c in chain) or "could not be computed" in str(e)
            ds2 = next((c for c in chain if isinstance(c, Ds2Error)), None)
            if ds2 is not None and not gone:
                raise type(ds2)(str(ds2)) from None
            if not gone and not self.dead_stages():
                raise ClusterError(f"a stage failed: {str(e).strip().splitlines()[-1][:300]}") from None
            self.lost = self.which_lost(e)
            raise ClusterError(f"lost a node of the cluster: {self.lost}") from None

    def dead_stages(self) -> list | None:
        """The stages whose node the head no longer counts alive (None: the head does not answer)."""
        try:
            alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
        except Exception:           # noqa: BLE001 - the head itself is gone
            return None
        return [s for s in self.placement.stages if s.node.node_id not in alive]

    def which_lost(self, error) -> str:
        gone = self.dead_stages()
        if gone is None:
            return "the cluster's head does not answer"
        if gone:
            return "; ".join(f"node {s.node.name} (layers {s.layers.start}-{s.layers.stop - 1}) died" for s in gone)
        return f"a stage's process ended ({type(error).__name__})"
