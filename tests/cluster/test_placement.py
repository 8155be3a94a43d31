"""The placement alone (no Ray): contiguous ranges in node order, shares in proportion to what
each node offers, every range within its node by the memory check's accounting, one error when
the nodes cannot hold the model, and the nodes' own problems named."""

import pytest

from ds2cli.cli.bench.synthetic import lite_config
from ds2cli.cluster.placement import Node, PlacementError, check_nodes, plan, plan_range
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import memory
from ds2cli.weights.qcheckpoint import QuantConfig

LITE = DeepseekV2Config.from_dict(lite_config(27))
Q4 = QuantConfig.recipe(4)


def nodes(*gb: float) -> list[Node]:
    return [Node(f"{i:08x}" * 7, f"10.0.0.{i + 1}", 8, int(g * 1e9), "0.1.0", "2.60.0") for i, g in enumerate(gb)]


def test_ranges_are_contiguous_and_cover_every_layer_once():
    p = plan(LITE, Q4, 2048, nodes(6, 6))
    assert [s.layers for s in p.stages] == [range(0, 14), range(14, 27)]
    for s in p.stages:
        assert s.need == memory.required(LITE, Q4, 2048, False, s.layers)
        assert s.need["total"] <= s.node.available


def test_a_node_offering_more_holds_more():
    small, big = plan(LITE, Q4, 2048, nodes(4, 12)).stages
    assert len(small.layers) < len(big.layers)
    assert small.need["total"] <= 4e9


def test_the_first_holds_the_embedding_and_the_last_the_head():
    first, last = plan(LITE, Q4, 2048, nodes(6, 6)).stages
    alone = memory.required(LITE, Q4, 2048)["weights"]
    assert first.need["weights"] + last.need["weights"] == alone
    assert "+ embedding" in first.describe(27) and "+ norm and head" in last.describe(27)


def test_a_node_with_too_little_holds_nothing():
    p = plan(LITE, Q4, 2048, nodes(6, 6, 0.5))
    assert len(p.stages) == 2 and [n.address for n in p.idle] == ["10.0.0.3"]
    assert "holds nothing" in p.lines(27)[-1]


def test_a_cluster_too_small_is_one_error_saying_what_it_offers():
    with pytest.raises(PlacementError, match=r"the cluster cannot hold the model: 2 nodes offer 8.0 GB, and "
                                             r"layers \d+-26 found no room"):
        plan(LITE, Q4, 2048, nodes(4, 4))


def test_unknown_memory_is_not_limited():
    p = plan(LITE, None, 2048, [Node("a" * 56, "10.0.0.1", 8, None, "0.1.0", "2.60.0")])
    assert [s.layers for s in p.stages] == [range(0, 27)]


def test_a_node_with_a_problem_or_another_version_is_named():
    bad = [Node("b" * 56, "10.0.0.2", 8, 10**9, "0.1.0", "2.60.0", problem="cannot read the model at /m: gone"),
           Node("c" * 56, "10.0.0.3", 8, 10**9, "0.0.9", "2.60.0"),
           Node("d" * 56, "10.0.0.4", 8, 10**9, "0.1.0", "2.59.0")]
    with pytest.raises(PlacementError) as e:
        check_nodes(bad, "0.1.0", "2.60.0")
    assert str(e.value) == ("node 10.0.0.2 (bbbbbbbb): cannot read the model at /m: gone; "
                            "node 10.0.0.3 (cccccccc) runs ds2 0.0.9, the driver 0.1.0; "
                            "node 10.0.0.4 (dddddddd) runs Ray 2.59.0, the driver 2.60.0")


def test_a_node_whose_checkpoint_is_not_the_drivers_is_named():
    """Its fingerprint (ray_cluster.checkpoint_fingerprint: files, headers, the index's checksums)
    differs from the driver's: other weights at the same path. A node that reported none, or a
    driver that gives none, is not compared."""
    same = Node("a" * 56, "10.0.0.1", 8, 10**9, "0.1.0", "2.60.0", fingerprint="f" * 64)
    other = Node("e" * 56, "10.0.0.5", 8, 10**9, "0.1.0", "2.60.0", fingerprint="0" * 64)
    check_nodes([same], "0.1.0", "2.60.0", "f" * 64)
    with pytest.raises(PlacementError) as e:
        check_nodes([same, other], "0.1.0", "2.60.0", "f" * 64)
    assert str(e.value) == ("node 10.0.0.5 (eeeeeeee) holds another checkpoint at the path than the driver (its "
                            "config, tokenizer, index, checksums or shards' sizes and headers differ: docs/cluster.md)")
    check_nodes([same, other], "0.1.0", "2.60.0")


