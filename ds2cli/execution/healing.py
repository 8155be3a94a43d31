"""A cluster that heals: a stage whose process or node is lost mid-run has its share (its layers;
spread by experts, its range of every MoE layer's routed experts too) moved to the nodes left,
its part of every live cache rebuilt, and the pass that failed runs again, so a reply goes on
where it was.

When a pass finds a stage gone (stages.RayPasses.get raises StageLost), the driver asks every
stage whether it still answers, plans the lost stages' shares onto the nodes left with what each
has left of what it offered (cluster/placement.plan_lost: by layers as plan_range shares layers
out, by experts the lost layers and experts whole on the node with the most room, else shared out
as plan_experts does; whole where they fit, their routed experts streamed where not and the
checkpoint allows it), loads them there (a node that runs a stage already runs the moved one
beside it, asking Ray for no more CPUs), and prints the new placement. Spread by experts, every
stage is then told its peers again, so the survivors ask the new stages for the moved experts.
Then each live cache's lost layers are rebuilt from the ids the driver sent to it
(ClusterCache.tokens), in chunks: their input is the hidden state the stage before them kept
for each position (StageActor.keep; asked for while the moved layers load); where it is not
held, the layers before them run those ids again into a scratch cache, only to hand the moved
layers their input (by experts, asking every node for its experts as a pass does); the moved
layers write the cache itself; the layers after them are untouched (a
stage that held experts alone leaves no cache to rebuild). What cannot heal is one ClusterError,
as without healing: the head gone, the lost share fitting nowhere, a cache restored from saved
latents (its ids unknown).
"""

from __future__ import annotations

import dataclasses
import time

from ds2cli.cluster.placement import Placement, PlacementError
from ds2cli.cluster.ray_cluster import ClusterError, causes
from ds2cli.errors import Ds2Error
from ds2cli.model.passes import Pass

ANSWER_S = 30            # a stage that does not answer within this is lost


def heal(passes, lost) -> None:
    """Move the shares of `passes`' lost stages (RayPasses) to the nodes left and rebuild their caches."""
    t0 = time.perf_counter()
    passes.healing = f"{lost}: moving its share to the nodes left"
    try:
        gone = lost_stages(passes, getattr(lost, "actors", frozenset()))
        if not gone:            # every stage answers: the failed pass only needs running again
            passes.epoch += 1
            return
        old = passes.placement
        names = ", ".join(f"{old.stages[i].node.name} ({old.stages[i].share})" for i in gone)
        for i in gone:
            for actor in (passes.stages[i], passes.spares.pop(old.stages[i].node.node_id, None)):
                try:
                    if actor is not None:
                        passes.ray.kill(actor)
                except Exception:   # noqa: BLE001 - gone with its node
                    pass
        t1 = time.perf_counter()
        early = Inputs(passes, old.stages[gone[0]].layers) if len(gone) == 1 else None
        try:
            moved = replace_stages(passes, gone)
            passes.epoch += 1
            t2 = time.perf_counter()
            tokens, caches = rebuild(passes, [layers for layers, _ in moved], early)
        finally:
            if early is not None:
                early.drop()
        t3 = time.perf_counter()
        seconds = t3 - t0
        passes.add_spares()     # for the next loss: the nodes whose spare took a share
        passes.healed["nodes_lost"] += len(gone)
        passes.healed["heal_seconds"] += seconds
        passes.healed["stages_loaded"] += sum(len(m) for _, m in moved)
        passes.healed["tokens_rebuilt"] += tokens
        if passes.show is not None:
            passes.show(healed_line(names, old.spread, tokens, caches, seconds, t2 - t1, t3 - t2))
            for line in passes.placement.lines(passes.model.config.num_hidden_layers):
                passes.show("  " + line)
    except PlacementError as e:
        passes.lost = f"{lost}; its layers fit on no node left ({e})"
        raise ClusterError(f"lost a node of the cluster: {passes.lost}") from None
    except ClusterError as e:
        passes.lost = passes.lost or str(e)
        raise
    finally:
        passes.healing = None


