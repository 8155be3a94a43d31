"""Where healing puts a lost stage's layers, without a cluster: a Ray stand-in whose head may
still count a dead machine alive (it learns of it by missed heartbeats) and whose new actors
may die before they answer; spread by experts, its experts too, and every stage told its peers
again. The real cluster's healing is tests/cluster/test_heal.py."""

from __future__ import annotations

import types

import pytest

from ds2cli.cluster.placement import Node, Placement, Stage
from ds2cli.cluster.ray_cluster import ClusterError
from ds2cli.execution.healing import lost_stages, replace_stages

GB = 1 << 30


class RayError(Exception):
    pass


class Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class Actor:
    def __init__(self, node_id: str, dead: bool):
        self.node_id = node_id
        self.ready = types.SimpleNamespace(remote=lambda: Ref(error=RayError(f"{node_id} died") if dead else None))


class FakeRay:
    """Ray's calls healing makes: nodes(), get(), kill(), exceptions.RayError."""
    exceptions = types.SimpleNamespace(RayError=RayError)

    def __init__(self, alive: set[str], dying: set[str]):
        self.alive, self.dying, self.killed = alive, dying, []

    def nodes(self):
        return [{"NodeID": n, "Alive": True} for n in sorted(self.alive)]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor):
        self.killed.append(actor)


def node(name: str) -> Node:
    return Node(name * 8, "127.0.0.1", 2, 8 * GB)


def stage(n: Node, layers: range) -> Stage:
    return Stage(n, layers, {"total": GB})


def passes_over(ray: FakeRay, nodes: list[Node]):
    """Three stages of two layers each, one a node; replan puts a lost range whole on the first
    node left (the real one shares it by memory: tests/cluster/test_placement.py)."""
    stages = [stage(n, range(2 * i, 2 * i + 2)) for i, n in enumerate(nodes)]
    planned = []

    def replan(left, layers):
        planned.append([n.node_id for n in left])
        return [stage(left[0], layers)]

    def new_actor(s, cpus=None):
        return Actor(s.node.node_id, s.node.node_id in ray.dying)

    p = types.SimpleNamespace(ray=ray, placement=Placement(stages, []), replan=replan, new_actor=new_actor,
                              stages=[Actor(s.node.node_id, False) for s in stages])
    return p, planned


def test_a_lost_stage_s_node_is_no_node_left_even_while_the_head_counts_it_alive():
    a, b, c = node("a"), node("b"), node("c")
    ray = FakeRay(alive={a.node_id, b.node_id, c.node_id}, dying={c.node_id})   # c lost, not yet declared
    p, planned = passes_over(ray, [a, b, c])
    moved = replace_stages(p, [2])
    assert planned == [[a.node_id, b.node_id]]
    assert [(s.node.node_id, s.layers) for s in p.placement.stages] == [
        (a.node_id, range(0, 2)), (b.node_id, range(2, 4)), (a.node_id, range(4, 6))]
    assert [layers for layers, _ in moved] == [range(4, 6)] and len(p.stages) == 3


def test_a_node_lost_while_its_share_loads_is_planned_around():
    a, b, c = node("a"), node("b"), node("c")
    ray = FakeRay(alive={a.node_id, b.node_id}, dying={a.node_id})     # a dies as the moved layers load
    p, planned = passes_over(ray, [a, b, c])
    replace_stages(p, [2])
    assert planned == [[a.node_id, b.node_id], [b.node_id]]
    assert len(ray.killed) == 1                                        # the stage begun on a, let go
    assert p.placement.stages[-1].node.node_id == b.node_id


def test_a_stage_a_call_found_dead_is_not_asked_again_and_the_others_are():
    """A dead node's actor answers a new call only once the head counts the node dead (seconds):
    the stage the failed pass's error named is lost without asking it; the others are asked, and
    one that does not answer is lost too."""
    class Id:
        def __init__(self, hex_: str):
            self.hex = lambda: hex_

    asked = []

    def stage_actor(hex_: str, answers: bool):
        def ready():
            asked.append(hex_)
            return Ref(error=None if answers else RayError(f"{hex_} died"))
        return types.SimpleNamespace(_actor_id=Id(hex_), ready=types.SimpleNamespace(remote=ready))

    class WaitingRay(FakeRay):
        def wait(self, refs, num_returns, timeout):
            assert num_returns == len(refs) and timeout > 0
            return refs, []

    stages = [stage_actor("aa", True), stage_actor("bb", True), stage_actor("cc", False)]
    passes = types.SimpleNamespace(ray=WaitingRay(set(), set()), stages=stages)
    assert lost_stages(passes, frozenset({"bb"})) == [1, 2]
    assert asked == ["aa", "cc"]
    asked.clear()
    assert lost_stages(passes) == [2] and asked == ["aa", "bb", "cc"]


def test_no_node_left_is_one_cluster_error():
    a, b = node("a"), node("b")
    ray = FakeRay(alive={a.node_id, b.node_id}, dying={a.node_id})
    p, _ = passes_over(ray, [a, b])
    with pytest.raises(ClusterError, match="no node of the cluster is left"):
        replace_stages(p, [1])


