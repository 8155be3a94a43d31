"""A model on paper, not a measurement: DeepSeek-V2 (236B) at 4 bits decoding over 2, 4 and 8
machines of 64 GB on 1 and 10 GbE, spread by layers and by experts, one stream and four, as
docs/cluster.md's table shows it (`python examples/cluster_model.py` prints that table), and
`--streaming`: DeepSeek-V3 (671B) on four such machines and V2 on two, each node streaming its
routed experts from its own disk (docs/cluster.md, "Nodes that stream their experts").

Its inputs: the model's bytes from ds2's own accounting (weights/memory.py with the 4-bit
recipe); what a Ray actor call costs, measured on this machine between two nodes over loopback
(CALL_MS, CALL_MS_PER_KB); what the wire adds (the link's bandwidth and round trip); and how fast
a machine reads weights while decoding (READ_GB_S, an assumption: put your own machines' `ds2
bench` figure there). Compute time is the bytes a step reads divided by that rate: the layers'
other weights one node after another, and a MoE layer's routed experts on the nodes holding them
(the slowest node's share counts). Routing is drawn at random within V2's own limit (a token's
experts come from 3 of 8 groups of 20). Network time is the calls a step makes: a call a node
and pass, and spread by experts a round of calls a MoE layer, which overlaps the stage's own
experts and the shared ones.
"""

from __future__ import annotations

import sys

import numpy as np

from ds2cli.cluster.placement import Node, plan, plan_experts
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import memory
from ds2cli.weights.qcheckpoint import QuantConfig

V2 = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=5120, intermediate_size=12288,
          moe_intermediate_size=1536, num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
          n_shared_experts=2, n_routed_experts=160, num_experts_per_tok=6, first_k_dense_replace=1,
          moe_layer_freq=1, n_group=8, topk_group=3, topk_method="group_limited_greedy", q_lora_rank=1536,
          kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
          routed_scaling_factor=16.0, max_position_embeddings=163840, norm_topk_prob=False)

V3 = dict(V2, model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
          moe_intermediate_size=2048, num_hidden_layers=61, n_shared_experts=1, n_routed_experts=256,
          num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, topk_method="noaux_tc",
          scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=163840)

CALL_MS = 1.05            # measured: an actor call whose argument and answer are 8 KB takes 1.34 ms,
CALL_MS_PER_KB = 0.036    # ... 20 KB 1.77 ms (loopback, two nodes on one machine): a line through both
OBJECT_STORE_MS = 10.0    # measured: 120 KB each way, past Ray's 100 KB inline limit, 10 ms
LINKS = {"1 GbE": (125e6, 0.10), "10 GbE": (1250e6, 0.03)}     # bytes/s, round trip ms
READ_GB_S = 20.0          # assumed: weights a 64 GB machine reads a second while decoding
USABLE_GB = 56.0          # of 64 GB, what a node offers ds2 (the rest: the system)
CONTEXT = 4096


def call_ms(kb_each_way: float, link: str) -> float:
    """One actor call carrying kb_each_way out and back over `link`."""
    bw, rtt = LINKS[link]
    software = CALL_MS + CALL_MS_PER_KB * kb_each_way if kb_each_way <= 100 else OBJECT_STORE_MS
    return software + rtt + 2 * kb_each_way * 1e3 / bw * 1e3


def routing(streams: int, rng) -> list[np.ndarray]:
    """The experts `streams` tokens choose in one MoE layer, each within 3 of 8 groups."""
    out = []
    for _ in range(streams):
        groups = rng.choice(8, 3, replace=False)
        pool = np.concatenate([np.arange(g * 20, g * 20 + 20) for g in groups])
        out.append(rng.choice(pool, 6, replace=False))
    return out


