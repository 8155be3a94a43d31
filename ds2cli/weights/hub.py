"""Hugging Face model ids where a directory would go: `-m deepseek-ai/DeepSeek-V2-Lite-Chat[@rev]`.

An id is resolved from the local Hugging Face cache with no network, following huggingface_hub's
own layout (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; then
`models--org--name/refs/<rev>` names the commit and `snapshots/<commit>/` holds the files).
Only when it is not cached, and only if the optional `huggingface_hub` package is installed
(`pip install "ds2cli[hub]"`), is it downloaded, with huggingface_hub's progress bars.
A local directory of the same name always wins.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ds2cli.errors import ConfigError

# org/name as the Hub spells repository ids, with an optional @revision (branch, tag or commit).
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")

# What ds2 reads from a checkpoint; the Hub repository may hold much more (.bin, .pt, docs).
# tiktoken.model is Moonlight's and Kimi-K2's tokenizer (they have no tokenizer.json).
DOWNLOAD_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "tiktoken.model", "model.safetensors.index.json", "*.safetensors"]


def parse_hub_id(spec: str) -> tuple[str, str] | None:
    """'org/name@rev' -> ('org/name', 'rev'); 'org/name' -> ('org/name', 'main'); else None."""
    m = HUB_ID.fullmatch(spec)
    if m is None or ".." in spec or "--" in m["repo"]:
        return None
    return m["repo"], m["revision"] or "main"


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads, by the same environment variables it reads."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo: str, revision: str, cache_dir: Path) -> Path | None:
    """The cached snapshot directory of repo@revision, or None when it is not (fully) there."""
    root = cache_dir / ("models--" + repo.replace("/", "--"))
    commit = revision
    if not COMMIT.fullmatch(revision):
        try:
            commit = (root / "refs" / revision).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
    snapshot = root / "snapshots" / commit
    # an interrupted download can leave a snapshot without its config: treat it as absent
    return snapshot if COMMIT.fullmatch(commit) and (snapshot / "config.json").is_file() else None


def download(repo: str, revision: str, cache_dir: Path) -> Path:
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(f"{repo} is neither a local directory nor in the Hugging Face cache ({cache_dir});"
                          f" to download it, install the hub extra (pip install \"ds2cli[hub]\") or run"
                          f" `hf download {repo}`") from None
    try:
        path = huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                                 allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as e:  # network, authentication, unknown repo: huggingface_hub has many kinds
        # its own text runs on for lines: its first sentence, then where ds2 looked and what to do
        message = " ".join(str(e).split())
        message = (message.split(". ")[0].rstrip(".")[:200] or type(e).__name__)
        offline = " (HF_HUB_OFFLINE is set: huggingface_hub does not download)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise ConfigError(f"{repo} is neither a local directory nor in the Hugging Face cache ({cache_dir}), and "
                          f"downloading {repo}@{revision} failed{offline}: {message}; download it where there is "
                          f"a network (`hf download {repo}`) or pass a local directory") from None
    return Path(path)


def resolve_model_dir(path: str | Path) -> Path:
    """A local path as given (expanded); a Hub id that is no local path -> its snapshot directory."""
    local = Path(path).expanduser()
    parsed = parse_hub_id(str(path))
    if local.exists() or parsed is None:
        return local
    repo, revision = parsed
    cache_dir = hub_cache_dir()
    return cached_snapshot(repo, revision, cache_dir) or download(repo, revision, cache_dir)