def test_by_experts_each_node_holds_a_contiguous_share_of_every_moe_layers_experts():
    from ds2cli.cluster.placement import plan_experts
    p = plan_experts(LITE, Q4, 2048, nodes(4, 12))
    small, big = p.stages
    assert small.experts.start == 0 and small.experts.stop == big.experts.start and big.experts.stop == 64
    assert len(small.experts) < len(big.experts) and len(small.layers) < len(big.layers)
    assert small.layers.start == 0 and small.layers.stop == big.layers.start and big.layers.stop == 27
    for s in p.stages:
        assert s.need == memory.required(LITE, Q4, 2048, False, s.layers, s.experts)
        assert s.need["total"] <= s.node.available
    # the nodes' shares add up to the whole model's weights (an expert's bytes rounded down)
    alone = memory.required(LITE, Q4, 2048)["weights"]
    assert abs(small.need["weights"] + big.need["weights"] - alone) < 1000
    assert "experts 0-" in small.describe(27) and "of each MoE layer" in big.describe(27)
    assert p.to_json()[1]["last_expert"] == 63 and p.spread == "experts"


def test_by_experts_a_node_holds_only_its_share_of_the_experts():
    from ds2cli.cluster.placement import plan_experts
    whole = memory.required(LITE, Q4, 2048)["weights"]
    routed = memory.routed_bytes(LITE, Q4)
    stages = plan_experts(LITE, Q4, 2048, nodes(6, 6, 6, 6)).stages
    assert [len(s.experts) for s in stages] == [16] * 4
    assert all(s.need["weights"] < whole - routed * 3 // 4 + 1 for s in stages)


def test_by_experts_refuses_a_model_without_experts_and_nodes_too_small():
    from ds2cli.cluster.placement import plan_experts
    dense = DeepseekV2Config.from_dict({**lite_config(4), "n_routed_experts": None, "first_k_dense_replace": 4})
    with pytest.raises(PlacementError, match="no routed experts to spread: use --ray-spread layers"):
        plan_experts(dense, None, 2048, nodes(6, 6))
    with pytest.raises(PlacementError, match="cannot hold the model spread by experts: 10.0.0.1 .* would need"):
        plan_experts(LITE, Q4, 2048, nodes(2, 2))


Q8 = QuantConfig.recipe(8)


def check_streams(stage, cfg=LITE, qc=Q8, context=2048) -> None:
    """A streaming stage within what its node offers: its resident part and its slots' experts
    within its budget, at least one token's experts, at most every expert it holds."""
    st = stage.stream
    assert st is not None and st["budget"] <= stage.node.available
    assert st == {**memory.streamed(cfg, qc, context, st["budget"], stage.layers, stage.experts), "budget": st["budget"]}
    assert st["resident"] + st["slots"] * st["expert"] <= st["budget"]
    assert cfg.num_experts_per_tok <= st["slots"] <= st["experts"]
    assert "expert slots" in stage.describe(cfg.num_hidden_layers) and "streamed" in stage.describe(cfg.num_hidden_layers)


def test_nodes_too_small_for_their_layers_stream_their_experts():
    # the 27-layer shape at 8 bits (16.4 GB) over two nodes offering 6 GB each
    assert memory.required(LITE, Q8, 2048)["total"] > 12e9
    with pytest.raises(PlacementError, match="cannot hold the model: 2 nodes offer 12.0 GB"):
        plan(LITE, Q8, 2048, nodes(6, 6))                      # a checkpoint that cannot stream
    p = plan(LITE, Q8, 2048, nodes(6, 6), streamable=True)
    assert [s.layers for s in p.stages] == [range(0, 14), range(14, 27)] and p.streams
    for s in p.stages:
        check_streams(s)
        assert s.stream["slots"] < s.stream["experts"]          # less than its layers' experts: it reads
    streamed = p.to_json()[0]["streamed"]
    assert streamed["expert_slots"] == p.stages[0].stream["slots"] and streamed["budget_bytes"] == 6e9


def test_a_budget_makes_every_node_stream_within_it():
    p = plan(LITE, Q4, 2048, nodes(12, 12), streamable=True, budget=int(3e9))
    assert all(s.stream["budget"] == 3e9 for s in p.stages)
    for s in p.stages:
        check_streams(s, qc=Q4)
    # without a budget the same nodes hold their layers whole
    assert not plan(LITE, Q4, 2048, nodes(12, 12), streamable=True).streams


def test_a_cluster_too_small_even_streaming_is_one_error_naming_what_it_needs():
    with pytest.raises(PlacementError, match=r"2 nodes offer 2.4 GB, .*streaming its routed experts, about "
                                             r"[\d.]+ GB over 2 nodes, [\d.]+ GB more than they offer"):
        plan(LITE, Q8, 2048, nodes(1.2, 1.2), streamable=True)


def test_by_experts_nodes_stream_their_share_of_every_layer():
    from ds2cli.cluster.placement import plan_experts
    p = plan_experts(LITE, Q8, 2048, nodes(6, 6, 6), streamable=True)
    moe = sum(LITE.is_moe_layer(i) for i in range(27))
    for s in p.stages:
        check_streams(s)
        assert s.stream["experts"] == moe * len(s.experts)
    with pytest.raises(PlacementError, match="would need [\\d.]+ GB streaming and offers 1.0 GB"):
        plan_experts(LITE, Q8, 2048, nodes(1, 1), streamable=True)


def test_streaming_a_share_counts_only_its_own_experts():
    whole = memory.streamed(LITE, Q8, 2048, int(6e9))
    assert memory.streamed(LITE, Q8, 2048, int(6e9), range(27)) == whole
    half = memory.streamed(LITE, Q8, 2048, int(6e9), range(0, 14))
    assert half["resident"] < whole["resident"] and half["slots"] > whole["slots"]
    assert half["experts"] == 64 * sum(LITE.is_moe_layer(i) for i in range(14))
    share = memory.streamed(LITE, Q8, 2048, int(6e9), range(0, 14), range(0, 16))
    assert share["experts"] == 16 * sum(LITE.is_moe_layer(i) for i in range(27)) and share["expert"] == whole["expert"]


def test_a_lost_share_by_experts_goes_whole_to_the_node_with_the_most_room():
    """Healing a cluster spread by experts (execution/healing.py): the lost node's layers and
    experts on one node left when one has room for them, so the others gain one peer to ask."""
    from ds2cli.cluster.placement import plan_experts, plan_lost
    lost = plan_experts(LITE, Q4, 2048, nodes(6, 6, 6)).stages[1]
    left = nodes(3, 5, 4)                          # what each node has left of what it offers
    [moved] = plan_lost(LITE, Q4, 2048, left, lost.layers, lost.experts)
    assert moved.node == left[1] and (moved.layers, moved.experts) == (lost.layers, lost.experts)
    assert moved.need == memory.required(LITE, Q4, 2048, False, lost.layers, lost.experts) and moved.stream is None
    # a node that held experts alone: only its experts move
    [alone] = plan_lost(LITE, Q4, 2048, left, range(0), range(10, 20))
    assert alone.node == left[1] and not len(alone.layers) and alone.experts == range(10, 20)



def test_a_lost_range_by_layers_goes_whole_to_the_node_with_the_most_room_or_is_shared_out():
    """By layers, a lost range on one node where one has room for it whole (one stage: a token
    makes no more hops than before the loss); else shared out as plan_range shares the whole."""
    from ds2cli.cluster.placement import plan_lost
    left = nodes(3, 5, 4)
    [moved] = plan_lost(LITE, Q4, 2048, left, range(6, 12))
    assert moved.node == left[1] and moved.layers == range(6, 12) and moved.stream is None
    assert moved.need == memory.required(LITE, Q4, 2048, False, range(6, 12)) and moved.need["total"] <= 5e9
    assert memory.required(LITE, Q4, 2048, False, range(6, 19))["total"] > 5e9
    shared = plan_lost(LITE, Q4, 2048, left, range(6, 19))
    assert shared == plan_range(LITE, Q4, 2048, left, range(6, 19)) and len(shared) > 1


def test_a_lost_share_by_experts_too_big_for_any_node_left_is_shared_out_or_one_error():
    from ds2cli.cluster.placement import plan_experts, plan_lost
    lost = plan_experts(LITE, Q4, 2048, nodes(6, 6, 6)).stages[1]
    assert memory.required(LITE, Q4, 2048, False, lost.layers, lost.experts)["total"] > 3e9
    shared = plan_lost(LITE, Q4, 2048, nodes(3, 3), lost.layers, lost.experts)
    # its layers and its experts each shared in order over the nodes left, every share within its node
    assert [s.layers for s in shared] == [range(lost.layers.start, shared[1].layers.start),
                                          range(shared[1].layers.start, lost.layers.stop)]
    assert [s.experts for s in shared] == [range(lost.experts.start, shared[1].experts.start),
                                           range(shared[1].experts.start, lost.experts.stop)]
    assert all(len(s.layers) and len(s.experts) and s.need["total"] <= 3e9 for s in shared)
    with pytest.raises(PlacementError, match="cannot hold the model spread by experts: 10.0.0.1 .* would need"):
        plan_lost(LITE, Q4, 2048, nodes(2, 2), lost.layers, lost.experts)


def test_a_lost_share_by_experts_streams_where_it_does_not_fit_whole():
    from ds2cli.cluster.placement import plan_experts, plan_lost
    lost = plan_experts(LITE, Q8, 2048, nodes(6, 6, 6), streamable=True).stages[1]
    [moved] = plan_lost(LITE, Q8, 2048, nodes(2, 4), lost.layers, lost.experts, streamable=True)
    assert moved.node.address == "10.0.0.2" and (moved.layers, moved.experts) == (lost.layers, lost.experts)
    check_streams(moved)
    assert moved.stream["slots"] < moved.stream["experts"]
