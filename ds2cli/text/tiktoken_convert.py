"""tiktoken.model (Moonlight, Kimi-K2) -> the same tokenizer as a `tokenizers` byte-level BPE, cached.

Moonshot ships its tokenizer as `tiktoken.model` (one `base64(token bytes) rank` per line) plus
Python code that ds2 never runs (`tokenization_moonshot.py`, `tokenization_kimi.py`). What that
code adds to the file is three things, rebuilt here:
- the split pattern (`pat_str`, below verbatim), which the `tokenizers` Split pre-tokenizer runs
  with Oniguruma; every construct of it is one Oniguruma understands (`&&` class intersection,
  `\\p{Han}`, `(?i:...)`, `(?!\\S)`), and tests/text/test_tiktoken.py proves the split by comparing ids
  with tiktoken itself;
- the special tokens: 256 reserved ids right after the base ranks, named by tokenizer_config.json's
  `added_tokens_decoder` and `<|reserved_token_{id}|>` where it names none;
- the BPE itself. tiktoken keeps only ranks: a piece that is a whole token is that token, else
  the adjacent pair whose concatenation has the lowest rank is merged, again and again. The
  equivalent `tokenizers` BPE has one merge per token, the pair tiktoken's own loop ends with when
  run over that token's bytes (`merge_pair`), in rank order, and `ignore_merges` for the
  whole-token lookup. Inside a longer piece tiktoken forms a token from exactly that pair too:
  the merges within the token's span depend only on the bytes in it, and come in the same order.

The conversion takes seconds (2-3 s at 100k ranks), so its tokenizer.json is kept in ds2's own
cache (`$XDG_CACHE_HOME/ds2/tokenizers`, else `~/.cache/ds2/tokenizers`, or `$DS2_TOKENIZER_CACHE`),
under a hash of everything it was built from; never in the model directory unless
DS2_TOKENIZER_CACHE points there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import json
import os
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from ds2cli.json_files import read_json_object
from ds2cli.errors import TokenizerError

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CACHE_ENV = "DS2_TOKENIZER_CACHE"

# `TikTokenTokenizer.pat_str` of Moonlight-16B-A3B's tokenization_moonshot.py, identical in Kimi-K2's
# tokenization_kimi.py: Han runs on their own, case-aware letter runs without Han (`&&[^\p{Han}]`)
# with English contractions, digits in groups of 1-3, punctuation runs, then whitespace.
MOONSHOT_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# tokenization_moonshot.py's `num_reserved_special_tokens`: Moonlight's 163,584 ranks + 256 = its
# vocab_size of 163,840.
NUM_RESERVED_SPECIAL_TOKENS = 256

# The bytes UTF-8 text can contain (not 0xc0, 0xc1, 0xf5-0xff): each must be a token of its own.
UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]

# Part of the cache key: bump it when the conversion's output changes for the same input.
CONVERTER_VERSION = 1

# What a line of tiktoken.model may hold: real vocabularies have tokens of at most a few hundred
# bytes and ranks of six digits.
MAX_TOKEN_BYTES = 4096
MAX_RANK_DIGITS = 12


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char -> byte: printable bytes stand for themselves, the
    others are shifted to 256 + n (the table `tokenizers.decoders.ByteLevel` inverts)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def has_tiktoken(model_dir: Path) -> bool:
    return (Path(model_dir) / TIKTOKEN_FILE).is_file()


def load_backend(model_dir: Path) -> tokenizers.Tokenizer:
    """The converted tokenizer of `model_dir`/tiktoken.model, from the cache when it was built
    before. The cache is read as untrusted: an entry that does not load (truncated, edited) is
    converted again and replaced."""
    path = cached_tokenizer_json(model_dir)
    if path is None:        # no writable cache: convert in memory, every time
        return convert(model_dir)
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception:       # tokenizers raises its own Exception type for a corrupt file
        path = cached_tokenizer_json(model_dir, rebuild=True)
        return convert(model_dir) if path is None else tokenizers.Tokenizer.from_file(str(path))


def cached_tokenizer_json(model_dir: Path, rebuild: bool = False) -> Path | None:
    """Where the converted tokenizer.json is kept (written now if it is not yet, or again with
    `rebuild`), or None when no cache directory is writable."""
    path = cache_dir() / f"{cache_key(model_dir)}.json"
    if path.is_file() and not rebuild:
        return path         # the same bytes were checked and converted before
    backend = convert(model_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: two ds2 processes converting at once each rename a whole file into place.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-", suffix=".json")
        os.close(fd)
        backend.save(tmp)
        os.chmod(tmp, 0o644)    # mkstemp's 0600 would hide it from other users of a shared cache
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def cache_dir() -> Path:
    """ds2's own cache, as the bench's (~/.cache/ds2), honouring XDG_CACHE_HOME."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "ds2" / "tokenizers"


