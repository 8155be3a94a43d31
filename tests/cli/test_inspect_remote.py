"""`ds2 inspect ORG/NAME` for an id whose shards are not cached: the small files are downloaded
into the Hugging Face cache, each shard's header is read by HTTP Range requests, and the report
is the one the downloaded checkpoint gives. `ds2` runs as a subprocess against tests/support/fake_hub.py
through HF_ENDPOINT (huggingface_hub reads it when imported), all on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.fake_hub import COMMIT, FakeHub, header_length

from ds2cli.cli.main import main
from ds2cli.weights.source import bundled_model_dir

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

REPO = "org/tiny"
TINY = bundled_model_dir()
SHARDS = sorted(p.name for p in TINY.glob("*.safetensors"))
SMALL_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json"]
MEMORY = {"DS2_MEMORY_AVAILABLE": "8GB"}   # the report's memory check, the same in every run
NOTE = "(the shards are not downloaded: their headers were read from the Hub; generate and chat download them)\n"


def ds2(tmp_path: Path, hub: FakeHub, *args: str, offline: bool = False) -> subprocess.CompletedProcess:
    """`ds2 ARGS` with the fake Hub as HF_ENDPOINT and a cache and HF_HOME (no token) in tmp_path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_")) and k != "DS2_MODEL" and not k.lower().endswith("_proxy")}
    env |= {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_PROXY": "127.0.0.1", **MEMORY}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "ds2cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def local_report(model_dir: Path) -> tuple[int, dict]:
    r = CliRunner().invoke(main, ["inspect", "--json", str(model_dir)], env=MEMORY)
    return r.exit_code, json.loads(r.stdout)


def snapshot_of(tmp_path: Path) -> Path:
    return tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT


@pytest.fixture
def hub():
    with FakeHub(TINY, REPO) as hub:
        yield hub


def test_inspect_reads_each_shard_header_by_range_and_downloads_only_the_small_files(tmp_path, hub):
    r = ds2(tmp_path, hub, "inspect", "--json", "-m", REPO)
    assert r.returncode == 0, r.stderr
    assert r.stderr.endswith(NOTE)
    remote = json.loads(r.stdout)
    code, local = local_report(TINY)
    assert code == 0
    assert remote.pop("path") == str(snapshot_of(tmp_path)) and local.pop("path") == str(TINY)
    for report, path in ((remote, snapshot_of(tmp_path)), (local, TINY)):   # the copies' commands name it
        for form in report["memory"]["streaming"]:
            assert form.pop("command").startswith(f"ds2 quantize {path} OUT --bits ")
    assert remote == local                  # parameters, dtypes, storage with each file's size, memory, problems

    # the small files are in the Hugging Face cache, no shard is
    assert sorted(p.name for p in snapshot_of(tmp_path).iterdir()) == SMALL_FILES
    # no shard body was fetched: two ranges of each, its header's length and then the header
    for name in SHARDS:
        n = header_length(TINY / name)
        assert [(q.method, q.range) for q in hub.requests_for(name)] == [("GET", "bytes=0-7"),
                                                                         ("GET", f"bytes=8-{7 + n}")]
        assert hub.bytes_sent(name) == 8 + n < (TINY / name).stat().st_size / 100

    # a second inspect needs no network: the headers were kept beside the snapshot
    seen = len(hub.requests)
    r = ds2(tmp_path, hub, "inspect", "--json", "-m", REPO, offline=True)
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    for form in again["memory"]["streaming"]:
        form.pop("command")
    assert again == {**remote, "path": str(snapshot_of(tmp_path))}
    assert len(hub.requests) == seen


def test_a_checkpoint_without_an_index_is_found_in_the_repository_listing(tmp_path):
    single = Path(__file__).parents[1] / "data" / "reference" / "plain_rope_tied_fp16"   # model.safetensors
    with FakeHub(single, REPO) as hub:
        r = ds2(tmp_path, hub, "inspect", "--json", "-m", REPO)
        assert r.returncode == 0, r.stderr
        remote = json.loads(r.stdout)
        n = header_length(single / "model.safetensors")
        assert [q.range for q in hub.requests_for("model.safetensors")] == ["bytes=0-7", f"bytes=8-{7 + n}"]
    code, local = local_report(single)
    assert code == 0 and remote.pop("path") != local.pop("path")
    for report in (remote, local):            # the copies' commands name each one's own path
        for form in report["memory"]["streaming"]:
            assert form.pop("command").startswith("ds2 quantize ")
    assert remote == local


def test_a_header_only_snapshot_is_no_checkpoint_to_generate_from(tmp_path, hub):
    assert ds2(tmp_path, hub, "inspect", "-m", REPO).returncode == 0
    prompt = ["generate", "--chat", "-m", REPO, "What is 2 + 3?", "--temperature", "0"]

    r = ds2(tmp_path, hub, *prompt, offline=True)           # offline: one line, saying what is missing
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {REPO} is in the Hugging Face cache ({tmp_path / 'hub'}) without its "
                               f"safetensors shards ({SHARDS[0]} and 1 more), and downloading {REPO}@main failed "
                               f"(HF_HUB_OFFLINE is set: huggingface_hub does not download): ")

    r = ds2(tmp_path, hub, *prompt)                         # online: the shards are downloaded, then run
    assert r.returncode == 0, r.stderr
    assert r.stdout == "2 + 3 = 5.\n"
    for name in SHARDS:
        assert (snapshot_of(tmp_path) / name).read_bytes() == (TINY / name).read_bytes()

    # and inspect now reads the downloaded shards, with no request
    seen = len(hub.requests)
    r = ds2(tmp_path, hub, "inspect", "--json", "-m", REPO)
    assert r.returncode == 0 and NOTE not in r.stderr
    assert len(hub.requests) == seen


