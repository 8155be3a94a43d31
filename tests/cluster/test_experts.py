"""A model spread over a real Ray cluster by experts (conftest.py's local cluster, loopback only):
four reference cases over two nodes equal one process within float rounding (one
pass, chunks then decode steps, a batched pass), the placement printed before loading names each
node's experts, and a decode step makes at most one expert call a MoE layer and other node."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from support.ray_local import ADDRESS, CALL_TIMEOUT
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights.source import bundled_model_dir

pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data"
CASES = sorted(p for root in ("reference", "reference_v3") for p in (DATA / root).iterdir() if (p / "ref.npz").is_file())
TOL = 1e-3        # the references' READMEs: above 1e-3 is a bug
DRIVE = Path(__file__).with_name("drive.py")
# over a cluster: the bundled model, a YaRN case, V2's group-limited routing and V3's (every case
# runs in one process in tests/model; the cluster adds transport, not math)
OVER = [c for c in CASES if c.name in ("ds2_tiny_chat", "lite_like_plainq_yarn", "v2_like_loraq_grouplimited",
                                       "v3_like_fp8_mtp")]


def config_of(case: Path) -> DeepseekV2Config:
    d = case / "model" if (case / "model").is_dir() else case if (case / "config.json").is_file() else bundled_model_dir()
    return DeepseekV2Config.from_dict(json.loads((d / "config.json").read_text()))


def parity_by_experts(cluster, tmp_path: Path, nodes: int) -> None:
    out = tmp_path / f"experts-{nodes}.npz"
    r = cluster.run([sys.executable, str(DRIVE), "--spread=experts", ADDRESS, str(out), *map(str, OVER)],
                    timeout=2 * CALL_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    z = np.load(out)
    for case in OVER:
        cfg = config_of(case)
        ref = np.load(case / "ref.npz")
        logits, half = ref["logits"], len(ref["ids"]) // 2
        for key, want in [("all_at_once", logits), ("two_chunks_then_decode", logits),
                          ("batch_a", logits[:half]), ("batch_b", logits)]:
            got = z[f"{case.name}/{key}"]
            assert got.shape == want.shape, (case.name, key)
            diff = np.abs(got - want).max()
            assert diff <= TOL, f"{case.name}/{key} by experts over {nodes} nodes differs by {diff:.2e}"
        # every node holds a share of the experts, in order, and the shares cover them once
        lines = str(z[f"{case.name}/placement"]).splitlines()
        assert lines[0].endswith(f"over {nodes} nodes by experts:"), lines
        ranges = [line.split("experts ")[1].split(" of each")[0] for line in lines[1:]]
        bounds = [tuple(map(int, r.split("-"))) for r in ranges]
        assert bounds[0][0] == 0 and bounds[-1][1] == cfg.n_routed_experts - 1, lines
        assert all(b[0] == a[1] + 1 for a, b in zip(bounds, bounds[1:])), lines
        passes, calls, expert_calls, expert_bytes = z[f"{case.name}/step"]
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        assert passes == 1 and calls <= nodes
        # one token: at most one call a MoE layer and other node, each its row and their outputs
        assert 1 <= expert_calls <= moe_layers * (nodes - 1), (case.name, expert_calls)
        row = cfg.hidden_size * 4
        assert expert_calls * 2 * row <= expert_bytes <= expert_calls * (1 + cfg.num_experts_per_tok) * row


def test_reference_parity_by_experts_over_two_nodes(cluster, tmp_path):
    # three nodes (a middle stage) run ds2-tiny in test_streams.py (by experts, streaming) and
    # test_heal.py (by layers, before and after a loss): every reference case over two here
    parity_by_experts(cluster, tmp_path, 2)


QUESTION = "What is 451 - 123?"


def test_generate_by_experts_prints_the_plan_and_one_process_text_and_bench_counts_expert_calls(cluster):
    import subprocess
    alone = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "--chat", QUESTION, "--temperature", "0"],
                           capture_output=True, text=True, timeout=CALL_TIMEOUT)
    r = cluster.ds2("generate", "--chat", QUESTION, "--temperature", "0", "--ray", ADDRESS, "--ray-spread", "experts")
    assert r.returncode == 0, r.stderr
    assert r.stdout == alone.stdout and r.stdout.strip() == "451 - 123 = 328."
    lines = r.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("placement of ds2-tiny"))
    assert lines[at].endswith("over 2 nodes by experts:")
    assert "experts 0-3 of each MoE layer" in lines[at + 1] and "experts 4-7 of each MoE layer" in lines[at + 2]

    b = cluster.ds2("bench", "--ray", ADDRESS, "--ray-spread", "experts", "-m", str(bundled_model_dir()),
                    "-r", "1", "-p", "8", "-c", "16", "-n", "4", "--json")
    assert b.returncode == 0, b.stderr[-2000:]
    report = json.loads(b.stdout)
    cfg = config_of(DATA / "reference" / "ds2_tiny_chat")
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    sent = report["decode"][0]["per_token"]
    assert report["cluster"]["spread"] == "experts" and sent["calls"] == 2
    assert 0 < sent["expert_calls"] <= moe_layers and sent["expert_bytes"] >= sent["expert_calls"] * 2 * cfg.hidden_size * 4
    assert sent["expert_seconds"] >= 0 and report["decode"][0]["tok_per_s"]["median"] > 0

    table = cluster.ds2("bench", "--ray", ADDRESS, "--ray-spread", "experts", "-m", str(bundled_model_dir()),
                        "-r", "1", "-p", "8", "-c", "16", "-n", "2")
    assert table.returncode == 0 and "by experts" in table.stdout and "expert calls" in table.stdout, table.stdout


def test_serve_by_experts_answers_two_requests_at_once(cluster):
    import subprocess
    from test_cluster import CLIENT
    port = 8766
    server = cluster.popen([sys.executable, "-m", "ds2cli", "serve", "--ray", ADDRESS, "--ray-spread", "experts",
                            "--port", str(port), "--parallel", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        r = cluster.run([sys.executable, "-c", CLIENT % {"port": port}], timeout=CALL_TIMEOUT)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == ["451 - 123 = 328.", "451 - 123 = 328."]
    finally:
        server.terminate()
        server.wait(timeout=60)