def cache_key(model_dir: Path) -> str:
    """A hash of everything the conversion reads: tiktoken.model's bytes, the added tokens, the
    pattern and this converter's version (hashing is milliseconds; parsing 160k lines is not)."""
    digest = hashlib.sha256(_read(Path(model_dir) / TIKTOKEN_FILE))
    added = _tokenizer_config(model_dir).get("added_tokens_decoder")
    digest.update(json.dumps([CONVERTER_VERSION, MOONSHOT_PATTERN, added], sort_keys=True).encode())
    return digest.hexdigest()[:32]


def convert(model_dir: Path) -> tokenizers.Tokenizer:
    """Read, check and convert `model_dir`'s tiktoken.model and tokenizer_config.json."""
    path = Path(model_dir) / TIKTOKEN_FILE
    ranks = parse_ranks(_read(path), path)
    return build(ranks, special_tokens(_tokenizer_config(model_dir), len(ranks)))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e.strerror}") from None


def _tokenizer_config(model_dir: Path) -> dict:
    path = Path(model_dir) / TOKENIZER_CONFIG_FILE
    return read_json_object(path, TokenizerError) if path.is_file() else {}


def parse_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """tiktoken.model's lines -> {token bytes: rank}; ranks must be 0..n-1, each token once, and
    every byte UTF-8 uses a token (else some text has no encoding). Errors name the line."""
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue            # tiktoken skips empty lines too
        fields = line.split()
        if len(fields) != 2:
            raise TokenizerError(f"{path} line {number}: expected 'base64-token rank', got {len(fields)} fields")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{path} line {number}: {_shown(fields[0])} is not valid base64") from None
        if not fields[1].isdigit():
            raise TokenizerError(f"{path} line {number}: rank {_shown(fields[1])} is not a non-negative integer")
        if len(fields[1]) > MAX_RANK_DIGITS:
            raise TokenizerError(f"{path} line {number}: rank {_shown(fields[1])} has more digits than any "
                                 f"vocabulary needs")
        rank = int(fields[1])
        if not token:
            raise TokenizerError(f"{path} line {number}: the token is empty")
        if len(token) > MAX_TOKEN_BYTES:
            raise TokenizerError(f"{path} line {number}: a token of {len(token)} bytes; tokens are at most "
                                 f"{MAX_TOKEN_BYTES} bytes")
        if token in ranks:
            raise TokenizerError(f"{path} line {number}: token {token!r} already has rank {ranks[token]}")
        if rank in line_of_rank:
            raise TokenizerError(f"{path} line {number}: rank {rank} is already used on line {line_of_rank[rank]}")
        ranks[token] = rank
        line_of_rank[rank] = number
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens")
    if max(line_of_rank) != len(ranks) - 1:
        gap = min(set(range(len(ranks))) - line_of_rank.keys())
        after = max((r for r in line_of_rank if r < gap), default=None)
        where = f" (after line {line_of_rank[after]})" if after is not None else ""
        raise TokenizerError(f"{path}: rank {gap} is missing{where}: ranks must run 0..{len(ranks) - 1} "
                             f"without gaps, the ids the model's embedding rows are")
    missing = [b for b in UTF8_BYTES if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} single bytes are not tokens (first 0x{missing[0]:02x}): "
                             f"text containing them could not be encoded")
    return ranks


