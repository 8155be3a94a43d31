"""Hugging Face model ids where a directory would go: `-m deepseek-ai/DeepSeek-V2-Lite-Chat[@rev]`.

An id is resolved from the local Hugging Face cache with no network, following huggingface_hub's
own layout (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; then
`models--org--name/refs/<rev>` names the commit and `snapshots/<commit>/` holds the files).
Only when it is not cached, or cached without its safetensors shards, is it downloaded, by
`huggingface_hub` with its progress bars (installed with `tokenizers`, which requires it; the
`hub` extra asks for a version that ships the `hf` command). A local directory of the same name always wins.

`ds2 inspect` reads headers only, so it downloads a Hub id's small files and no shard: it reads
the first bytes of each shard (8 + the header) by HTTP Range requests, and keeps them in the
repository's cache folder for the next inspect, which then needs no network (resolve_headers).
A snapshot so left holds config.json but no shard: missing_shards tells it from a complete one,
and generate downloads the shards then.

Both run in a child process (weights/downloads.py, `fetch` there): a download that stalls ends
after DS2_HUB_IDLE_S seconds with one error, and Ctrl-C ends it at once.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import json
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ds2cli.errors import ConfigError, Ds2Error
from ds2cli.weights import downloads
from ds2cli.json_files import JSON_ERRORS
from ds2cli.wording import human_bytes, install_hint

# org/name as the Hub spells repository ids, with an optional @revision (branch, tag or commit).
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")

# What ds2 reads from a checkpoint; the Hub repository may hold much more (.bin, .pt, docs).
# tiktoken.model is Moonlight's and Kimi-K2's tokenizer (they have no tokenizer.json).
DOWNLOAD_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "tiktoken.model", "model.safetensors.index.json", "*.safetensors"]
# What `ds2 inspect` downloads: all but the shards, whose headers it reads over HTTP instead.
HEADER_PATTERNS = [p for p in DOWNLOAD_PATTERNS if p != "*.safetensors"]
INDEX_NAME = "model.safetensors.index.json"     # checkpoint.INDEX_NAME (hub sits below checkpoint)
HEADS_DIR = "ds2-safetensors-headers"           # in models--org--name/, beside huggingface_hub's trees/
HEADS_FORMAT = 1
HEAD_WORKERS = 8            # shards read at once, as many as snapshot_download downloads at once
MAX_REMOTE_SHARDS = 4096    # two requests a shard: an index naming more is refused (DeepSeek-V3 has 163)
CONTENT_RANGE = re.compile(r"bytes (?:\d+-\d+|\*)/(\d+)")


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
    """The cached snapshot directory of repo@revision, or None when it is not there; whether it
    holds its shards is missing_shards' question."""
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


