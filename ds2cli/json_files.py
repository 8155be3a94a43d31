"""JSON files and bodies from outside (config.json, tokenizer_config.json, a saved conversation, a
request body) read as untrusted: every failure is one line of a ds2 error, never a traceback.
Below every package, beside errors.py: the model's config, the tokenizer and the server all read JSON."""

from __future__ import annotations

import json
from pathlib import Path

from ds2cli.errors import Ds2Error
from ds2cli.user_files import read_bounded

# What json.loads raises on untrusted text: JSONDecodeError, UnicodeDecodeError and an integer of
# thousands of digits are ValueErrors; deep nesting is a RecursionError.
JSON_ERRORS = (ValueError, RecursionError)


def json_error(e: BaseException) -> str:
    """Why untrusted JSON did not parse, in one line (without Python's advice to raise a limit)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return str(e)
    return "a number has too many digits"


JSON_FILE_LIMIT = 16 << 20     # config.json, generation_config.json ...: kilobytes in every real model


def read_json_object(path: Path, error: type[Ds2Error], limit: int = JSON_FILE_LIMIT) -> dict:
    """An untrusted JSON file that must hold an object, at most `limit` bytes (measured before it
    is read); any failure raises `error` in one line."""
    try:
        raw = read_bounded(path, limit, "JSON file")
    except Ds2Error as e:
        raise error(str(e)) from None
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, *JSON_ERRORS) as e:
        raise error(f"{path} is not valid JSON: {json_error(e)}") from None
    if not isinstance(d, dict):
        raise error(f"{path} must hold a JSON object, not {type(d).__name__}")
    return d