def step(cfg, n: int, streams: int, spread: str, link: str, rng, samples: int = 400) -> tuple[float, float]:
    """(step ms, network ms) of one decode step of `streams` sequences over n nodes: the network's
    part on its own, and the step with it, where a stage computes its own experts and the shared
    ones while its calls for the others' are out (as execution/remote.py does)."""
    q4 = QuantConfig.recipe(4)
    routed = memory.routed_bytes(cfg, q4)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    expert = routed / (moe * cfg.n_routed_experts) / (READ_GB_S * 1e9) * 1e3          # ms to read one
    shared = cfg.n_shared_experts * expert
    embedding = cfg.vocab_size * cfg.hidden_size * 0.5625     # read one row a token, not the whole
    other = (memory.weight_bytes(cfg, q4) - routed - embedding) / (READ_GB_S * 1e9) * 1e3 - moe * shared
    row_kb = cfg.hidden_size * 4 / 1e3
    bounds = [round(cfg.n_routed_experts * j / n) for j in range(n + 1)]
    layer_ms = calls_ms = 0.0
    for _ in range(samples):
        chosen = routing(streams, rng)
        distinct = np.unique(np.concatenate(chosen))
        if spread == "layers":
            layer_ms += len(distinct) * expert + shared
            continue
        count = np.bincount(np.searchsorted(bounds, distinct, side="right") - 1, minlength=n)
        # the stage calls every other node holding a chosen expert, at once: the slowest answer
        # (its experts, then its call) against the stage's own experts and the shared ones
        here, slowest, wait, sent = rng.integers(n), 0.0, 0.0, 0.0
        for j in np.flatnonzero(count):
            if j == here:
                continue
            rows = sum(1 for c in chosen if ((c >= bounds[j]) & (c < bounds[j + 1])).any())
            outs = sum(int(((c >= bounds[j]) & (c < bounds[j + 1])).sum()) for c in chosen)
            kb = (rows + outs) * row_kb / 2
            sent += 2 * kb
            wait = max(wait, call_ms(kb, link))
            slowest = max(slowest, count[j] * expert + call_ms(kb, link))
        wait = max(wait, sent * 1e3 / LINKS[link][0] * 1e3)       # every call's bytes through one link
        calls_ms += wait
        layer_ms += max(count[here] * expert + shared, slowest)
    # each pass: a call a node (the hidden state handed on), and the logits back to the driver
    network = n * call_ms(streams * row_kb, link) + call_ms(streams * cfg.vocab_size * 4 / 1e3, link)
    return other + moe * layer_ms / samples + network, network + moe * calls_ms / samples


# --streaming: the rates each figure is computed from, as (name, compute GB/s, disk GB/s)
RATES = [("this machine", 8.49, 1.69),     # measured here (docs/performance.md): 27-layer 8-bit decode's
                                          # stored weights a second on 2 cores; O_DIRECT expert reads, 2 threads
         ("64 GB machine, 3 GB/s NVMe", READ_GB_S, 3.0)]     # the assumption above, and an NVMe's rate


def pick(cfg, rng) -> np.ndarray:
    """One token's routed experts in a MoE layer, within the model's group limit."""
    size = cfg.n_routed_experts // cfg.n_group
    groups = rng.choice(cfg.n_group, cfg.topk_group, replace=False)
    pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in groups])
    return rng.choice(pool, cfg.num_experts_per_tok, replace=False)


