"""The tokenizer's endpoints of `ds2 serve`: POST /tokenize and /detokenize (llama-server's and
vLLM's shapes) and GET /tokenizer_info (as vLLM answers it)."""

from __future__ import annotations

import json
from pathlib import Path

from ds2cli.server.jobs import chat_ids, check_length, unicode_text
from ds2cli.server.request_fields import ApiError, Defaults, boolean
from ds2cli.text.tokenizer import Tokenizer


def tokenize_request(body: dict, tokenizer: Tokenizer, defaults: Defaults) -> dict:
    """POST /tokenize: llama-server's {"content", "add_special", "with_pieces"}, or vLLM's
    {"prompt", "add_special_tokens"} or {"messages", "add_generation_prompt"} -> {"tokens", ...}.
    Bounded as completions are: a text longer than the context is a 400 before it is tokenized
    whole. A text's special tokens are read as /v1/completions reads a prompt's (text with
    --no-special-in-prompts); messages' are text, as in chat."""
    if "messages" in body:
        ids, _ = chat_ids(body, tokenizer, defaults)
    else:
        name = "content" if "content" in body else "prompt"
        text = body.get(name)
        if not isinstance(text, str):
            raise ApiError(400, "give the text to tokenize as content (or prompt), a string", param=name)
        # llama-server's add_special (default false), vLLM's add_special_tokens (default true)
        given = [boolean(body, k) for k in ("add_special", "add_special_tokens") if body.get(k) is not None]
        special = given[0] if given else name == "prompt"
        check_length(unicode_text(text, name), tokenizer, defaults.ctx, name, name)
        ids = tokenizer.encode(text, add_special_tokens=special, parse_special=defaults.special_in_prompts)
    tokens: list = ids
    if boolean(body, "with_pieces"):
        tokens = [{"id": t, "piece": tokenizer.token_bytes(t).decode("utf-8", errors="replace")} for t in ids]
    out = {"tokens": tokens, "count": len(ids), "max_model_len": defaults.ctx}
    if boolean(body, "return_token_strs"):
        out["token_strs"] = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
    return out


def detokenize_request(body: dict, tokenizer: Tokenizer, vocab_size: int) -> dict:
    """POST /detokenize: {"tokens": [ids]} -> {"content": text} (llama-server), also as "prompt" (vLLM)."""
    ids = body.get("tokens")
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ApiError(400, "tokens must be a list of token ids", param="tokens")
    if not all(0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"token ids must be in [0, {vocab_size})", param="tokens")
    text = tokenizer.decode(ids)
    return {"content": text, "prompt": text}


def tokenizer_info(tokenizer: Tokenizer, model_dir, ctx: int) -> dict:
    """GET /tokenizer_info, as vLLM answers it: the checkpoint's tokenizer_config.json (its
    added_tokens_decoder left out), with tokenizer_class, the special tokens and the chat template."""
    config: dict = {}
    path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
    config = {k: v for k, v in config.items() if k != "added_tokens_decoder"} if isinstance(config, dict) else {}
    return {**config, "tokenizer_class": config.get("tokenizer_class") or "PreTrainedTokenizerFast",
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "chat_template": tokenizer.chat_template, "model_max_length": ctx,
            "vocab_size": tokenizer.vocab_size}
