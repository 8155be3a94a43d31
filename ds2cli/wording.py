"""Numbers and words in messages for people: plurals, "a" or "an", human units. No terminal,
no dependencies, so library modules may word their errors with it as well as the CLI."""

from __future__ import annotations

import re


def plural(n: int, noun: str) -> str:
    """plural(1, "file") -> "1 file"; plural(0, "file") -> "0 files"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def article(word: object) -> str:
    """The indefinite article before `word`: article(8) -> "an" ("an 8-bit copy"), article("4.2 GB")
    -> "a". A number goes by how it is read: "an" before eight, eleven and eighteen, whether alone
    or leading the thousands, millions... (8, 80-89, 800-899, 11, 18, 8000, 11000, 18 GB); a word
    goes by its first letter (a vowel: "an")."""
    text = str(word).strip()
    digits = re.match(r"[\d,]+", text)
    if digits is None:
        return "an" if text[:1].lower() in ("a", "e", "i", "o", "u") else "a"
    lead = int(digits.group().replace(",", "") or 0)
    while lead >= 1000:                         # 18_000 is read "eighteen thousand"
        lead //= 1000
    return "an" if str(lead).startswith("8") or lead in (11, 18) else "a"


def human_count(n: int | float) -> str:
    """15_761_408 -> '15.8M'; three significant figures with K/M/B/T."""
    return _scaled(n, ("", "K", "M", "B", "T"), "")


def human_bytes(n: int | float) -> str:
    """2_160_000_000 -> '2.16 GB' (decimal units, as disks and safetensors sizes are quoted)."""
    return _scaled(n, ("B", "kB", "MB", "GB", "TB"), " ")


def _scaled(n: int | float, units: tuple[str, ...], sep: str) -> str:
    value = float(n)
    for unit in units[:-1]:
        if abs(value) < 999.5:
            break
        value /= 1000
    else:
        unit = units[-1]
    if unit == units[0] and float(n).is_integer():
        return f"{int(n)}{sep}{unit}"
    return f"{value:.3g}{sep}{unit}"


def install_hint(extra: str, package: str) -> str:
    """How to add one of ds2's extras, from an index or a clone alike: install_hint("grammar",
    "llguidance") -> "pip install 'ds2cli[grammar]' (from a clone: pip install '.[grammar]'),
    or pip install llguidance"."""
    return f"pip install 'ds2cli[{extra}]' (from a clone: pip install '.[{extra}]'), or pip install {package}"


def packed(parts: list[str], width: int = 80, sep: str = " | ", indent: str = "  ") -> str:
    """`parts` joined by `sep` on lines of at most `width` columns where each part allows: a line
    that would pass it breaks before a separator, and the next one starts `indent` + the
    separator's text, so a reader (or a test) rejoins them by replacing "\\n" + indent + "|"
    with " |". packed(["a" * 50, "b" * 40]) -> "aaa...a\\n  | bbb...b"."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(indent + sep.lstrip() + part)
    return "\n".join(lines)


def unpacked(text: str, sep: str = " | ", indent: str = "  ") -> str:
    """packed's lines as the one line they continue."""
    return text.replace("\n" + indent + sep.lstrip(), sep)
