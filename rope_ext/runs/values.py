"""Option values as every command reads them, from a flag or from a YAML file alike: integers (``4k`` = 4096),
finite numbers, comma-separated names, non-empty texts; and the kind of each field of a run configuration, read
from its resolved type hints."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import typing
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rope_ext.runs.specs import listed_spec

#: the longest length a run takes (16M tokens): past it a length is a typo, not a context to evaluate
MAX_LENGTH = 1 << 24


#: a length's suffixes (either case) and what they multiply: 4k = 4096, 1M = 1048576
LENGTH_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20}


class LengthTooShort(ValueError):
    """A well-formed length below 2 tokens (0, 1, or negative)."""


def parse_length(text: str) -> int:
    """``"16k"`` -> 16384, ``"1M"`` -> 1048576, ``"1500"`` -> 1500."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match and re.fullmatch(r"\s*-\s*\d+\s*[a-zA-Z]*\s*", text):
        raise LengthTooShort(f"length must be at least 2 tokens, got {text!r}")
    if not match:
        raise ValueError(f"malformed length {text!r}; use a number of tokens such as 4096, 4k or 1M")
    if match[2].lower() not in LENGTH_SUFFIXES:
        raise ValueError(f"malformed length {text!r}: unknown suffix {match[2]!r}; use k (x1024) or M (x1048576), "
                         "e.g. 4k or 1M")
    value = int(match[1]) * LENGTH_SUFFIXES[match[2].lower()]
    if value < 2:
        raise LengthTooShort(f"length must be at least 2 tokens, got {text!r}")
    if value > MAX_LENGTH:
        raise ValueError(f"length {text!r} is over {MAX_LENGTH} tokens ({MAX_LENGTH >> 20}M), the most a run takes")
    return value


def comma_items(text: str, item: str) -> list[str]:
    """``text`` split at its commas, each item stripped (``[]`` when nothing is given); an empty item among others
    (``a,,b``, ``a,``) is refused, naming what an ``item`` is."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        return []
    if not all(parts):
        raise ValueError(f"an empty {item} in {text!r} (two commas in a row, or one at an end); give the {item}s with "
                         "one comma between each two")
    return parts


def parse_lengths(text: str) -> list[int]:
    """``"4k,8k"`` -> ``[4096, 8192]`` (sorted); a length given twice (``1k,1024``) is refused, naming it."""
    parts = comma_items(text, "length")
    if not parts:
        raise ValueError("give at least one length")
    lengths: dict[int, str] = {}
    for part in parts:
        length = parse_length(part)
        if length in lengths:
            same = "" if lengths[length] == part else f" ({lengths[length]} and {part})"
            raise ValueError(f"length {length} is given twice in {text!r}{same}; give each length once")
        lengths[length] = part
    return sorted(lengths)


KINDS = {bool: "bool", int: "int", float: "float", str: "str", list: "list"}


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        try:
            return parse_length(text)  # (4k = 4096)
        except ValueError:
            raise ValueError(f"must be an integer (4k = 4096), got {text!r}") from None


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"must be a number, got {text!r}")
    return value


def name_list(text: str, empty: str = "give comma-separated names") -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; nothing named: ``ValueError(empty)``; an empty item between names (``a,,b``,
    ``a,``) is refused, as in ``--lengths``."""
    names = comma_items(text, "name")
    if not names:
        raise ValueError(empty)
    return names


def boolean(text: str) -> bool:
    """A yes/no text as transformers' ``HfArgumentParser`` reads one (``true``, ``yes``, ``1``...; any case)."""
    lowered = text.strip().lower()
    if lowered in ("yes", "true", "t", "y", "1"):
        return True
    if lowered in ("no", "false", "f", "n", "0"):
        return False
    raise ValueError(f"give true or false, got {text!r}")


def nonempty(text: str) -> str:
    """A value that must not be empty."""
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def names_or_none(text: str) -> list[str]:
    """As ``name_list``, an empty text being no names (a list option whose default is none: ``--exclude ''``)."""
    return name_list(text) if text.strip() else []


#: how a text becomes a value of each kind (a flag's text, or a string where a YAML file gives one)
PARSERS = {"int": integer, "float": number, "list": name_list, "str": nonempty, "bool": boolean}


