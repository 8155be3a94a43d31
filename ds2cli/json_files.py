"""JSON files and bodies from outside (config.json, tokenizer_config.json, a saved conversation, a
request body) read as untrusted: every failure is one line of a ds2 error, never a traceback.
Below every package, beside errors.py: the model's config, the tokenizer and the server all read JSON."""

from __future__ import annotations

import json
from pathlib import Path

from ds2cli.errors import Ds2Error

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


def read_json_object(path: Path, error: type[Ds2Error]) -> dict:
    """An untrusted JSON file that must hold an object; any failure raises `error` in one line."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except JSON_ERRORS as e:
        raise error(f"{path} is not valid JSON: {json_error(e)}") from None
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(d, dict):
        raise error(f"{path} must hold a JSON object, not {type(d).__name__}")
    return d
