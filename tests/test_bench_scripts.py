"""bench/: the scripts behind the docs' figures, each run at its smallest size (ds2-tiny and its
8-bit copy, a few steps) so that none rots as the code changes; bench/README.md names every one;
and no page, comment or test names a path outside the repository (a figure must be rerunnable
from the tree). The scripts that need root (a memory cgroup) or a private network namespace run
where the suite has them, as in CI, and are skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ds2cli.weights import memory
from ds2cli.weights.source import bundled_model_dir, open_model
from support.ray_local import ADDRESS, CALL_TIMEOUT

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
# a path on the machine the figures were taken on (its work folder, root's or a user's home):
# the shown home of docs/cli.md's examples (/home/me, tests/test_docs.py) is a placeholder
OUTSIDE = re.compile(r"/work/|/root/|/home/(?!me\b)")


def run(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """A bench script (or any command) from the repository's root, with this interpreter as
    $PYTHON and the page cache kept (DROP_CACHES=0: others may be measuring on this machine)."""
    r = subprocess.run([*args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHON": sys.executable, "DROP_CACHES": "0", **env})
    assert r.returncode == 0, f"{args} exited {r.returncode}: {r.stderr[-3000:]}"
    return r


def python(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run(sys.executable, f"bench/{script}", *args, **kw)


def memory_cgroups() -> str | None:
    """Why a memory cgroup cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a memory cgroup needs root (CI runs as root)"
    if not os.access("/sys/fs/cgroup/memory", os.W_OK):
        return "in_cgroup.sh needs the cgroup v1 memory controller at /sys/fs/cgroup/memory"
    return None


needs_cgroups = pytest.mark.skipif(memory_cgroups() is not None, reason=memory_cgroups() or "")


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory) -> Path:
    from ds2cli.weights.quantize import quantize_checkpoint
    out = tmp_path_factory.mktemp("bench-scripts") / "tiny-q8"
    quantize_checkpoint(bundled_model_dir(), out, 8)
    return out


@pytest.fixture(scope="module")
def budget(tiny_q8) -> str:
    """A --memory-budget that streams ds2-tiny's 8-bit copy in a few slots."""
    source = open_model(tiny_q8)
    plan = memory.streamed(source.config, source.stored, 64, 10**12)
    return str(plan["resident"] + 4 * plan["expert"])


# ---- the tree: nothing outside it, every script described ----

def test_no_page_comment_or_test_names_a_path_outside_the_repository():
    found = []
    for top in ("docs", "ds2cli", "examples", "tests", "bench", "README.md", "CHANGELOG.md"):
        base = ROOT / top
        for path in [base] if base.is_file() else sorted(base.rglob("*")):
            if path.suffix in (".md", ".py", ".sh", ".toml", ".html") and path != Path(__file__):
                for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                    if OUTSIDE.search(line):
                        found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_the_readme_describes_every_script_and_the_docs_cite_only_scripts_that_exist():
    readme = (BENCH / "README.md").read_text()
    described = re.findall(r"^\| `([\w.]+)` \|", readme, re.M)
    assert described == [s for s in described if s in SCRIPTS] and set(described) == set(SCRIPTS)
    cited = {name for page in (ROOT / "docs").glob("*.md") for name in re.findall(r"(?<![\w/])bench/([\w.]+\.(?:py|sh))",
                                                                                     page.read_text())}
    assert cited and cited <= set(SCRIPTS), cited - set(SCRIPTS)
    for script in SCRIPTS:
        assert os.access(BENCH / script, os.X_OK) or script.endswith(".py"), f"{script} is not executable"


# ---- each script at its smallest size ----

@pytest.mark.slow
def test_step_times_and_ab_compare_two_trees():
    out = python("step_times.py", "--context", "8", "--steps", "2", "--prefill", "8", "--pass-tokens", "2",
                 "--repeats", "1").stdout
    figures = json.loads(out.splitlines()[-1])
    assert set(figures) == {"decode_step_s", "pp8_s", "pass2_s"} and all(v > 0 for v in figures.values())
    out = python("ab.py", ".", ".", "--pairs", "1", "--", "--context", "8", "--steps", "2", "--prefill", "0",
                 "--pass-tokens", "0", "--repeats", "1").stdout
    assert out.startswith("1 pairs, A = ., B = .") and re.search(r"decode_step_s\s+A [\d.]+ / ", out), out


@pytest.mark.slow
@needs_cgroups
def test_in_cgroup_holds_a_command_to_its_limit_and_says_its_peak():
    r = run("bench/in_cgroup.sh", "1G", sys.executable, "-c", "print(open('/proc/self/cgroup').read())")
    group = re.search(r":memory:/(ds2-bench-\d+)", r.stdout).group(1)
    assert re.fullmatch(r"cgroup 1G: peak \d+ bytes, oom_kill 0", r.stderr.strip().splitlines()[-1])
    assert not (Path("/sys/fs/cgroup/memory") / group).exists()         # removed after


