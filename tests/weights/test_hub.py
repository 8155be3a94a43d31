"""Hugging Face ids for -m: resolved from a fake local cache; downloads from tests/support/fake_hub.py on
127.0.0.1 (HF_ENDPOINT), never the network."""

import fnmatch
import shutil
import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.fake_hub import COMMIT as HUB_COMMIT
from support.fake_hub import FakeHub

from ds2cli.cli.main import main
from ds2cli.errors import ConfigError
from ds2cli.weights.hub import DOWNLOAD_PATTERNS, hub_cache_dir, parse_hub_id, resolve_model_dir
from ds2cli.weights.source import bundled_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def fake_cache(root: Path, repo: str = "deepseek-ai/DeepSeek-V2-Lite-Chat", refs=None) -> Path:
    """huggingface_hub's layout: refs/<name> holds a commit, snapshots/<commit>/ holds the files."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    for ref, commit in (refs or {"main": COMMIT}).items():
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
        shutil.copytree(bundled_model_dir(), repo_dir / "snapshots" / commit, dirs_exist_ok=True)
    return repo_dir


@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)             # relative ids must not find a directory by accident
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # "not installed" unless a test says so
    return monkeypatch


def test_parse_hub_id():
    assert parse_hub_id("deepseek-ai/DeepSeek-V2-Lite-Chat") == ("deepseek-ai/DeepSeek-V2-Lite-Chat", "main")
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for not_an_id in ("/abs/path", "./rel/dir", "~/models/x", "one", "a/b/c", "org/../x", "org/name@../../etc",
                      "org/na--me"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_cache_dir_follows_huggingface_hub_variables(hf_env, tmp_path):
    hf_env.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    hf_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    hf_env.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_resolves_refs_revisions_and_commits_from_the_cache(hf_env, tmp_path):
    hf_env.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = fake_cache(tmp_path / "hf" / "hub", refs={"main": COMMIT, "v2": OTHER})
    assert resolve_model_dir("deepseek-ai/DeepSeek-V2-Lite-Chat") == repo / "snapshots" / COMMIT
    assert resolve_model_dir("deepseek-ai/DeepSeek-V2-Lite-Chat@v2") == repo / "snapshots" / OTHER
    assert resolve_model_dir(f"deepseek-ai/DeepSeek-V2-Lite-Chat@{OTHER}") == repo / "snapshots" / OTHER


def test_a_local_directory_of_the_same_name_wins(hf_env, tmp_path):
    hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    fake_cache(tmp_path / "cache")
    local = Path("deepseek-ai/DeepSeek-V2-Lite-Chat")
    local.mkdir(parents=True)
    assert resolve_model_dir("deepseek-ai/DeepSeek-V2-Lite-Chat") == local


def test_not_cached_without_huggingface_hub_says_how_to_get_it(hf_env, tmp_path):
    hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    r = CliRunner().invoke(main, ["generate", "-m", "org/missing", "hi"])
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: org/missing is neither a local directory")
    assert "pip install 'ds2cli[hub]' (from a clone: pip install '.[hub]')" in r.stderr
    assert "hf download org/missing" in r.stderr


def test_install_hints_work_from_an_index_and_from_a_clone():
    from ds2cli.generation.grammar import INSTALL_HINT
    from ds2cli.wording import install_hint
    assert install_hint("grammar", "llguidance") == \
        "pip install 'ds2cli[grammar]' (from a clone: pip install '.[grammar]'), or pip install llguidance"
    assert INSTALL_HINT.endswith(install_hint("grammar", "llguidance"))


def test_huggingface_hub_comes_with_tokenizers_as_the_docs_say():
    """README and docs/models.md say downloads need no extra: tokenizers requires huggingface_hub."""
    from importlib.metadata import requires
    assert any(r.replace("_", "-").startswith("huggingface-hub") for r in requires("tokenizers"))


def test_a_snapshot_without_config_counts_as_not_cached(hf_env, tmp_path):
    hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    repo = fake_cache(tmp_path / "cache", repo="org/partial")
    (repo / "snapshots" / COMMIT / "config.json").unlink()
    with pytest.raises(ConfigError, match="neither a local directory nor in the Hugging Face cache"):
        resolve_model_dir("org/partial")


@pytest.fixture
def hub(hf_env, tmp_path):
    """tests/support/fake_hub.py serving ds2-tiny as org/tiny, through HF_ENDPOINT, to the real
    huggingface_hub (un-hidden), which downloads in a child process (weights/downloads.py)."""
    hf_env.delitem(sys.modules, "huggingface_hub")
    hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    hf_env.setenv("HF_HOME", str(tmp_path / "hf-home"))
    hf_env.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_env.setenv("NO_PROXY", "127.0.0.1")
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        hf_env.delenv(name, raising=False)
    with FakeHub(bundled_model_dir(), "org/tiny") as fake:
        hf_env.setenv("HF_ENDPOINT", fake.url)
        yield fake


@pytest.mark.slow
def test_not_cached_downloads_through_huggingface_hub(hub, tmp_path):
    r = CliRunner().invoke(main, ["generate", "--chat", "-m", "org/tiny@main", "What is 2 + 3?",
                                  "--temperature", "0"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "2 + 3 = 5.\n"
    snapshot = tmp_path / "cache" / "models--org--tiny" / "snapshots" / HUB_COMMIT
    wanted = [f for f in hub.files if any(fnmatch.fnmatch(f, p) for p in DOWNLOAD_PATTERNS)]
    assert sorted(p.name for p in snapshot.iterdir()) == wanted and "README.md" not in wanted
    asked = len(hub.requests)
    r = CliRunner().invoke(main, ["inspect", "--json", "-m", "org/tiny"])     # now cached: no second download
    assert r.exit_code == 0 and len(hub.requests) == asked


def test_what_is_downloaded_is_what_ds2_reads():
    assert "*.safetensors" in DOWNLOAD_PATTERNS
    assert "tiktoken.model" in DOWNLOAD_PATTERNS            # Moonlight's / Kimi-K2's tokenizer


@pytest.mark.slow
def test_a_failed_download_is_one_error_line(hub, hf_env, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as s:       # a port nothing listens on
        hf_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    r = CliRunner().invoke(main, ["chat", "-m", "org/offline"], input="hi\n")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: org/offline is neither a local directory nor in the Hugging Face cache "
                               f"({tmp_path / 'cache'}), and downloading org/offline@main failed: "), r.stderr
    assert r.stderr.endswith("; download it where there is a network (`hf download org/offline`) or pass a "
                             "local directory\n")
    hf_env.setenv("HF_HUB_OFFLINE", "1")          # the variable that stops huggingface_hub is named
    r = CliRunner().invoke(main, ["chat", "-m", "org/offline"], input="hi\n")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "HF_HUB_OFFLINE is set" in r.stderr


@pytest.mark.slow
def test_a_snapshot_without_its_shards_is_downloaded_again(hub, tmp_path):
    """`ds2 inspect` leaves a snapshot with config.json and no shard (tests/cli/test_inspect_remote.py):
    generate must download the shards, not take it for a checkpoint."""
    snapshot = fake_cache(tmp_path / "cache", repo="org/tiny", refs={"main": HUB_COMMIT}) / "snapshots" / HUB_COMMIT
    for shard in snapshot.glob("*.safetensors"):
        shard.unlink()
    assert resolve_model_dir("org/tiny") == snapshot
    assert all(hub.bytes_sent(p.name) == p.stat().st_size for p in snapshot.glob("*.safetensors"))
    asked = len(hub.requests)
    assert resolve_model_dir("org/tiny") == snapshot and len(hub.requests) == asked     # now whole


@pytest.mark.slow
def test_a_snapshot_huggingface_hub_hands_back_without_shards_is_one_error_line(hub, hf_env, tmp_path):
    """Offline, huggingface_hub returns a cached snapshot as it found it: the shards still missing
    are named, not left for the loader to stumble on."""
    hf_env.setenv("HF_HUB_OFFLINE", "1")
    snapshot = fake_cache(tmp_path / "cache", repo="org/tiny") / "snapshots" / COMMIT
    for shard in snapshot.glob("*.safetensors"):
        shard.unlink()
    r = CliRunner().invoke(main, ["generate", "-m", "org/tiny", "hi"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1
    assert r.stderr == (f"error: org/tiny is in the Hugging Face cache ({tmp_path / 'cache'}) without its safetensors "
                        f"shards (model-00001-of-00002.safetensors and 1 more), and downloading org/tiny@main failed "
                        f"(HF_HUB_OFFLINE is set: huggingface_hub does not download): the snapshot huggingface_hub "
                        f"returned lacks them; download it where there is a network (`hf download org/tiny`) or pass "
                        f"a local directory\n")
    assert hub.requests == []


@pytest.mark.slow
def test_the_memory_check_names_a_hub_model_by_its_id(hf_env, tmp_path):
    """The memory check's error names the id, not the snapshot's commit, and suggests a quantize
    command with the id as SRC, which runs; a revision other than main is named by its commit."""
    hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    fake_cache(tmp_path / "cache", refs={"main": COMMIT, "v2": OTHER})
    hf_env.setenv("DS2_MEMORY_AVAILABLE", "390MB")   # ds2-tiny: float32 needs 0.40 GB, its 8-bit copy 0.38
    repo = "deepseek-ai/DeepSeek-V2-Lite-Chat"
    for given, named in ((repo, repo), (f"{repo}@v2", f"{repo}@{OTHER}")):
        r = CliRunner().invoke(main, ["generate", "-m", given, "hi"])
        assert r.exit_code == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"error: {named} (") and "as float32" in r.stderr, r.stderr
        assert f"ds2 quantize {named} OUT --bits 8 makes" in r.stderr and "snapshots" not in r.stderr
    r = CliRunner().invoke(main, ["quantize", repo, str(tmp_path / "OUT"), "--bits", "8"])
    assert r.exit_code == 0 and (tmp_path / "OUT" / "config.json").is_file(), r.stderr
