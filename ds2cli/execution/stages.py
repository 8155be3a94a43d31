"""A model's layers on a Ray cluster's nodes (--ray): the passes part that drives the stages, the
stage actors themselves, and a latent cache whose layers live on them.

The driver (the `ds2` process) keeps the tokenizer, sampling, the server and its scheduler; it
holds no weights. Each stage is a Ray actor pinned to its node, which loads its range of layers
(and the embedding or the head) from that node's own disk and composes its own executor
(factory.load): the same compute and experts parts one machine uses. A forward pass is the same
Model.compute on every stage: the pass's description (passes.Pass, with each cache named by a
number) goes to every stage, the hidden state from stage to stage as an object reference (Ray
hands it on between the nodes without a round trip through the driver), and the driver waits
once, for the last stage's logits. Joining the cluster and Ray's errors: cluster/ray_cluster.py.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import threading
import time
import weakref

import numpy as np

from ds2cli.cluster.placement import Placement
from ds2cli.cluster.ray_cluster import LOST_TYPES, ClusterError, causes
from ds2cli.errors import Ds2Error
from ds2cli.execution.passes import Passes
from ds2cli.execution.remote import empty_traffic
from ds2cli.model.cache import LatentCache


class StageActor:
    """A node's range of layers: its weights, loaded from its own disk, its own executor (compute
    on its machine's `threads` cores, its experts part: resident, streamed within
    `memory_budget`, or spread with the other nodes), and its part of every cache (by the
    driver's cache number). Made a Ray actor by RayPasses."""

    def __init__(self, *share):
        """With a share (take's arguments), the stage loads it. Made with none, a spare: its
        process started and ds2 imported, it waits for the share healing moves to its node
        (RayPasses.add_spares: a new actor's start, Ray's worker and its imports, took about
        half a second, on healing's path)."""
        self.model, self.failed = None, None
        self.loaded = threading.Event()     # `ready` answers once the share is loaded (or failed)
        if share:
            self.take(*share)
            if self.failed is not None:     # the actor's start fails with it, as Ray reports
                raise self.failed
        else:
            importlib.import_module("ds2cli.execution.factory")     # what a share loads with, while idle

    def take(self, *share, **named) -> None:
        """Load `share` (load_share's arguments). An error that stops the load is kept for
        `ready` to raise, not raised here: the driver does not wait for this call (Ray would
        print an error nobody fetched on stderr)."""
        try:
            self.load_share(*share, **named)
        except BaseException as e:  # noqa: BLE001 - kept for ready
            self.failed = e
        finally:
            self.loaded.set()

    def load_share(self, load, path: str, first: int, stop: int, quantize, threads: int,
                   experts: tuple | None = None, memory_budget: int | None = None, context: int | None = None,
                   name: str = "") -> None:
        """`load`: factory.load, handed over by the driver (Ray sends a function by its name);
        `memory_budget`: what its routed experts stream within (the placement's, for this node),
        the cache counted at `context` positions; `name`: its node's, for its errors."""
        self.layers, self.name = range(first, stop), name
        # Ray gives a worker asking no CPUs (a stage moved beside another when healing)
        # OMP_NUM_THREADS=1, which BLAS read at import: its count is what cores.Blas restores on
        # a quiet machine, so such a stage ran its BLAS products on one of the node's cores
        from threadpoolctl import threadpool_limits
        threadpool_limits(threads, user_api="blas")
        # spread by experts: its routed experts of every MoE layer too, computed where asked
        own = None if experts is None else range(*experts)
        with self.naming_node():
            self.model = load(path, quantize=quantize, context=context, memory_check=False, layers=self.layers,
                              experts=own, threads=threads, memory_budget=memory_budget,
                              spread_experts=own is not None)
        self.caches: dict[int, LatentCache] = {}
        # a stage before the last keeps, for each cache, the hidden state it handed on at each
        # position (float32, D a position, counted in its memory: weights/memory.required): a
        # lost next stage's layers are rebuilt from it, not from the layers before recomputed
        # (healing.py); `known` is how many leading positions it holds for sure
        self.keeps = len(self.layers) > 0 and self.layers.stop < self.model.config.num_hidden_layers
        self.outputs: dict[int, np.ndarray] = {}
        self.known: dict[int, int] = {}

    def connect(self, peers: list) -> None:
        """Spread by experts: the other stages, [(first expert, stop, actor)], asked for theirs."""
        self.model.executor.experts_part.connect([(range(a, b), actor) for a, b, actor in peers])

    def experts(self, layer: int, ids, rows, where):
        with self.naming_node():
            return self.model.executor.experts_part.answer(layer, self.model.layers[layer].mlp, ids, rows, where)

    @contextlib.contextmanager
    def naming_node(self):
        """A ds2 error here (a failed read of a streamed expert: a truncated file, a bad disk)
        comes to the driver naming this node."""
        try:
            yield
        except Ds2Error as e:
            if not self.name or str(e).startswith("node "):
                raise
            try:
                named = type(e)(f"node {self.name}: {e}")
            except TypeError:                    # an error class that takes more than a message
                named = Ds2Error(f"node {self.name}: {e}")
            raise named from None

    def started(self) -> int:
        return os.getpid()

    def ready(self) -> int:
        """Once its share is loaded: its process id; the error that stopped the load, raised."""
        self.loaded.wait()
        if self.failed is not None:
            raise self.failed
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
        with self.naming_node(), self.model.executor.forward_pass(int(sum(p.lengths))):
            out = self.model.compute(p.with_caches(caches, trace), self.layers, x)
        if self.keeps:
            self.keep(p, out)
        sent = self.model.executor.experts_part.take_traffic()
        return out, (trace, sent)

    def keep(self, p, out: np.ndarray) -> None:
        for (number, capacity), rows, start in zip(p.caches, p.rows, p.starts):
            if number not in self.outputs:
                self.outputs[number] = np.empty((capacity, out.shape[1]), dtype=np.float32)
                self.known[number] = 0
            stop = start + rows.stop - rows.start
            self.outputs[number][start:stop] = out[rows]
            if start <= self.known[number]:
                self.known[number] = max(self.known[number], stop)

    def output(self, number: int, start: int, stop: int) -> np.ndarray | None:
        """The hidden states it handed on at positions [start, stop) of cache `number`, or None
        where it does not hold them all (a cache restored from saved latents, a scratch one)."""
        if stop > self.known.get(number, 0):
            return None
        return self.outputs[number][start:stop].copy()

    def prefix(self, number: int, capacity: int, n: int):
        return self.cache(number, capacity).prefix(n)

    def set_prefix(self, number: int, capacity: int, latent, k_pe) -> None:
        self.cache(number, capacity).set_prefix(latent, k_pe)
        self.known[number] = 0

    def copy_prefix(self, src: tuple, dst: tuple, n: int) -> None:
        self.cache(*dst).copy_prefix(self.cache(*src), n)
        known = min(n, self.known.get(src[0], 0))
        if known:
            if dst[0] not in self.outputs:
                self.outputs[dst[0]] = np.empty((dst[1], self.outputs[src[0]].shape[1]), dtype=np.float32)
            self.outputs[dst[0]][:known] = self.outputs[src[0]][:known]
        self.known[dst[0]] = known

    def repeat(self, number: int, capacity: int, n: int, at: int) -> None:
        self.cache(number, capacity).repeat(n, at)
        self.known[number] = 0

    def drop(self, number: int) -> None:
        self.caches.pop(number, None)
        self.outputs.pop(number, None)
        self.known.pop(number, None)

    def stats(self) -> dict:
        """Its executor's (its experts streamed: hits, bytes read)."""
        return self.model.executor.stats()

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

    def __init__(self, executor: "RayPasses", num_layers: int, capacity: int, kv_lora_rank: int,
                 qk_rope_head_dim: int):
        if capacity < 1:
            super().__init__(num_layers, capacity, kv_lora_rank, qk_rope_head_dim)   # its error
        self.layers, self.capacity, self.length = range(num_layers), capacity, 0
        self.width = kv_lora_rank + qk_rope_head_dim
        self.number = next(executor.numbers)        # the cache's name on the stages
        self.executor = executor
        # the ids its positions hold, as the driver sent them: what a healed cluster rebuilds a
        # lost node's part from (healing.py); None once it holds positions of unknown ids
        self.tokens: np.ndarray | None = np.zeros(capacity, dtype=np.int64)
        executor.caches.add(self)
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
        self.length, self.tokens = n, None        # latents without their ids: not rebuilt by healing

    def copy_prefix(self, src: "ClusterCache", n: int) -> None:
        self.executor.each("copy_prefix", src.ref, self.ref, n)
        self.length = n
        if src.tokens is None:
            self.tokens = None
        else:
            if self.tokens is None:
                self.tokens = np.zeros(self.capacity, dtype=np.int64)
            self.tokens[:n] = src.tokens[:n]

    def repeat(self, n: int, at: int) -> None:
        self.executor.each("repeat", *self.ref, n, at)
        self.tokens = None

    def record(self, start: int, ids: np.ndarray) -> None:
        """A pass sends `ids` to positions from `start` on."""
        if self.tokens is not None:
            self.tokens[start:start + len(ids)] = ids


class StageLost(ClusterError):
    """A stage's process or node is gone, and the cluster can heal (healing.py). `actors`: the
    ids (hex) of the stages Ray said died or cannot be reached, which healing need not ask again."""

    def __init__(self, message: str, actors: frozenset = frozenset()):
        super().__init__(message)
        self.actors = actors


class RayPasses(Passes):
    """The driver's passes part: runs each pass over the stages in order, waits for the last."""

    def __init__(self, ray, placement: Placement, path: str, load, quantize=None, context: int | None = None,
                 heal: bool = True, show=None, replan=None):
        """`load`: what a stage loads its range with and composes its executor (factory.load);
        each stage streams its experts within its budget in the placement (Stage.budget).
        `heal`: a lost node's share (its layers; spread by experts, its experts too) moves to the
        nodes left and the pass goes on (healing.py), else a loss fails every later pass; `show`:
        where healing says so; `replan(nodes, layers[, experts])`: where a lost share goes
        (placement.plan_lost, the load's terms)."""
        self.ray, self.placement, self.path, self.quantize = ray, placement, str(path), quantize
        self.load, self.context, self.heal, self.show, self.replan = load, context, heal, show, replan
        self.numbers = itertools.count()      # the caches' numbers, as the stages know them
        self.stages = []
        self.spares: dict[str, object] = {}   # by node id: a stage actor with no share yet (healing's)
        self.caches: weakref.WeakSet = weakref.WeakSet()     # every live cache, to rebuild after a loss
        self.model = None
        self.epoch = 0                        # how many times the stages were healed
        self.healing: str | None = None       # what is being moved, while it is
        self.healed = {"nodes_lost": 0, "heal_seconds": 0.0, "stages_loaded": 0, "tokens_rebuilt": 0,
                       "states_read": 0,     # positions whose input a stage before had kept
                       "spares_taken": 0}    # moved shares loaded by a node's spare
        self.lost: str | None = None          # why the cluster is degraded, once a node is lost
        # what the passes sent, for bench: actor calls, bytes of hidden states and logits moved
        # between processes (the pass's description aside), seconds the driver waited
        # spread by experts also the stages' calls for experts (remote.py), their bytes
        # of hidden rows and outputs, and the seconds the stages waited for them
        self.traffic = {"passes": 0, "tokens": 0, "calls": 0, "bytes": 0, "seconds": 0.0, **empty_traffic()}

    def start(self, model) -> None:
        """Create a stage on each node of the placement and wait until every one has loaded."""
        self.model = model
        self.stages = [self.new_actor(s) for s in self.placement.stages]
        spares = self.add_spares()          # starting while the stages load
        self.get([a.ready.remote() for a in self.stages])
        self.get(self.connect())
        self.get(spares)

    def add_spares(self) -> list:
        """Healing on: a spare on each node of the placement that has none (a process with Ray
        and ds2 imported: about 0.1 GB of the node's memory). A share healing moves to a node
        loads into its spare: no worker to start on healing's path. Returns the calls that
        answer once they started: the load waits for them (they start while the stages load),
        so they do not start beside its first pass; after healing they start beside the passes."""
        if not self.healable():
            return []
        nodes = {s.node.node_id: s.node for s in self.placement.stages} | {n.node_id: n for n in self.placement.idle}
        started = []
        for node_id, node in nodes.items():
            if node_id not in self.spares:
                self.spares[node_id] = self.actor(node, 0).remote()
                started.append(self.spares[node_id].started.remote())
        return started

    def connect(self) -> list:
        """Spread by experts, every stage told the others' ranges of experts, to ask them for
        theirs (at the start, and after healing moved a lost stage's): the calls' references
        (none by layers)."""
        if self.placement.spread != "experts":
            return []
        peers = [(s.experts.start, s.experts.stop, a) for s, a in zip(self.placement.stages, self.stages)]
        return [a.connect.remote([p for p in peers if p[2] is not a]) for a in self.stages]

    def new_actor(self, s, cpus: int | None = None):
        """The stage actor for placement stage `s`, pinned to its node, asking Ray for `cpus` of
        its CPUs (default: all; a stage moved to a node that runs one already asks none) and
        running its kernels on all of them; its node's spare, where it has one."""
        share = (self.load, self.path, s.layers.start, s.layers.stop, self.quantize, s.node.cpus,
                 (s.experts.start, s.experts.stop) if s.experts is not None else None, s.budget,
                 self.context, s.node.name)
        spare = self.spares.pop(s.node.node_id, None)
        if spare is not None:
            spare.take.remote(*share)
            self.healed["spares_taken"] += 1
            return spare
        return self.actor(s.node, s.node.cpus if cpus is None else cpus).remote(*share)

    def actor(self, node, cpus: int):
        """The stage actor class, pinned to `node`, asking Ray for `cpus` of its CPUs."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        # spread by experts a stage answers other stages' calls for its experts while its own
        # pass waits on theirs: two threads (a pass visits one stage at a time)
        by_experts = self.placement.spread == "experts"
        return self.ray.remote(StageActor).options(
            num_cpus=cpus, max_restarts=0, max_task_retries=0, max_concurrency=2 if by_experts else 1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))

    def stop(self) -> None:
        for a in [*self.stages, *self.spares.values()]:
            try:
                self.ray.kill(a)
            except Exception:       # noqa: BLE001 - already gone with its node
                pass
        self.stages, self.spares = [], {}

    def new_cache(self, model, capacity: int):
        cfg = model.config
        return ClusterCache(self, cfg.num_hidden_layers, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def run_pass(self, model, p):
        return self.start_pass(model, p)()

    def recover(self, lost: "StageLost", epoch: int) -> None:
        """After a pass (begun at `epoch`) lost a stage: heal the cluster, unless a pass that
        failed before already did (its epoch is older than the stages')."""
        from ds2cli.execution.healing import heal
        if epoch == self.epoch:
            heal(self, lost)

    def pipeline_depth(self) -> int:
        """By layers, as many passes as stages may be under way: each stage runs the passes in
        the order they were sent, and a later pass's first stages work while an earlier one is
        on the last. By experts one: a stage answering expert calls is not also computing."""
        return len(self.computing()) if self.placement.spread == "layers" else 1

    def start_pass(self, model, p, tries: int = 3):
        """Every stage's call for pass p sent (each hands its hidden state to the next as an
        object reference); the call returned waits for the logits."""
        wire = p.with_caches([c.ref for c in p.caches], [] if p.trace is not None else None)
        for cache, start, row in zip(p.caches, p.starts, p.rows):
            cache.record(start, p.tokens[row])
        x, infos = None, []
        stages, epoch = self.computing(), self.epoch
        for a in stages:
            x, info = a.compute.options(num_returns=2).remote(wire, x)
            infos.append(info)
        return lambda: self.finish_pass(model, p, stages, infos, x, epoch, tries)

    def finish_pass(self, model, p, stages: list, infos: list, x, epoch: int = 0, tries: int = 3):
        t0 = time.perf_counter()
        try:
            *infos, logits = self.get(infos + [x])
        except StageLost as lost:
            if tries <= 1:
                raise ClusterError(f"lost a node of the cluster again and again: {lost}") from None
            self.recover(lost, epoch)      # the nodes left hold the lost layers: the pass again
            return self.start_pass(model, p, tries - 1)()
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

    def stats(self) -> dict:
        """The stages' streamed experts' counts summed, slots too (every node's slots at once),
        and each streaming node's own under "nodes" ([{"node": its name, counts...}]); empty
        where no stage streams."""
        if not self.stages or self.lost is not None:
            return {}
        every = self.get([a.stats.remote() for a in self.stages])
        parts = [(s.node.name, st) for s, st in zip(self.placement.stages, every) if st]
        if not parts:
            return {}
        total = {k: sum(st[k] for _, st in parts) for k in parts[0][1]}
        return {**total, "nodes": [{"node": name, **st} for name, st in parts]}

    def each(self, method: str, *args, split=None, again: bool = True) -> list:
        """`method` on every stage, all at once; `split`: arrays (L, ...) each stage gets its rows of.
        A stage lost meanwhile: the cluster healed, and the call made again once."""
        try:
            return self.each_once(method, *args, split=split)
        except StageLost as lost:
            if not again:
                raise ClusterError(f"lost a node of the cluster again: {lost}") from None
            self.recover(lost, self.epoch)
            return self.each(method, *args, split=split, again=False)

    def each_once(self, method: str, *args, split=None) -> list:
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
        """None while every stage's node is alive; else what was lost (healing: what is being
        moved, or what the next pass will move)."""
        if self.healing is not None:
            return self.healing
        if self.lost is None and self.stages:
            alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
            gone = [s.node.name for s in self.placement.stages if s.node.node_id not in alive]
            if gone and self.healable():
                return f"node {', '.join(gone)} left the cluster; its share moves to the nodes left at the next pass"
            if gone:
                self.lost = f"node {', '.join(gone)} left the cluster"
        return self.lost

    def healable(self) -> bool:
        return self.heal and self.replan is not None and self.model is not None

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
            # the stage's own error: Ray's RayTaskError(SomeDs2Error) is one too, but its text is a traceback
            ds2 = next((c for c in chain if isinstance(c, Ds2Error) and not isinstance(c, errors.RayError)), None)
            if ds2 is not None and not gone:
                raise type(ds2)(str(ds2)) from None
            dead = self.dead_stages()
            if not gone and not dead:
                raise ClusterError(f"a stage failed: {str(e).strip().splitlines()[-1][:300]}") from None
            if dead is not None and self.healable():
                # the actors a call found dead or unreachable: Ray says "unavailable" for a node
                # gone until the head counts it dead (seconds of missed heartbeats); a stage that
                # cannot be reached moves as well as a dead one
                died = frozenset(c.actor_id for c in chain if isinstance(c, errors.RayActorError) and c.actor_id)
                raise StageLost(self.which_lost(e), died) from None
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
            return "; ".join(f"node {s.node.name} ({s.share}) died" for s in gone)
        return f"a stage's process ended ({type(error).__name__})"