def healed_line(names: str, spread: str, tokens: int, caches: str, seconds: float, loading: float,
                rebuilding: float) -> str:
    """The stderr line that says a heal is done, with its two parts' seconds: the moved shares
    planned and loaded, the caches rebuilt (bench/cluster_heal.py reads it)."""
    what = "its layers" if spread == "layers" else "its layers and experts"
    rebuilt = f" and {tokens} cached positions of {caches} rebuilt" if tokens else ""
    return (f"lost {names}: {what} moved to the nodes left{rebuilt} in {seconds:.1f} s ({loading:.1f} s loading, "
            f"{rebuilding:.1f} s rebuilding); the placement now:")


def lost_stages(passes, died: frozenset = frozenset()) -> list[int]:
    """The indices of the stages that do not answer (their process or node gone). Those a call
    already found dead or unreachable (`died`, their actors' ids) are not asked again: a dead
    node's actor answers a new call only once the head counts the node dead (missed heartbeats:
    2 s on the tests' cluster, 15 s by Ray's defaults)."""
    ray = passes.ray
    known = [i for i, a in enumerate(passes.stages) if actor_id(a) in died]
    asked = [i for i in range(len(passes.stages)) if i not in known]
    refs = [passes.stages[i].ready.remote() for i in asked]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ANSWER_S) if refs else ([], [])
    out = known
    for i, ref in zip(asked, refs):
        if ref not in ready:
            out.append(i)
            continue
        try:
            ray.get(ref)
        except Exception:           # noqa: BLE001 - its actor or node died
            out.append(i)
    return sorted(out)


def actor_id(actor) -> str | None:
    """An actor handle's id in hex, as Ray's errors name it (no public accessor in Ray 2)."""
    id_ = getattr(actor, "_actor_id", None)
    return None if id_ is None else id_.hex()


def replace_stages(passes, gone: list[int]) -> list[tuple[range, list]]:
    """Plan and load the lost stages' shares on the nodes left; the new placement and actors in
    `passes`, connected to each other when spread by experts. Returns each lost range of layers
    with the actors that now hold it."""
    ray, old = passes.ray, passes.placement
    try:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:               # noqa: BLE001 - the head does not answer: nothing to heal with
        raise ClusterError("the cluster's head does not answer") from None
    kept = [i for i in range(len(old.stages)) if i not in gone]
    nodes, used = {}, {}
    for s in old.stages:
        nodes.setdefault(s.node.node_id, s.node)
    for n in old.idle:
        nodes.setdefault(n.node_id, n)
    for i in kept:
        s = old.stages[i]
        used[s.node.node_id] = used.get(s.node.node_id, 0) + (s.budget or s.need["total"])
    # a lost stage's node is not one of the nodes left, even while the head still counts it alive:
    # the head learns of a machine's death by missed heartbeats (15 s by default), and an actor
    # placed there meanwhile is cancelled when it does
    suspect = {old.stages[i].node.node_id for i in gone} - {old.stages[i].node.node_id for i in kept}
    left = [dataclasses.replace(n, available=None if n.available is None else max(0, n.available - used.get(k, 0)))
            for k, n in nodes.items() if k in alive and k not in suspect]
    stages, actors, moved = [old.stages[i] for i in kept], [passes.stages[i] for i in kept], []
    for i in gone:
        lost = old.stages[i]
        while True:
            if not left:
                raise ClusterError("no node of the cluster is left")
            share = (passes.replan(left, lost.layers) if lost.experts is None
                     else passes.replan(left, lost.layers, lost.experts))
            running = {s.node.node_id for s in stages}
            new = [passes.new_actor(s, cpus=0 if s.node.node_id in running else None) for s in share]
            failed = failed_nodes(ray, new, share)
            if not failed:
                break
            for a in new:           # a node lost while its share loaded: plan again without it
                try:
                    ray.kill(a)
                except Exception:   # noqa: BLE001 - gone with its node
                    pass
            left = [n for n in left if n.node_id not in failed]
        for s in share:     # what it takes is no longer left for the next lost range
            left = [dataclasses.replace(n, available=n.available - (s.budget or s.need["total"]))
                    if n.node_id == s.node.node_id and n.available is not None else n for n in left]
        stages += share
        actors += new
        moved.append((lost.layers, new))
    # the stages holding layers in their order (experts alone: wherever)
    order = sorted(range(len(stages)), key=lambda j: (stages[j].layers.start, (stages[j].experts or range(0)).start))
    holding = {s.node.node_id for s in stages}
    passes.placement = Placement([stages[j] for j in order], [n for n in old.idle if n.node_id not in holding])
    passes.stages = [actors[j] for j in order]
    if passes.placement.spread == "experts":
        try:        # the survivors ask the new stages for the moved experts
            ray.get(passes.connect())
        except Exception as e:      # noqa: BLE001 - a node lost while healing
            raise lost_while_healing(e) from None
    return moved


