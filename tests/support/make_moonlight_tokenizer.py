"""Make a Moonlight-like tokenizer the way Moonshot's are made: tiktoken.model + tokenizer_config.json.

No real Moonlight or Kimi tokenizer file is reachable offline, so this writes one of the same kind:
- tiktoken.model: ranks learned in order from a known byte-level BPE, DeepSeek-V2's
  (tests/data/tokenizers/deepseek-v2/tokenizer.json): the 256 single bytes first (in that
  vocabulary's order, as cl100k's ranks 0-255 are the GPT-2 alphabet's; the 13 bytes UTF-8
  never uses, which DeepSeek's lacks, after them), then the result of each
  merge in merge order, each token once: a rank is when the token was learned, as in tiktoken files;
- tokenizer_config.json: Moonlight-16B-A3B-Instruct's special-token layout after the base ranks
  ([BOS], [EOS], <|im_end|>, <|im_user|>, <|im_assistant|>, <|start_header_id|>,
  <|end_header_id|>, [EOT], <|im_system|>, <|im_middle|> at their offsets, the rest of the 256
  reserved ids unnamed), bos [BOS] / eos [EOS], and its chat template
  (`<|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...`).

    PYTHONPATH=$PWD python tests/support/make_moonlight_tokenizer.py    # rewrites tests/data/tokenizers/moonlight-like/

The committed fixture keeps 3,840 ranks (+ 256 reserved = 4,096 ids, the reference_v3
moonlight_like case's embedding rows): DeepSeek-V2's first 3,584, then 256 merges learned over
unsplit text (`crossing_merges`: tokens across the pattern's boundaries, which make the id test
sensitive to the split); tests/text/test_tiktoken.py builds the full ~100k-rank file from the same
functions at test time.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

from ds2cli.text.tiktoken_convert import byte_level_alphabet

DATA = Path(__file__).parents[1] / "data"
DEEPSEEK_V2_TOKENIZER = DATA / "tokenizers" / "deepseek-v2" / "tokenizer.json"
FIXTURE = DATA / "tokenizers" / "moonlight-like"
FIXTURE_RANKS = 3840            # + 256 reserved special ids = 4096 = moonlight_like's vocab_size
CROSSING_RANKS = 256            # of which the last are learned over unsplit text (see crossing_merges)
MAX_CROSSING_BYTES = 8          # short tokens, so the merges spread over every boundary of the text

# Text to learn the crossing merges from: every boundary Moonshot's pattern draws (Han | Latin,
# space | Han, case turns, contractions, digit groups, punctuation | letters, whitespace kinds).
TRAINING_TEXT = """\
中文English混合，汉字abc北京市 Pascal 月之暗面Moonlight发布了16B模型。日本語のテキストとカタカナ、東京2024年。
Hello World THE QUICK brown Fox's tail; don't, WON'T, they'RE, I'M, we'LL, you'VE, he'D.
CamelCaseXMLHttpRequest getHTTPResponseCode iPhone McDonald's O'NEIL'S 'S 'LL
1234567890 12345 3.14159 1,000,000 x1 a22 b333c 2024年12月1日 ١٢٣٤ ५६७८
def f(x):\n    return x ** 2  # comment\n\n\tif x>=10: print(f'{x:08.3f}')\r\n}}\n
  spaces   and\ttabs\n\n\n   newlines \u00a0nbsp\u3000ideographic\u2028line  \n  \n