@pytest.mark.slow
def test_same_bits_finds_a_tree_the_same_as_itself(tmp_path):
    saved = tmp_path / "bits.npz"
    python("same_bits.py", "save", str(saved), "ds2_tiny_chat")
    assert python("same_bits.py", "compare", str(saved), "ds2_tiny_chat").stdout.strip() == "6 of 6 the same bits"


@pytest.mark.slow
def test_count_patches_counts_the_tests_monkeypatches():
    out = python("count_patches.py").stdout.splitlines()
    assert re.fullmatch(r"TOTAL \d+", out[-1]) and len(out) - 1 == int(out[-1].split()[1])


@pytest.mark.slow
def test_disk_rate_reads_experts_buffered_and_direct(tiny_q8):
    lines = python("disk_rate.py", str(tiny_q8), "--reads", "8").stdout.splitlines()
    how = [line.split(":")[0] for line in lines]
    assert how[:2] == ["buffered, 1 thread", "buffered, 2 threads"] and len(how) == 4
    assert all(h.startswith("O_DIRECT") for h in how[2:])      # or "O_DIRECT refused, buffered" (tmpfs)
    assert all(float(re.search(r": ([\d.]+) GB/s \(8 experts, ", line).group(1)) > 0 for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["local", "budget"])
def test_cluster_target_decodes_greedily_one_way_and_says_what_it_cost(tiny_q8, budget, tmp_path, how):
    target = "local" if how == "local" else f"budget:{budget}"
    python("cluster_target.py", str(tiny_q8), target, "4", str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["prompt_tokens"] == 9 and len(out["ids"]) == len(out["step_s"]) == 4
    assert out["peak_rss_bytes"] > 0 and min(out["step_s"]) <= out["step_median_s"] <= max(out["step_s"])
    assert ("stream" in out) == (how == "budget")
    if how == "budget":
        assert out["stream"]["bytes_read_per_token"] > 0 and out["stream"]["disk_gb_per_s"] > 0


@pytest.mark.slow
def test_cluster_target_over_a_cluster_gives_one_process_ids(cluster, tmp_path):
    tiny = str(bundled_model_dir())
    python("cluster_target.py", tiny, "local", "4", str(tmp_path / "alone.json"))
    r = cluster.run([sys.executable, str(BENCH / "cluster_target.py"), tiny, ADDRESS, "4", str(tmp_path / "ray.json")],
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    alone, spread = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("alone", "ray"))
    assert spread["ids"] == alone["ids"] and len(spread["stages"]) == 2
    assert all(s["VmHWM"] >= s["VmRSS"] > 0 for s in spread["stages"])


@pytest.mark.slow
def test_cluster_ab_compares_two_trees_over_fresh_clusters(tmp_path):
    from support.ray_local import usable
    if usable():
        pytest.skip(usable())
    out = python("cluster_ab.py", ".", ".", str(bundled_model_dir()), "--pairs", "1", "--memory", "2G", "--steps", "2",
                 "--context", "8", timeout=2 * CALL_TIMEOUT).stdout
    assert out.startswith("1 pairs over two nodes, A = ., B = .") and re.search(r"B/A median [\d.]+ ", out), out


def test_busy_runs_two_ways_side_by_side_beside_a_busy_loop():
    out = python("busy.py", "--pairs", "1", "--tokens", "4", "--b", "--threads 1 --draft 2").stdout
    assert out.startswith("1 pairs, 4 tokens, beside 1 busy loop; decode tok/s") and "B (--threads 1 --draft 2): " in out
    assert re.search(r"^A / B: median [\d.]+ \([\d.]+-[\d.]+\); pairs [\d.]+$", out, re.M), out


def test_cluster_heal_reads_every_line_healing_writes():
    """The script reads healing's seconds from ds2's stderr line: by layers and by experts, with
    caches rebuilt or none."""
    import importlib.util
    from ds2cli.execution.healing import healed_line
    spec = importlib.util.spec_from_file_location("cluster_heal", ROOT / "bench" / "cluster_heal.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for spread, names, experts in (("layers", "127.0.0.1 (layers 9-17)", None),
                                   ("experts", "127.0.0.1 (layers 9-17, experts 21-41)", ("21", "41"))):
        for tokens in (0, 260):
            m = script.HEALED.search(healed_line(names, spread, tokens, "1 cache (260 positions)", 2.25, 1.5, 0.75))
            assert m and m.group(1) == names and float(m.group(3)) == 2.2 and int(m.group(2) or 0) == tokens
            assert (float(m.group(4)), float(m.group(5))) == (1.5, 0.8)
            assert script.LAYERS.search(m.group(1)).groups() == ("9", "17")
            found = script.EXPERTS.search(m.group(1))
            assert (found.groups() if found else None) == experts
    # the cluster's prefill rate, from generate's --stats line (the slow test below runs --serve)
    from ds2cli.cli.console import stats_line
    from ds2cli.model.cache import LatentCache
    last = types.SimpleNamespace(prompt_tokens=203, prefill_tok_per_s=41.25, generated_tokens=40,
                                 decode_tok_per_s=2.5, drafted=0)
    m = script.PREFILL.search(stats_line(12.5, last, LatentCache(2, 256, 8, 4)))
    assert m and (int(m.group(1)), float(m.group(2))) == (203, 41.2)


@pytest.mark.slow
def test_cluster_heal_times_a_lost_node_against_its_bound():
    from support.ray_local import usable
    if usable():
        pytest.skip(usable())
    # ds2-tiny decodes hundreds of tokens a second over three nodes: a long reply, killed early;
    # a stream from ds2 serve (generate's only other part, its --stats line, is read above)
    out = python("cluster_heal.py", str(bundled_model_dir()), "--runs", "1", "--tokens", "300", "--kill-after", "0.3",
                 "--context", "60", "--node-memory", "1000000000", "--node-cpus", "1", "--nodes", "2", "--serve",
                 timeout=2 * CALL_TIMEOUT).stdout
    assert re.search(r"^healing \(loss met to the pass run again\): [\d.]+ / ", out, re.M), out
    assert re.search(r"^  bound: the moved layers loaded [\d.]+ / ", out, re.M), out
    assert re.search(r"positions rebuilt \[\d+\]; text as one process's: True$", out.strip()), out


@pytest.mark.slow
@needs_cgroups
def test_cluster_streams_holds_streaming_nodes_against_one_process(tiny_q8):
    from support.ray_local import usable
    if usable():
        pytest.skip(usable())
    # ds2-tiny's resident part is mostly the working margin (370 MB): nodes of 700 MB stream it
    out = python("cluster_streams.py", str(tiny_q8), "--node-memory", "700M", "--one-limit", "1G", "--one-budget",
                 "380M", "--tokens", "4", "--pairs", "1", "--node-cpus", "1", timeout=2 * CALL_TIMEOUT).stdout
    assert re.search(r"cluster / one: median [\d.]+ ", out) and "text as the reference: cluster True, one True" in out, out
    assert out.startswith("placement of tiny-q8") and "oom_kill [0, 0]" in out, out


@pytest.mark.slow
@needs_cgroups
def test_stream_run_alternates_streamed_and_mapped_under_a_limit(tiny_q8, budget, tmp_path):
    one = run("bench/stream_one.sh", "2G", f"budget:{budget}", "3", str(tmp_path / "one"), MODEL=str(tiny_q8))
    assert re.match(r"budget:\d+: 3 steps after 9 tokens", one.stdout) and "oom_kill 0" in one.stdout
    out = run("bench/stream_run.sh", str(tiny_q8), str(tmp_path / "run"), "2", "3", LIMITS=f"2G:{budget}").stdout
    assert "held to 2G: step median (s) by round; every run gave the same ids" in out, out
    assert re.search(r"mapped / streamed: [\d.]+x [\d.]+x$", out.strip()), out
    assert sorted(p.name for p in (tmp_path / "run").glob("*.json")) == [
        "r1-2G-mapped.json", "r1-2G-streamed.json", "r2-2G-mapped.json", "r2-2G-streamed.json"]


@pytest.mark.slow
def test_unlimited_ab_rotates_the_trees_round_by_round(tiny_q8):
    out = run("bench/unlimited_ab.sh", "2", str(tiny_q8), ".", str(ROOT), STEPS="2", CONTEXT="8").stdout.splitlines()
    order = [re.match(r"round \d, (.*): decode step [\d.]+ s$", line).group(1) for line in out[:4]]
    assert order == [".", str(ROOT), str(ROOT), "."]
    assert re.fullmatch(r"\.: [\d.]+ [\d.]+", out[4]) and len(out) == 6


@pytest.mark.slow
def test_check_cost_runs_a_checkpoint_with_and_without_its_checksums(tiny_q8, budget, tmp_path):
    out = python("check_cost.py", str(tiny_q8), str(tmp_path), "--budget", budget, "--tokens", "3", "--pairs", "1").stdout
    assert re.search(r"checked/unchecked median [\d.]+ ", out), out
    index = json.loads((tmp_path / "checked" / "model.safetensors.index.json").read_text())
    assert index["checksums"] == json.loads((tiny_q8 / "model.safetensors.index.json").read_text())["checksums"]
    assert "checksums" not in json.loads((tmp_path / "unchecked" / "model.safetensors.index.json").read_text())


@pytest.mark.slow
def test_plan_cost_times_a_plan_with_each_count_of_helpers():
    out = python("plan_cost.py", "--plans", "20", "--helpers", "2").stdout.splitlines()
    assert re.match(r"a 384x1024 q8 product, 20 plans, \d+ cores here: the product alone [\d.]+ us", out[0])
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2"] and all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)


@pytest.mark.slow
def test_make_lite_makes_the_synthetic_shape_and_its_copy(tmp_path):
    """One layer (the smallest the script takes: about 1 GB of bf16), its 8-bit copy only."""
    out = run("bench/make_lite.sh", str(tmp_path), "1", BITS="8", timeout=600).stdout.split()
    assert out == [str(tmp_path / "lite1-q8")]
    copy = open_model(out[0])
    assert copy.stored is not None and copy.config.num_hidden_layers == 1 and copy.config.hidden_size == 2048
