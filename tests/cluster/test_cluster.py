"""A model over a real Ray cluster (conftest.py: nodes on 127.0.0.1 in a private network
namespace): reference parity over two nodes (four cases), the CLI's text and placement, a node
killed mid-generation, a node without the checkpoint, a model the cluster cannot hold, serve
with two requests at once."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support.ray_local import ADDRESS, CALL_TIMEOUT
from ds2cli.cli.bench.synthetic import lite_config
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import checkpoint
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
QUESTION = "What is 451 - 123?"


def layers_of(case: Path) -> int:
    d = case if (case / "config.json").is_file() else bundled_model_dir()
    return json.loads((d / "config.json").read_text())["num_hidden_layers"]


def parity(cluster, tmp_path: Path, nodes: int) -> None:
    out = tmp_path / f"logits-{nodes}.npz"
    r = cluster.run([sys.executable, str(DRIVE), ADDRESS, str(out), *map(str, OVER)], timeout=2 * CALL_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    z = np.load(out)
    for case in OVER:
        ref = np.load(case / "ref.npz")
        logits, half = ref["logits"], len(ref["ids"]) // 2
        assert int(z[f"{case.name}/stages"]) == min(nodes, layers_of(case)), case.name
        for key, want in [("all_at_once", logits), ("two_chunks_then_decode", logits),
                          ("batch_a", logits[:half]), ("batch_b", logits)]:
            got = z[f"{case.name}/{key}"]
            assert got.shape == want.shape, (case.name, key)
            diff = np.abs(got - want).max()
            assert diff <= TOL, f"{case.name}/{key} over {nodes} nodes differs by {diff:.2e}"


def test_reference_parity_over_two_nodes(cluster, tmp_path):
    # three nodes (a middle stage) run ds2-tiny in test_streams.py (by experts, streaming) and
    # test_heal.py (by layers, before and after a loss): every reference case over two here
    parity(cluster, tmp_path, 2)


def test_generate_over_the_cluster_prints_the_placement_and_the_same_text(cluster):
    alone = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "--chat", QUESTION, "--temperature", "0"],
                           capture_output=True, text=True, timeout=CALL_TIMEOUT)
    r = cluster.ds2("generate", "--chat", QUESTION, "--temperature", "0", "--ray", ADDRESS)
    assert r.returncode == 0, r.stderr
    assert r.stdout == alone.stdout and r.stdout.strip() == "451 - 123 = 328."
    lines = r.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("placement of ds2-tiny"))
    assert "over 2 nodes" in lines[at]
    assert "layers 0-" in lines[at + 1] and "+ embedding" in lines[at + 1]
    assert "+ norm and head" in lines[at + 2] and "2.0 GB" in lines[at + 2]


def test_inspect_shows_the_plan_without_loading(cluster):
    r = cluster.ds2("inspect", "--ray", ADDRESS, "--json")
    assert r.returncode == 0, r.stderr
    stages = json.loads(r.stdout)["placement"]
    assert [s["first_layer"] for s in stages][0] == 0 and stages[-1]["last_layer"] == 5
    assert all(s["total_bytes"] <= s["available_bytes"] == 2 * 10**9 for s in stages)


def test_a_node_killed_mid_generation_ends_it_with_one_error_with_no_heal(cluster):
    node = cluster.add_node()
    try:
        p = cluster.popen([sys.executable, "-m", "ds2cli", "generate", "--chat", QUESTION, "-n", "900",
                           "--ignore-eos", "--temperature", "0", "--ray", ADDRESS, "--no-heal"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = p.stdout.read(1)                   # generating: the first byte of text has come
        assert first, p.stderr.read().decode()
        killed = time.monotonic()
        cluster.kill(node)
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - killed
        lines = err.decode().strip().splitlines()
        assert p.returncode == 1 and lines[-1].startswith("error: lost a node of the cluster"), err.decode()[-2000:]
        assert "Traceback" not in err.decode()
        assert took < 30, f"the error took {took:.1f} s"
    finally:
        cluster.nodes.remove(node)
        cluster.wait_for(2)


def test_a_node_without_the_checkpoint_is_one_error_naming_it(cluster):
    node = cluster.add_node(hide=bundled_model_dir())
    try:
        r = cluster.ds2("generate", "hi", "--ray", ADDRESS)
        assert r.returncode == 1
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("error: node 127.0.0.1 (") and "cannot read the model at" in line, r.stderr
        assert len([x for x in r.stderr.splitlines() if x.startswith("error:")]) == 1
    finally:
        cluster.remove(node)


def sparse_checkpoint(path: Path, config: dict) -> Path:
    """A checkpoint whose headers are real and whose data is a hole: what placement reads."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    header, at = {}, 0
    for name, shape in checkpoint.iter_expected(DeepseekV2Config.from_dict(config)):
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + at)
    return path


def test_a_model_the_cluster_cannot_hold_is_refused_before_loading(cluster, tmp_path):
    big = sparse_checkpoint(tmp_path / "lite27", lite_config(27))     # 31 GB of bf16 headers over 2 x 2 GB
    r = cluster.ds2("inspect", str(big), "--ray", ADDRESS)
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the cluster cannot hold") and "2 nodes offer 4.0 GB" in line, r.stderr


def test_serve_answers_two_requests_at_once_over_the_cluster(cluster):
    port = 8765
    server = cluster.popen([sys.executable, "-m", "ds2cli", "serve", "--ray", ADDRESS, "--port", str(port),
                            "--parallel", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = CLIENT % {"port": port}
    try:
        r = cluster.run([sys.executable, "-c", client], timeout=CALL_TIMEOUT)
        assert r.returncode == 0, r.stderr + server.stderr.read1().decode() if server.poll() is not None else r.stderr
        answers = json.loads(r.stdout)
        assert answers == ["451 - 123 = 328.", "451 - 123 = 328."]
    finally:
        server.terminate()
        server.wait(timeout=60)


# a client's first lines: the server at `base` answering /health "ok" (it loads first)
HEALTHY = f"""
import json, sys, time, urllib.request
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from support.sse import healthy
healthy(base, 120)
"""

CLIENT = """
import threading
base = "http://127.0.0.1:%(port)d"
""" + HEALTHY + """
out = [None, None]
def ask(i):
    body = json.dumps({"messages": [{"role": "user", "content": "What is 451 - 123?"}], "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    out[i] = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(out))
"""


def test_a_session_saved_over_the_cluster_resumes_and_drafts_give_the_same_text(cluster, tmp_path):
    session = tmp_path / "s.ds2"
    first = cluster.ds2("chat", "--session", str(session), "--ray", ADDRESS, input="What is 451 - 123?\n")
    assert first.returncode == 0 and first.stdout.strip() == "451 - 123 = 328.", first.stderr
    again = cluster.ds2("chat", "--session", str(session), "--ray", ADDRESS, input="What is 12 + 30?\n")
    alone = subprocess.run([sys.executable, "-m", "ds2cli", "chat", "--session", str(tmp_path / "t.ds2")],
                           input="What is 451 - 123?\nWhat is 12 + 30?\n", capture_output=True, text=True,
                           timeout=CALL_TIMEOUT)
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == alone.stdout.splitlines()[-1], again.stderr
    drafted = cluster.ds2("generate", "--chat", QUESTION, "--temperature", "0", "--draft", "4", "--ray", ADDRESS)
    assert drafted.returncode == 0 and drafted.stdout.strip() == "451 - 123 = 328.", drafted.stderr