def failed_nodes(ray, actors: list, share: list) -> set:
    """The nodes whose new stage did not load because the stage or its node died; a ds2 error a
    stage raised while loading (its checkpoint, its memory) is raised as itself."""
    failed = set()
    for a, s in zip(actors, share):
        try:
            ray.get(a.ready.remote())
        except ray.exceptions.RayError as e:
            ds2 = next((c for c in causes(e) if isinstance(c, Ds2Error) and not isinstance(c, ray.exceptions.RayError)),
                       None)
            if ds2 is not None:
                raise type(ds2)(str(ds2)) from None      # it names its node
            failed.add(s.node.node_id)
    return failed


EARLY_BYTES = 256 << 20   # the moved layers' inputs asked for while they load, at most (Ray's object store)


class Inputs:
    """The moved layers' input, chunk by chunk, for each live cache. The stage before a lost
    range kept the hidden state it handed on at every position of every cache (StageActor.keep):
    that is the input, read back. Where it is not held (that stage moved too, a cache whose
    positions came otherwise), the layers before the range run the cache's ids again into a
    scratch cache of each, only to give it. Spread by layers or by experts, the stages before a
    lost range survive it, so with one stage lost (`lost`) the kept states are asked for before
    the moved layers load and come while they load, up to EARLY_BYTES."""

    def __init__(self, passes, lost: range | None = None):
        self.passes = passes
        self.scratch: dict[int, int] = {}        # id(cache) -> its scratch number on the stages
        self.early: dict[tuple[int, int], object] = {}     # (id(cache), position) -> a kept state's ref
        self.used: list = []                     # the stages whose scratch caches are dropped after
        if lost is None or lost.start == 0:
            return
        prev = [a for s, a in zip(passes.placement.stages, passes.stages) if s.layers and s.layers.stop == lost.start]
        room = EARLY_BYTES
        width = 4 * passes.model.config.hidden_size
        for cache in self.live():       # a stage lost meanwhile: rebuild() meets its error
            for at, p in self.chunks(cache):
                if not prev or room < width * len(p.tokens):
                    return
                self.early[(id(cache), at)] = prev[0].output.remote(cache.number, at, at + len(p.tokens))
                room -= width * len(p.tokens)

    def live(self) -> list:
        return [c for c in list(self.passes.caches) if c.length > 0 and c.tokens is not None]

    def chunks(self, cache):
        """(position, the pass of that chunk into the cache's scratch number) for each chunk."""
        if id(cache) not in self.scratch:
            self.scratch[id(cache)] = next(self.passes.numbers)
        number = self.scratch[id(cache)]
        chunk = self.passes.model.prefill_chunk
        for at in range(0, cache.length, chunk):
            ids = cache.tokens[at:min(cache.length, at + chunk)]
            yield at, Pass(ids, [len(ids)], [at], [0], [(number, cache.capacity)])

    def run(self, actors: list, p, x, scratch: bool = True):
        """`p` through `actors` in turn from input `x` (None: the ids); the last one's output."""
        for a in actors:
            if scratch and a not in self.used:
                self.used.append(a)
            x, _ = a.compute.options(num_returns=2).remote(p, x)
        return x

    def of(self, cache, at: int, p, before: list):
        """The moved layers' input for chunk `p` (at `at`) of `cache` (`before`: the stages
        holding the layers before them, in order): kept by the last of them, else computed."""
        ref = self.early.pop((id(cache), at), None)
        if ref is None and before:
            ref = before[-1].output.remote(cache.number, at, at + len(p.tokens))
        kept = None if ref is None else self.passes.ray.get(ref)
        if kept is not None:
            self.passes.healed["states_read"] += len(p.tokens)
        return kept if kept is not None else self.run(before, p, None)

    def drop(self) -> None:
        for a in self.used:
            for number in self.scratch.values():
                try:
                    a.drop.remote(number)
                except Exception:   # noqa: BLE001 - gone with its node
                    pass
        self.early.clear()


