"""Methods written as text, the CLI's ``--methods`` syntax, which ``rope_ext.patch`` takes too:
``"yarn:factor=4:beta_fast=16"`` (a name, then options), ``"yarn:factor=4+dca"`` (a combination of methods of
different hook kinds); option values are JSON (``4``, ``1.5``, ``true``, ``null``, ``[1,1.5,2]``; Python's
``True``, ``False``, ``None`` too) or else plain strings. Brackets, braces and double quotes protect separators
inside a value."""

from __future__ import annotations

import json
import re
from typing import Any

METHOD_SYNTAX = (
    "name[:key=value...], methods of different hook kinds joined by '+' (e.g. yarn:factor=4, "
    "a:x=1+b:y=2); values are JSON (4, 1.5, true, null, [1,1.5,2]) or plain strings"
)

_EXPONENT = re.compile(r"(?<![\w.])(?:\d+(?:\.\d*)?|\.\d+)[eE]$")  # "1e" of "1e+3": that '+' joins no methods
#: a '+' right after one of these is a sign ("factor=+4", "[+1,+2]"), not a join
_SIGN_AFTER = ("=", ",", "[")
#: numbers JSON refuses but Python writes (".5", "2.", "+4", "2.e+1")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def split_spec(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside brackets, braces and double-quoted strings."""
    parts: list[str] = []
    current: list[str] = []
    depth, quoted, escaped = 0, False, False
    for index, char in enumerate(text):
        if quoted:
            escaped, quoted = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            quoted = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth < 0:
                break
        elif char == separator and depth == 0 and not (separator == "+" and _is_sign(text[:index])):
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth or quoted:
        raise ValueError(f"unbalanced brackets or quotes in {text!r}; expected {METHOD_SYNTAX}")
    parts.append("".join(current))
    return parts


#: Python's spellings of JSON's literals, as a Python user writes them in a spec
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}
_OPTION_START = re.compile(r"\s*[A-Za-z_]\w*\s*=")


def _is_sign(before: str) -> bool:
    return bool(_EXPONENT.search(before)) or before.rstrip().endswith(_SIGN_AFTER)


def parse_value(text: str) -> Any:
    """JSON when it parses (``4``, ``1.5``, ``true``, ``null``, ``[1,1.5,2]``; also Python's ``True``,
    ``False``, ``None``), else the string itself."""
    if text in _PYTHON_LITERALS:
        return _PYTHON_LITERALS[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if _NUMBER.fullmatch(text):
            number = float(text)
            return int(number) if re.fullmatch(r"[+-]?\d+", text) else number
        return text


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"a:x=1+b:y=2"`` -> ``[("a", {"x": 1}), ("b", {"y": 2})]`` (names unchecked: the registry checks them)."""
    parts = []
    for part in split_spec(spec.strip(), "+"):
        name, *options = (piece.strip() for piece in split_spec(part, ":"))
        if not name:
            raise ValueError(f"missing method name in {spec!r}; expected {METHOD_SYNTAX}")
        kwargs: dict[str, Any] = {}
        for option in options:
            key, sep, value = (piece.strip() for piece in option.partition("="))
            if not sep or not key or not value:
                raise ValueError(f"malformed method option {option!r} in {spec!r}; expected {METHOD_SYNTAX}")
            if key in kwargs:
                raise ValueError(f"option {key!r} given twice in {spec!r}")
            pieces = [piece.strip() for piece in split_spec(value, ",")]
            if len(pieces) > 1 and any(_OPTION_START.match(piece) for piece in pieces[1:]):
                raise ValueError(
                    f"option {option!r} in {spec!r} holds another option after a comma: options are separated by "
                    f"':' (e.g. {name}:{key}={':'.join(pieces)}); expected {METHOD_SYNTAX}"
                )
            kwargs[key] = parse_value(value)
        parts.append((name, kwargs))
    return parts