class PeerActor(Actor):
    """A stage spread by experts: its peers as the driver last connected it."""

    def __init__(self, node_id: str, dead: bool):
        super().__init__(node_id, dead)
        self.peers = None
        self.connect = types.SimpleNamespace(remote=self.connected)

    def connected(self, peers):
        self.peers = peers
        return Ref()


class ExpertsRay(FakeRay):
    def get(self, ref):
        return [FakeRay.get(self, r) for r in ref] if isinstance(ref, list) else FakeRay.get(self, ref)


@pytest.mark.parametrize("lost", [1, 3])
def test_by_experts_a_lost_stage_s_layers_and_experts_move_and_every_stage_is_reconnected(lost):
    """ds2-tiny by experts over four nodes, the last holding experts alone; stage `lost` lost:
    its layers and experts on a node left (placement.plan_lost), every stage told the new peer."""
    import functools
    import json

    from ds2cli.cluster.placement import plan_lost
    from ds2cli.execution.stages import RayPasses
    from ds2cli.model.config import DeepseekV2Config
    from ds2cli.weights.source import bundled_model_dir
    cfg = DeepseekV2Config.from_dict(json.loads((bundled_model_dir() / "config.json").read_text()))
    a, b, c, d = node("a"), node("b"), node("c"), node("d")
    shares = [(a, range(0, 2), range(0, 2)), (b, range(2, 4), range(2, 4)), (c, range(4, 6), range(4, 6)),
              (d, range(0), range(6, 8))]
    stages = [Stage(n, layers, {"total": GB}, experts) for n, layers, experts in shares]
    ray = ExpertsRay(alive={a.node_id, b.node_id, c.node_id, d.node_id}, dying=set())
    p = types.SimpleNamespace(ray=ray, placement=Placement(stages, []),
                              replan=functools.partial(plan_lost, cfg, None, 64),
                              new_actor=lambda s, cpus=None: PeerActor(s.node.node_id, False),
                              stages=[PeerActor(s.node.node_id, False) for s in stages])
    p.connect = lambda: RayPasses.connect(p)
    old = list(p.stages)
    moved = replace_stages(p, [lost])
    [(layers, [new])] = moved
    assert layers == shares[lost][1] and new not in old
    s = p.placement.stages[p.stages.index(new)]
    assert (s.layers, s.experts) == shares[lost][1:] and s.node.node_id != shares[lost][0].node_id
    # every expert held once, every stage's layers in order
    assert sorted(e for s in p.placement.stages for e in s.experts) == list(range(8))
    held = [s.layers for s in p.placement.stages if len(s.layers)]
    assert [i for r in held for i in r] == list(range(6))
    # every stage knows every other's experts: the survivors ask the new one for the moved experts
    for actor in p.stages:
        want = {(t.experts.start, t.experts.stop, other) for t, other in zip(p.placement.stages, p.stages)
                if other is not actor}
        assert actor.peers is not None and set(actor.peers) == want


STAGE_BLAS = """
from threadpoolctl import threadpool_info
from ds2cli.execution.factory import load
from ds2cli.execution.stages import StageActor
stage = StageActor(load, None, 0, 3, None, 2)
print([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"])
stage.model.executor.stop()
"""


def test_a_stage_given_no_cpus_by_ray_still_runs_blas_on_its_cores():
    """Ray starts a worker that asks no CPUs (a stage moved beside another while healing) with
    OMP_NUM_THREADS=1; the stage sets BLAS to its node's cores, which a quiet pass restores."""
    import os
    import subprocess
    import sys
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core")
    r = subprocess.run([sys.executable, "-c", STAGE_BLAS], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "[2]", r.stdout


def test_a_spare_answers_ready_once_its_share_loaded_and_raises_what_stopped_it():
    """A spare (a stage actor made with no share) loads the share it is given; `ready` answers
    only then, and raises the error that stopped a load (a node without the checkpoint), as a
    stage made with its share raises it from its start."""
    import os
    import threading

    from ds2cli.errors import ConfigError
    from ds2cli.execution.factory import load
    from ds2cli.execution.stages import StageActor

    spare = StageActor()
    assert spare.model is None and not spare.loaded.is_set()
    answered = []
    waiting = threading.Thread(target=lambda: answered.append(spare.ready()))
    waiting.start()
    waiting.join(0.2)
    assert answered == []                   # no share yet: no answer
    spare.take(load, None, 0, 3, None, 1)
    waiting.join(30)
    assert answered == [os.getpid()] and spare.model.layers[0] is not None
    spare.model.executor.stop()

    def no_checkpoint(*args, **kw):
        raise ConfigError("no such file or directory: /models/x")
    broken = StageActor()
    broken.take(no_checkpoint, "/models/x", 0, 3, None, 1, name="node-b")   # the driver does not wait for it
    with pytest.raises(ConfigError, match="node node-b: no such file"):
        broken.ready()
    with pytest.raises(ConfigError, match="node node-b: no such file"):    # made with its share: from its start
        StageActor(no_checkpoint, "/models/x", 0, 3, None, 1, None, None, None, "node-b")