def special_tokens(config: dict, n_base: int) -> dict[int, str]:
    """id -> content for the reserved range after the base ranks, as tokenization_moonshot.py
    names it: `added_tokens_decoder` where it says, `<|reserved_token_{id}|>` elsewhere."""
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: added_tokens_decoder must be an object of id -> token")
    named = {}
    # the reserved range, or as far as the entries themselves could reach: ids beyond it would
    # make the converter build every id up to them
    limit = n_base + max(NUM_RESERVED_SPECIAL_TOKENS, len(decoder))
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_RANK_DIGITS
                and isinstance(content, str) and content):
            raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: added_tokens_decoder entry {_shown(key)} needs a "
                                 f"numeric id (ASCII digits) and a non-empty string 'content'")
        if int(key) < n_base:
            raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: added token {content!r} has id {key}, inside "
                                 f"tiktoken.model's {n_base} ranks: special tokens come after them")
        if int(key) >= limit:
            raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: added token {content!r} has id {key}, beyond the "
                                 f"{limit - n_base} ids reserved after tiktoken.model's {n_base} ranks")
        named[int(key)] = content
    end = max(n_base + NUM_RESERVED_SPECIAL_TOKENS, max(named, default=0) + 1)
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(n_base, end)}


def merge_pair(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The two tokens tiktoken joins into `token`: its merge loop run over the token's own bytes,
    up to the last step. None when that loop never reaches `token` (tiktoken then produces it
    only for a piece that is the whole token).

    tiktoken's loop merges the adjacent pair of lowest rank (the leftmost of equals) until none
    is a token; rescanning every pair each step is quadratic in the token's length, so the pairs
    wait in a heap by (rank, position), parts are linked to their neighbours, and an entry whose
    parts have since changed is skipped: O(L log L)."""
    n = len(token)
    if n < 2:
        return None
    parts = [token[i:i + 1] for i in range(n)]
    nxt, prv, alive = list(range(1, n)) + [-1], list(range(-1, n - 1)), [True] * n
    heap: list[tuple[int, int, bytes, bytes]] = []

    def push(i: int) -> None:
        j = nxt[i]
        if i >= 0 and j >= 0:
            rank = ranks.get(parts[i] + parts[j])
            if rank is not None:
                heapq.heappush(heap, (rank, i, parts[i], parts[j]))

    for i in range(n - 1):
        push(i)
    left = n
    while left > 2:
        while heap:
            _, i, a, b = heapq.heappop(heap)
            if alive[i] and nxt[i] >= 0 and parts[i] == a and parts[nxt[i]] == b:
                break
        else:
            return None
        j = nxt[i]
        parts[i], alive[j], nxt[i] = a + b, False, nxt[j]
        if nxt[j] >= 0:
            prv[nxt[j]] = i
        left -= 1
        push(prv[i])
        push(i)
    first = alive.index(True)
    a, b = parts[first], parts[nxt[first]]
    return (a, b) if a + b in ranks else None


def build(ranks: dict[bytes, int], specials: dict[int, str],
          pattern: str = MOONSHOT_PATTERN) -> tokenizers.Tokenizer:
    """The `tokenizers` byte-level BPE that encodes every text to tiktoken's ids."""
    chars = {b: c for c, b in byte_level_alphabet().items()}

    def spell(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    pairs = (merge_pair(ranks, t) for t in by_rank if len(t) > 1)
    merges = [(spell(a), spell(b)) for a, b in filter(None, pairs)]
    bpe = models.BPE({spell(t): r for t, r in ranks.items()}, merges, ignore_merges=True)
    backend = tokenizers.Tokenizer(bpe)
    # The pattern splits first; ByteLevel then only maps bytes to the alphabet (use_regex=False:
    # GPT-2's own split on top would cut differently).
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    # Added in id order, so each gets the id after the last: exactly its reserved id.
    backend.add_special_tokens([tokenizers.AddedToken(specials[i], special=True, normalized=False)
                                for i in sorted(specials)])
    for i, content in specials.items():
        if backend.token_to_id(content) != i:
            raise TokenizerError(f"special token {content!r} did not get id {i} (is it spelled twice in "
                                 f"{TOKENIZER_CONFIG_FILE}, or the same as a base token?)")
    return backend


def _shown(field: bytes | str) -> str:
    """A bad field, quoted and clipped, for an error line."""
    text = field.decode("utf-8", "replace") if isinstance(field, bytes) else field
    return repr(text if len(text) <= 40 else text[:40] + "...")