def snapshot_id(path: Path) -> str | None:
    """The Hub id a cached snapshot directory (models--org--name/snapshots/<commit>) stands for,
    to name the model in messages as the user names it: 'org/name' when refs/main names the
    commit, else 'org/name@<commit>' (both resolve to this snapshot); None for any other path."""
    root = path.parent.parent
    parts = root.name.split("--")
    if not (COMMIT.fullmatch(path.name) and path.parent.name == "snapshots" and len(parts) == 3
            and parts[0] == "models" and parse_hub_id(f"{parts[1]}/{parts[2]}")):
        return None
    repo = f"{parts[1]}/{parts[2]}"
    try:
        main = (root / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        main = None
    return repo if main == path.name else f"{repo}@{path.name}"


def index_shards(snapshot: Path) -> list[str] | None:
    """The shard files model.safetensors.index.json names (None: no index). An unreadable index
    names none: checkpoint.find_shards reports it, as it reports names that are no file names."""
    index = snapshot / INDEX_NAME
    if not index.is_file():
        return None
    try:
        names = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        return sorted({n for n in names if isinstance(n, str) and n.endswith(".safetensors")
                       and Path(n).name == n})
    except (OSError, *JSON_ERRORS, KeyError, TypeError, AttributeError):
        return []


def missing_shards(snapshot: Path) -> list[str]:
    """The shards a cached snapshot lacks: those its index names that are not there, or, with no
    index, model.safetensors when no *.safetensors file is. `ds2 inspect` leaves a snapshot with
    every file but its shards: generate must download them, not take it for a checkpoint."""
    names = index_shards(snapshot)
    if names is None:
        return [] if any(p.is_file() for p in snapshot.glob("*.safetensors")) else ["model.safetensors"]
    return [n for n in names if not (snapshot / n).is_file()]


def not_found(repo: str, cache_dir: Path, missing: list[str]) -> str:
    """Where ds2 looked, as an error's first words."""
    if not missing:
        return f"{repo} is neither a local directory nor in the Hugging Face cache ({cache_dir})"
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (f"{repo} is in the Hugging Face cache ({cache_dir}) without its safetensors shards "
            f"({missing[0]}{more})")


def failed(where: str, action: str, repo: str, reason: str) -> ConfigError:
    """One line: where ds2 looked, what failed and why, what to do."""
    offline = " (HF_HUB_OFFLINE is set: huggingface_hub does not download)" if hub_offline() else ""
    return ConfigError(f"{where}, and {action} failed{offline}: {reason}; download it where there is "
                       f"a network (`hf download {repo}`) or pass a local directory")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it: 1, ON, YES or TRUE; 0 or empty is not offline."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def first_sentence(e: Exception) -> str:
    """huggingface_hub's error text runs on for lines: its first sentence."""
    message = " ".join(str(e).split()).split(". ")[0].rstrip(".")
    return (message[:200] + "..." if len(message) > 200 else message) or type(e).__name__


def download(repo: str, revision: str, cache_dir: Path, patterns: list[str], where: str,
             heads_limit: int | None = None) -> tuple[Path, RemoteShards | None]:
    """huggingface_hub's snapshot_download of `patterns` into the cache, in a child process
    (weights/downloads.py: a stall ends it after DS2_HUB_IDLE_S, Ctrl-C at once); with
    `heads_limit`, also the shards' heads read over HTTP there (fetch_heads). Any failure is one
    ConfigError starting with `where`."""
    if importlib.util.find_spec("huggingface_hub") is None:
        raise ConfigError(f"{where}; to download it, {install_hint('hub', 'huggingface_hub')};"
                          f" or run `hf download {repo}`")
    job = {"repo": repo, "revision": revision, "cache_dir": str(cache_dir), "patterns": patterns,
           "heads_limit": heads_limit}
    actions = {"download": f"downloading {repo}@{revision}",
               "heads": f"reading the safetensors headers of {repo}@{revision}"}
    try:
        result = downloads.run("ds2cli.weights.hub:fetch", job, downloads.idle_seconds())
    except downloads.Stalled as e:
        raise failed(where, actions.get(e.doing, actions["download"]), repo, str(e)) from None
    except downloads.ChildError as e:   # network, authentication, unknown repo: huggingface_hub has many kinds
        raise failed(where, actions["download"], repo, first_sentence(e)) from None
    if "heads_error" in result:         # the network, offline mode, a server that ignores byte ranges
        raise failed(where, actions["heads"], repo, result["heads_error"])
    heads = result.get("heads")
    shards = None if heads is None else RemoteShards(
        {name: (size, base64.b64decode(head)) for name, (size, head) in heads.items()})
    return Path(result["snapshot"]), shards


def fetch(job: dict, meter: downloads.Meter) -> dict:
    """The child's side of `download`: the snapshot's path, and with a heads_limit the shards'
    heads (base64) or why they could not be read, every byte metered."""
    import huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled, get_session, logging

    logging.set_verbosity_error()           # its retry warnings: the one error line is the parent's
    meter.shows_progress = not are_progress_bars_disabled()
    downloads.meter_session(get_session(), meter)
    meter.doing = "download"
    path = huggingface_hub.snapshot_download(job["repo"], revision=job["revision"], cache_dir=job["cache_dir"],
                                             allow_patterns=job["patterns"])
    if job["heads_limit"] is None:
        return {"snapshot": str(path)}
    meter.doing = "heads"
    try:
        shards = fetch_heads(job["repo"], Path(path), job["heads_limit"])
    except Ds2Error:
        raise
    except Exception as e:  # noqa: BLE001 - the network, offline mode, a server that ignores byte ranges
        return {"snapshot": str(path), "heads_error": first_sentence(e)}
    return {"snapshot": str(path), "heads": {name: (size, base64.b64encode(head).decode("ascii"))
                                             for name, (size, head) in shards.heads.items()}}


def resolve_model_dir(path: str | Path) -> Path:
    """A local path as given (expanded); a Hub id that is no local path -> its snapshot directory,
    downloaded when it, or any of its shards, is not cached."""
    local = Path(path).expanduser()
    parsed = parse_hub_id(str(path))
    if local.exists() or parsed is None:
        return local
    repo, revision = parsed
    cache_dir = hub_cache_dir()
    snapshot = cached_snapshot(repo, revision, cache_dir)
    missing = [] if snapshot is None else missing_shards(snapshot)
    if snapshot is not None and not missing:
        return snapshot
    snapshot, _ = download(repo, revision, cache_dir, DOWNLOAD_PATTERNS, not_found(repo, cache_dir, missing))
    missing = missing_shards(snapshot)
    if missing:     # offline, huggingface_hub may hand back the snapshot as it found it
        raise failed(not_found(repo, cache_dir, missing), f"downloading {repo}@{revision}", repo,
                     "the snapshot huggingface_hub returned lacks them")
    return snapshot


# ---- headers only, for `ds2 inspect` ----

class RemoteShards:
    """A Hub snapshot's shards, not downloaded, as checkpoint.find_shards and read_header ask
    about a folder's files (checkpoint.Shards): each one's size and first bytes, 8 + the header.
    open gives those bytes and no more: no tensor data can be read through it."""

    def __init__(self, heads: dict[str, tuple[int, bytes]]):
        self.heads = heads          # shard name -> (file size, its first 8 + header-length bytes)

    def names(self) -> list[str]:
        return sorted(self.heads)

    def exists(self, name: str) -> bool:
        return name in self.heads

    def size(self, name: str) -> int:
        return self.heads[name][0]

    def open(self, name: str) -> io.BytesIO:
        return io.BytesIO(self.heads[name][1])


def resolve_headers(path: str | Path, max_header_bytes: int) -> tuple[Path, RemoteShards | None]:
    """resolve_model_dir for `ds2 inspect`, which reads headers, never tensor data: a Hub id whose
    shards are not cached -> its snapshot directory with every file but the shards
    (HEADER_PATTERNS), and the shards' heads, read over HTTP, or with no network from the copy an
    earlier inspect kept. Anything else resolves as resolve_model_dir does, with None: its shards
    are on disk."""
    local = Path(path).expanduser()
    parsed = parse_hub_id(str(path))
    if local.exists() or parsed is None:
        return local, None
    repo, revision = parsed
    cache_dir = hub_cache_dir()
    snapshot = cached_snapshot(repo, revision, cache_dir)
    missing = [] if snapshot is None else missing_shards(snapshot)
    if snapshot is not None and not missing:
        return snapshot, None
    shards = None if snapshot is None else read_heads(snapshot)
    if shards is None:
        where = not_found(repo, cache_dir, missing)
        snapshot, shards = download(repo, revision, cache_dir, HEADER_PATTERNS, where, max_header_bytes)
        save_heads(snapshot, shards)
    return snapshot, shards


def fetch_heads(repo: str, snapshot: Path, limit: int) -> RemoteShards:
    """The heads of the shards the index names, or with no index of every *.safetensors file
    of the repository; a shard the Hub does not have is left out, as a missing file is from a
    folder (checkpoint.find_shards reports it). No header longer than `limit` is asked for."""
    import huggingface_hub

    commit = snapshot.name
    names = index_shards(snapshot)
    if names is None:
        names = [f for f in huggingface_hub.list_repo_files(repo, revision=commit)
                 if f.endswith(".safetensors") and "/" not in f]
    if len(names) > MAX_REMOTE_SHARDS:
        raise ConfigError(f"{repo} has {len(names)} safetensors shards; ds2 inspect reads the headers of at "
                          f"most {MAX_REMOTE_SHARDS} over the network: download it (`hf download {repo}`) "
                          f"and inspect its directory")
    urls = [huggingface_hub.hf_hub_url(repo, name, revision=commit) for name in names]
    budget = Budget(max(limit, HEADS_TOTAL_BYTES), time.monotonic() + HEADS_DEADLINE_S)
    with ThreadPoolExecutor(HEAD_WORKERS) as pool:
        heads = list(pool.map(lambda url: read_head(url, limit, budget), urls))
    return RemoteShards({name: head for name, head in zip(names, heads) if head is not None})


# All the shards' headers together: a real model's are a few MB (V3's 163 shards: 9 MB), so a
# repository that claims more is refused before it is read; and all of them within one deadline,
# so that a server that drips a byte a second ends the command instead of holding it forever
# (huggingface_hub's timeout is per read).
HEADS_TOTAL_BYTES = 200 << 20
HEADS_DEADLINE_S = 120.0


class Budget:
    """What the shard heads of one inspect may still take: bytes, and time until `deadline`."""

    def __init__(self, nbytes: int, deadline: float):
        self.left, self.deadline, self.lock = nbytes, deadline, threading.Lock()

    def take(self, n: int, url: str) -> None:
        with self.lock:
            if n > self.left:
                raise ConfigError(f"the shards' safetensors headers add up to more than "
                                  f"{human_bytes(HEADS_TOTAL_BYTES)} (at {url.rsplit('/', 1)[-1]}): "
                                  f"not a checkpoint ds2 reads over the network")
            self.left -= n

    def check(self, url: str) -> None:
        if time.monotonic() > self.deadline:
            raise OSError(f"reading the safetensors headers took more than {HEADS_DEADLINE_S:.0f} s "
                          f"(at {url.rsplit('/', 1)[-1]})")


def read_head(url: str, limit: int, budget: Budget | None = None) -> tuple[int, bytes] | None:
    """(file size, first 8 + header-length bytes) of the safetensors file at `url`, in two Range
    requests (None: the Hub has no such file). The length is asked for only when it fits the
    file and `limit`; otherwise checkpoint.read_header reports it from the 8 bytes alone."""
    first = read_range(url, 0, 8, budget)
    if first is None:
        return None
    size, head = first
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    if 0 < n <= min(size - 8, limit):
        if budget is not None:
            budget.take(n, url)
        head += read_range(url, 8, 8 + n, budget)[1]
    return size, head


def read_range(url: str, start: int, stop: int, budget: Budget | None = None,
               session=None) -> tuple[int, bytes] | None:
    """Bytes [start, stop) of the file at `url` and the file's size (Content-Range's total), with
    huggingface_hub's session (or `session`, which has its `stream`), token and timeout; None on
    404. The body is cut at stop - start bytes: a server that ignores the range is an error, not
    a shard downloaded whole."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session

    headers = {**build_hf_headers(), "Range": f"bytes={start}-{stop - 1}", "Accept-Encoding": "identity"}
    session = get_session() if session is None else session
    with session.stream("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if r.status_code == 404:
            return None
        total = CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", ""))
        if r.status_code not in (206, 416) or total is None:
            raise OSError(f"{url} answered a byte-range request with HTTP {r.status_code}"
                          + ("" if total else " and no Content-Range"))
        data = bytearray()
        for chunk in r.iter_bytes() if r.status_code == 206 else ():
            data += chunk
            if len(data) >= stop - start:
                break
            if budget is not None:
                budget.check(url)
    return int(total[1]), bytes(data[:stop - start])


def heads_file(snapshot: Path) -> Path:
    """Where ds2 keeps a snapshot's shard heads: in the repository's cache folder, beside
    huggingface_hub's own trees/ and .no_exist/, a file a commit, so that deleting the repository
    from the cache deletes them too."""
    return snapshot.parent.parent / HEADS_DIR / f"{snapshot.name}.json"


def save_heads(snapshot: Path, shards: RemoteShards) -> None:
    """Written beside and renamed, so that a reader never sees half a file; a cache that cannot be
    written is no error (the next inspect reads the headers over the network again)."""
    path = heads_file(snapshot)
    record = {"format": HEADS_FORMAT,
              "shards": {name: {"size": size, "head": base64.b64encode(head).decode("ascii")}
                         for name, (size, head) in shards.heads.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.chmod(tmp, 0o644)    # mkstemp's 0600 would hide it from other users of a shared cache
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def read_heads(snapshot: Path) -> RemoteShards | None:
    """What save_heads kept, read as untrusted: anything malformed is no record (checkpoint parses
    and bounds-checks the heads themselves, as it does a file's)."""
    try:
        record = json.loads(heads_file(snapshot).read_text(encoding="utf-8"))
        if record["format"] != HEADS_FORMAT:
            return None
        heads = {name: (e["size"], base64.b64decode(e["head"], validate=True))
                 for name, e in record["shards"].items()}
    except (OSError, *JSON_ERRORS, KeyError, TypeError, AttributeError):   # bad base64 is a ValueError
        return None
    ok = all(isinstance(name, str) and type(size) is int and size >= len(head)
             for name, (size, head) in heads.items())
    return RemoteShards(heads) if ok else None