def streaming(cfg, n: int, spread: str, compute_gb_s: float, disk_gb_s: float, rng, samples: int = 300) -> dict:
    """One stream's decode step over n machines offering USABLE_GB that stream their routed
    experts as ds2's placement plans them (cluster/placement.py: each node's resident part and
    slots). A slot holds an expert a token chose with the chance its node's slots are of its
    experts (uniform routing under LRU: real routing repeats experts, so this is the pessimistic
    end); a miss is read at disk_gb_s. `step_ms` counts the reads after the compute (no read
    ahead), `overlap_ms` each layer's reads under its compute (read ahead that always guesses
    right): the truth is between. On 1 GbE; bytes read a token per node."""
    q4 = QuantConfig.recipe(4)
    nodes = [Node(f"{j:08x}" * 7, f"10.0.0.{j + 1}", 16, int(USABLE_GB * 1e9)) for j in range(n)]
    p = (plan_experts if spread == "experts" else plan)(cfg, q4, CONTEXT, nodes, streamable=True)
    routed = memory.routed_bytes(cfg, q4)
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    expert = routed / (len(moe) * cfg.n_routed_experts)
    held = [1.0 if s.stream is None else s.stream["slots"] / s.stream["experts"] for s in p.stages]
    owner = {i: j for j, s in enumerate(p.stages) for i in s.layers}
    bounds = [s.experts.start for s in p.stages] + [cfg.n_routed_experts] if spread == "experts" else None
    embedding = cfg.vocab_size * cfg.hidden_size * 0.5625
    other = (memory.weight_bytes(cfg, q4) - routed - embedding) / (compute_gb_s * 1e9) * 1e3
    shared = cfg.n_shared_experts * expert / (compute_gb_s * 1e9) * 1e3
    link = "1 GbE"
    row_kb = cfg.hidden_size * 4 / 1e3
    read = np.zeros(n)
    step = overlap = 0.0
    for _ in range(samples):
        for i in moe:
            chosen = pick(cfg, rng)
            where = [owner[i]] * len(chosen) if spread == "layers" else \
                list(np.searchsorted(bounds, chosen, side="right") - 1)
            compute, disk = np.zeros(n), np.zeros(n)
            for j in where:
                compute[j] += expert / (compute_gb_s * 1e9) * 1e3
                miss = 1 - held[j]
                disk[j] += miss * expert / (disk_gb_s * 1e9) * 1e3
                read[j] += miss * expert
            here = owner[i]
            calls = np.array([call_ms(2 * row_kb, link) if j != here and compute[j] else 0.0 for j in range(n)])
            compute[here] += shared
            step += max(compute + disk + calls)
            overlap += max(np.maximum(compute, disk) + calls)
    network = n * call_ms(row_kb, link) + call_ms(cfg.vocab_size * 4 / 1e3, link)
    return {"placement": p, "read_gb": read / samples / 1e9, "step_ms": other + network + step / samples,
            "overlap_ms": other + network + overlap / samples}


def main_streaming() -> None:
    rng = np.random.default_rng(0)
    q4 = QuantConfig.recipe(4)
    print(f"machines of 64 GB offering {USABLE_GB:.0f} GB each, cache of {CONTEXT} tokens, 4 bits, one stream on 1 GbE")
    print("| model | machines | spread | each node: resident GB, expert slots (share of its experts) | "
          "read a token per node GB | rates | step ms (no read ahead / all read ahead) | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, config, n in (("DeepSeek-V3 (671B)", V3, 4), ("DeepSeek-V2 (236B)", V2, 2)):
        cfg = DeepseekV2Config.from_dict(config)
        need = memory.required(cfg, q4, CONTEXT)["total"] / 1e9
        for spread in ("layers", "experts"):
            for rates, compute_gb_s, disk_gb_s in RATES:
                r = streaming(cfg, n, spread, compute_gb_s, disk_gb_s, rng)
                nodes = "; ".join(f"{s.stream['resident'] / 1e9:.0f}, {s.stream['slots']} "
                                  f"({100 * s.stream['slots'] / s.stream['experts']:.0f}%)" if s.stream else "whole"
                                  for s in r["placement"].stages)
                reads = ", ".join(f"{g:.2f}" for g in r["read_gb"])
                print(f"| {name}, {need:.0f} GB | {n} | {spread} | {nodes} | {reads} | {rates} | "
                      f"{r['step_ms']:.0f} / {r['overlap_ms']:.0f} | {1e3 / r['step_ms']:.2f}-{1e3 / r['overlap_ms']:.2f} |")


def main() -> None:
    if "--streaming" in sys.argv[1:]:
        return main_streaming()
    cfg = DeepseekV2Config.from_dict(V2)
    need = memory.required(cfg, QuantConfig.recipe(4), CONTEXT)["total"] / 1e9
    rng = np.random.default_rng(0)
    print(f"DeepSeek-V2 at 4 bits needs {need:.0f} GB at {CONTEXT} tokens; a node offers {USABLE_GB:.0f} GB")
    print("| machines | link | streams | by layers: step ms (network), tok/s | by experts: step ms (network), tok/s |")
    print("|---|---|---|---|---|")
    for n in (2, 4, 8):
        for link in LINKS:
            for streams in (1, 4):
                if n * USABLE_GB < need:
                    print(f"| {n} | {link} | {streams} | does not fit | does not fit |")
                    continue
                cells = []
                for spread in ("layers", "experts"):
                    total, network = step(cfg, n, streams, spread, link, rng)
                    cells.append(f"{total:.0f} ({network:.0f}), {streams * 1e3 / total:.2f}")
                print(f"| {n} | {link} | {streams} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