def test_check_downloads_the_shards_first(tmp_path, hub):
    r = ds2(tmp_path, hub, "inspect", "--check", "--json", "-m", REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["check"] == {"tensors_read": 200, "nonfinite_tensors": 0, "stopped": False}
    assert all((snapshot_of(tmp_path) / name).is_file() for name in SHARDS)


def test_offline_and_not_cached_is_one_error_line(tmp_path, hub):
    r = ds2(tmp_path, hub, "inspect", "-m", REPO, offline=True)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {REPO} is neither a local directory nor in the Hugging Face cache "
                               f"({tmp_path / 'hub'}), and downloading {REPO}@main failed (HF_HUB_OFFLINE is set")
    assert hub.requests == []


def test_kept_headers_that_do_not_read_are_read_again(tmp_path, hub):
    """The kept headers are read as untrusted: a broken copy is no copy, and offline that is one
    line naming the headers that could not be read."""
    assert ds2(tmp_path, hub, "inspect", "-m", REPO).returncode == 0
    kept = tmp_path / "hub" / "models--org--tiny" / "ds2-safetensors-headers" / f"{COMMIT}.json"
    kept.write_text('{"format": 1, "shards": {"model-00001-of-00002.safetensors": {"size": 3, "head": "!"}}}')
    r = ds2(tmp_path, hub, "inspect", "-m", REPO, offline=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert (f"and reading the safetensors headers of {REPO}@main failed (HF_HUB_OFFLINE is set: huggingface_hub "
            f"does not download): ") in r.stderr
    r = ds2(tmp_path, hub, "inspect", "-m", REPO)
    assert r.returncode == 0, r.stderr


def test_a_shard_the_hub_lacks_is_reported_as_a_missing_file_is(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(TINY, broken)
    (broken / SHARDS[1]).unlink()
    with FakeHub(broken, REPO) as hub:
        r = ds2(tmp_path, hub, "inspect", "--json", "-m", REPO)
    code, local = local_report(broken)
    assert r.returncode == code == 1
    assert json.loads(r.stdout)["problems"] == local["problems"] == [
        f"model.safetensors.index.json names shards that do not exist: {SHARDS[1]}"]
    assert r.stderr.splitlines()[-1].startswith("error: the checkpoint has 1 problem")


def test_a_server_that_ignores_byte_ranges_is_an_error_not_a_download(tmp_path):
    with FakeHub(TINY, REPO, ignore_ranges=True) as hub:
        r = ds2(tmp_path, hub, "inspect", "-m", REPO)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "answered a byte-range request with HTTP 200" in r.stderr
    assert not any((snapshot_of(tmp_path) / name).exists() for name in SHARDS)