emoji 👨‍👩‍👧‍👦 🚀🔥 ✨💯 (parens) [brackets] {braces} <tags/> "quotes" ...!!! ??? --- ===
안녕하세요세계 Привет,МИР Ωμέγα مرحبا नमस्ते Ünïcödé ÀÉÎÕÜ ßẞ e\u0301 ȁ\u0308
"""

# Offsets after the base ranks, as Moonlight's and Kimi-K2's added_tokens_decoder place them
# (Moonlight: 163584 [BOS], 163585 [EOS], 163586 <|im_end|>, ..., 163601 <|im_middle|>).
SPECIAL_OFFSETS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                   6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                   17: "<|im_middle|>"}

# Moonlight-16B-A3B-Instruct's template: a default system turn, then
# <|im_{role}|>{role}<|im_middle|>{content}<|im_end|> per message; no bos.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{'<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>'}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{'<|im_system|>'}}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{'<|im_user|>'}}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{'<|im_assistant|>'}}{%- endif -%}"
    "{{- message['role'] -}}{{'<|im_middle|>'}}{{message['content']}}{{'<|im_end|>'}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<|im_assistant|>assistant<|im_middle|>'}}{%- endif -%}"
)


def ranks_from_bpe(tokenizer_json: Path = DEEPSEEK_V2_TOKENIZER, n_ranks: int | None = None) -> dict[bytes, int]:
    """tiktoken ranks of a byte-level BPE: its bytes, then each merge's result in merge order."""
    model = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]
    alphabet = byte_level_alphabet()
    as_bytes = lambda token: bytes(alphabet[c] for c in token)  # noqa: E731
    singles = sorted((i, t) for t, i in model["vocab"].items() if len(t) == 1 and t in alphabet)
    ranks: dict[bytes, int] = {}
    for _, t in singles:
        ranks.setdefault(as_bytes(t), len(ranks))
    # DeepSeek's lacks the 13 bytes UTF-8 never uses (0xc0, 0xc1, 0xf5-0xff); tiktoken files have all 256.
    for b in range(256):
        ranks.setdefault(bytes([b]), len(ranks))
    for merge in model["merges"]:
        if n_ranks is not None and len(ranks) >= n_ranks:
            break
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        a, b = as_bytes(left), as_bytes(right)
        if a in ranks and b in ranks:           # a trained BPE's parts always come first
            ranks.setdefault(a + b, len(ranks))
    return ranks


def tiktoken_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    """tiktoken's loop over one piece: merge the adjacent pair of lowest rank until none is a token."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        found = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
        if not found:
            break
        i = min(found)[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def crossing_merges(ranks: dict[bytes, int], n: int, text: str = TRAINING_TEXT) -> dict[bytes, int]:
    """`ranks` plus n merges learned by BPE over text that was not split (each line whole), so the
    vocabulary has tokens across every boundary of the pattern: a tokenizer that splits anywhere
    else than tiktoken does then gives other ids. (DeepSeek's merges were learned on split text,
    so alone they cannot tell two patterns apart: no token crosses a boundary either draws.)"""
    ranks = dict(ranks)
    words = [tiktoken_bpe(ranks, line.encode()) for line in text.splitlines() if line]
    for _ in range(n):
        counts: dict[tuple[bytes, bytes], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                if pair[0] + pair[1] not in ranks and len(pair[0] + pair[1]) <= MAX_CROSSING_BYTES:
                    counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))      # most frequent, then bytewise: deterministic
        ranks[best[0] + best[1]] = len(ranks)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [best[0] + best[1]]
                i += 1
    return ranks


def tiktoken_model_text(ranks: dict[bytes, int]) -> str:
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))


def special_tokens(n_base: int) -> dict[int, str]:
    return {n_base + k: v for k, v in SPECIAL_OFFSETS.items()}


def tokenizer_config(n_base: int) -> dict:
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, c in special_tokens(n_base).items()}
    return {"added_tokens_decoder": added, "additional_special_tokens": list(SPECIAL_OFFSETS.values())[2:],
            "auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]},
            "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False, "model_max_length": 1000000000000000019884624838656,
            "tokenizer_class": "TikTokenTokenizer"}


def write(directory: Path, ranks: dict[bytes, int]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").write_text(tiktoken_model_text(ranks), encoding="ascii")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(len(ranks)), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    write(out, crossing_merges(ranks_from_bpe(n_ranks=FIXTURE_RANKS - CROSSING_RANKS), CROSSING_RANKS))
    print(f"wrote {out}")
