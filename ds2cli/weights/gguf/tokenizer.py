"""A GGUF's `tokenizer.ggml.*` metadata -> ds2's Tokenizer (a `tokenizers` byte-level BPE).

convert_hf_to_gguf writes the Hugging Face vocabulary as a token list (`tokens`, ids by
position, padded to the model's vocab_size with "[PADn]" entries of type UNUSED), a type per
token (1 normal, 3 control, 4 user-defined, 5 unused), the merges as "a b" strings, the
special-token ids, the add-bos flag and the chat template. What it does not write is the
pre-tokenizer: it names it (`tokenizer.ggml.pre`), and llama.cpp carries the regexes. ds2 builds
the same split as the original tokenizer.json did for each name it knows (PRE_TOKENIZERS: the
sequences of DeepSeek's own tokenizer.json files; llama.cpp's approximations of them differ,
for example in how digits split), so that text encodes to the ids the original tokenizer gives.
"""

from __future__ import annotations

import json

import tokenizers

from ds2cli.errors import TokenizerError
from ds2cli.weights.gguf.file import GGUFFile
from ds2cli.text.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# DeepSeek-LLM / V2 / V2.5 / Coder-V2 (tokenizer.json of deepseek-ai/DeepSeek-V2, verbatim)
_V2_LETTERS = ('\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-'
               '\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6'
               '-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771'
               '-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+')


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
PRE_TOKENIZERS = {
    "deepseek-llm": [_split("[\r\n]"), _split(_V2_LETTERS), _split('\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+'),
                     _split("\\s+$"), _split('[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+'),
                     {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    # DeepSeek-V3 / R1 / V2.5-1210 (tokenizer.json of deepseek-ai/DeepSeek-V3)
    "deepseek-v3": [_split("\\p{N}{1,3}"), _split('[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+'),
                    _split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                           "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
                    _BYTE_LEVEL],
}


def backend_from_gguf(gf: GGUFFile) -> tokenizers.Tokenizer:
    f = gf.fields
    model, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise TokenizerError(f"{gf.name}: tokenizer.ggml.model is {model!r}; ds2 reads GGUF byte-level BPE "
                             f"tokenizers (\"gpt2\"), as DeepSeek's are")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{gf.name}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer ds2 knows "
                             f"({', '.join(PRE_TOKENIZERS)})")
    tokens, merges = f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise TokenizerError(f"{gf.name}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    if not all(isinstance(t, str) for t in tokens) or not all(isinstance(m, str) for m in merges):
        raise TokenizerError(f"{gf.name}: tokenizer.ggml.tokens and tokenizer.ggml.merges must be lists of strings")
    types = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if not isinstance(types, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in types):
        raise TokenizerError(f"{gf.name}: tokenizer.ggml.token_type must be a list of integers")
    if len(types) != len(tokens):
        raise TokenizerError(f"{gf.name}: {len(tokens)} tokens but {len(types)} token types")
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [
                {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": kind == CONTROL}
                for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": PRE_TOKENIZERS[pre]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": {t: i for i, t in enumerate(tokens)},
                      "merges": merges}}
    try:
        return tokenizers.Tokenizer.from_str(json.dumps(spec))
    except Exception as e:   # tokenizers raises its own Exception type
        raise TokenizerError(f"{gf.name}: the GGUF tokenizer does not build: {e}") from None


def tokenizer_from_gguf(gf: GGUFFile, vocab_size: int | None = None) -> Tokenizer:
    backend = backend_from_gguf(gf)
    f, tokens = gf.fields, gf.fields["tokenizer.ggml.tokens"]
    if vocab_size is not None and len(tokens) > vocab_size:
        raise TokenizerError(f"{gf.name}: the tokenizer has {len(tokens)} tokens, more than the model's "
                             f"{vocab_size} embedding rows")

    def token(key: str) -> str | None:
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            return None
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            raise TokenizerError(f"{gf.name}: tokenizer.ggml.{key}_token_id {i!r} is not a token id")
        return tokens[i]

    return Tokenizer(backend, token("bos"), token("eos"), f.get("tokenizer.ggml.add_bos_token") is True,
                     f.get("tokenizer.chat_template"))
