"""A model on paper, not a measurement: DeepSeek-V2 (236B) at 4 bits decoding over 2, 4 and 8
machines of 64 GB on 1 and 10 GbE, spread by layers and by experts, one stream and four, as
docs/cluster.md's table shows it (`python examples/cluster_model.py` prints that table).

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

import numpy as np

from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import memory
from ds2cli.weights.qcheckpoint import QuantConfig

V2 = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=5120, intermediate_size=12288,
          moe_intermediate_size=1536, num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
          n_shared_experts=2, n_routed_experts=160, num_experts_per_tok=6, first_k_dense_replace=1,
          moe_layer_freq=1, n_group=8, topk_group=3, topk_method="group_limited_greedy", q_lora_rank=1536,
          kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
          routed_scaling_factor=16.0, max_position_embeddings=163840, norm_topk_prob=False)

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


def main() -> None:
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