def rebuild(passes, moved: list[range], early: Inputs | None = None) -> tuple[int, str]:
    """Each live cache's positions in the `moved` ranges of layers, from the ids it was sent, chunk
    by chunk (`early`: the moved layers' inputs asked for while they loaded); the positions
    rebuilt (summed over the caches and moved ranges), and the caches' lengths. The chunks are
    sent without waiting for one another: a stage computes a chunk while the next stage computes
    the one before, as a pipelined prefill (spread by layers, where a stage runs its calls one at
    a time in the order sent; by experts a stage also answers expert calls, on a second thread,
    so each chunk is waited for)."""
    ray, done, lengths = passes.ray, 0, []
    ordered = passes.placement.spread == "layers"
    width = 4 * passes.model.config.hidden_size      # a position's hidden state, float32
    moved = [layers for layers in moved if len(layers)]       # a stage of experts alone: no cache
    held = [(s, a) for s, a in zip(passes.placement.stages, passes.stages) if len(s.layers)]
    for cache in list(passes.caches):
        if cache.length == 0 or not moved:
            continue
        if cache.tokens is None:
            raise ClusterError("a cache restored from saved latents cannot be rebuilt on the nodes left "
                               "(its token ids are not known to the driver)")
        for layers in moved:
            before = [a for s, a in held if s.layers.stop <= layers.start]
            movers = [a for s, a in held if layers.start <= s.layers.start < layers.stop]
            inputs = early if early is not None and len(moved) == 1 else Inputs(passes)
            try:
                outs, pending = [], 0    # the chunks sent and not yet waited for, their outputs' bytes
                for at, p in inputs.chunks(cache):
                    outs.append((inputs.run(movers, p.with_caches([cache.ref], None),
                                            inputs.of(cache, at, p, before), scratch=False), width * len(p.tokens)))
                    pending += outs[-1][1]
                    while outs and (not ordered or pending > EARLY_BYTES):
                        x, b = outs.pop(0)
                        ray.get(x)
                        pending -= b
                ray.get([x for x, _ in outs])
            except Exception as e:      # noqa: BLE001 - a node lost while healing
                raise lost_while_healing(e) from None
            finally:
                if inputs is not early:
                    inputs.drop()
            done += cache.length
        lengths.append(cache.length)
    return done, (f"{len(lengths)} cache{'s' * (len(lengths) != 1)} ({', '.join(map(str, sorted(lengths)))} "
                  f"positions)")


def lost_while_healing(error: Exception) -> ClusterError:
    return ClusterError(f"a node was lost while the cluster healed: {str(error).strip().splitlines()[-1][:300]}")