def parser_of(kind: str, optional: bool) -> Callable[[str], Any] | None:
    """How a text becomes a value of an option of ``kind``, alike for a flag and a YAML file: a list that is not
    optional (its default: no names) takes an empty text as none; an optional one (``None``: not given) refuses it."""
    return names_or_none if kind == "list" and not optional else PARSERS.get(kind)


def option_flag(name: str) -> str:
    """The flag of the option ``name``: ``lora_r`` -> ``--lora-r``."""
    return "--" + name.replace("_", "-")


def field_kinds(cls: type) -> dict[str, tuple[str, bool]]:
    """``name -> (kind, optional)`` of each field of the dataclass ``cls``: its resolved type (``int | None`` is
    ``("int", True)``, ``list[str]`` is ``("list", False)``)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        if optional:
            (hint,) = [a for a in args if a is not type(None)]
        kinds[f.name] = (KINDS[typing.get_origin(hint) or hint], optional)
    return kinds


def parse_text(kind: str, text: Any, optional: bool = True) -> Any:
    """``text`` as a value of ``kind`` when it is a string (else as it is); ``optional`` as ``parser_of``'s."""
    parse = parser_of(kind, optional)
    return parse(text) if isinstance(text, str) and parse else text


def _flag_in(name: str) -> str:
    """A pattern of ``name``'s flag as a whole word of a message."""
    return rf"(?<![\w-]){re.escape(option_flag(name))}(?![\w-])"


@contextlib.contextmanager
def named_as_in_file(file: str | Path | None, names: Iterable[str], flags: Iterable[str] = ()) -> Iterator[None]:
    """A ``ValueError`` (or ``OSError``: a file not found) raised inside names the options ``names``, which the YAML
    ``file`` gave, by the file's keys, not as the flags the user never typed: ``--lora-r: must be an integer >= 1``
    becomes ``--config run.yaml: lora_r: must be an integer >= 1``. Where the message names options ``flags`` gave
    too, it says which came from where: ``--hidden 30 must be a multiple of heads 4 (--hidden from the command line,
    heads from --config run.yaml)``."""
    try:
        yield
    except (ValueError, OSError) as error:
        message = str(error)
        renamed = [name for name in names if re.search(_flag_in(name), message)]
        if file is None or not renamed:
            raise
        for name in renamed:
            message = re.sub(_flag_in(name), name, message)
        flagged = [option_flag(name) for name in flags if re.search(_flag_in(name), message)]
        if flagged:
            message += f" ({', '.join(flagged)} from the command line, {', '.join(renamed)} from --config {file})"
        else:
            message = f"--config {file}: {message}"
        if isinstance(error, OSError):  # (FileNotFoundError stays one; a library's own subclass: OSError)
            raise (type(error) if type(error).__module__ == "builtins" else OSError)(message) from None
        raise ValueError(message) from None


def read_yaml(path: str | Path, cls: type) -> dict[str, Any]:
    """The keys of a YAML run file, checked against the fields of ``cls`` (a run configuration: ``lora-r`` and
    ``lora_r`` both name one; an old name in its ``RENAMED`` names the new one)."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--config {path} is a folder; give a YAML file of options (docs/finetune.md)")
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file; give a YAML file of options (docs/finetune.md)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"--config {path}: not YAML ({str(error).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: give a mapping of options (name: value), got {type(data).__name__}")
    kinds = field_kinds(cls)
    names = set(kinds)
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = getattr(cls, "RENAMED", {}).get(name, name)
        if name in values:
            raise ValueError(f"--config {path}: {name!r} is given twice (as {name}, {name.replace('_', '-')} or an old "
                             "name of it)")
        if name not in names:
            raise ValueError(f"--config {path}: unknown option {key!r}; options: {', '.join(sorted(names))}")
        kind, optional = kinds[name]
        try:  # (lengths as the evaluation writes them: 32k; YAML 1.1 reads 1e-4 as a string: it wants 1.0e-4; names
            if kind in ("list", "int", "float", "bool") and isinstance(value, str):  # comma-separated; quoted 'no')
                value = parse_text(kind, value, optional)
            elif name == "methods" and isinstance(value, list):
                value = listed_spec(value)
        except ValueError as error:
            raise ValueError(f"--config {path}: {key}: {error}") from None
        values[name] = value
    return values
