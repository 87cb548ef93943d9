"""``rope-ext methods`` and ``rope-ext families``: what is registered, and what fits which family."""

from __future__ import annotations

import argparse
import dataclasses
import re
import textwrap

from rope_ext.families import listing
from rope_ext.methods import get_method_class, list_methods, make_config
from rope_ext.methods.options import CHECK, meaning_of
from rope_ext.methods.spec import split_spec

#: the width ``rope-ext methods NAME`` wraps a summary and each option's meaning to
WIDTH = 100


def plain(text: str) -> str:
    """Declared text (a summary, a meaning) on one line, without reST's double backquotes."""
    return " ".join(text.split()).replace("``", "")


def first_sentence(text: str) -> str:
    """The first sentence of a summary, without reST's double backquotes."""
    text = plain(text)
    if not text:
        return "(no description)"
    match = re.search(r"(?<=[.:])\s(?=[A-Z(])", text)
    return text[: match.start()].rstrip(":") if match else text


def cmd_methods(args: argparse.Namespace) -> int:
    if args.name is None:
        names = list_methods()
        width = max(len(name) for name in names) + 2
        kind_width = max(len(get_method_class(name).hook) for name in names) + 2
        hanging = " " * (width + kind_width)
        for name in names:
            cls = get_method_class(name)
            print(textwrap.fill(first_sentence(cls.summary), WIDTH + len(hanging) // 2, break_on_hyphens=False,
                                initial_indent=f"{name:{width}s}{cls.hook:{kind_width}s}", subsequent_indent=hanging))
        print("\n`rope-ext methods NAME`: a method's summary and its options: type, default and meaning")
        return 0
    cls = get_method_class(_method_name(args.name))  # (unknown: ValueError naming the valid methods)
    print(f"{cls.method} (hook kind: {cls.hook})\n")
    print(textwrap.fill(plain(cls.summary) or "(no description)", WIDTH, break_on_hyphens=False) + "\n")
    fields = {field.name: field for field in dataclasses.fields(cls)}
    rows = []
    listed = [name for name in cls.option_names() if name not in cls.unused_shared_options]  # (not those it refuses)
    for name in listed:
        field = fields[name]
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        if name == "factor" and hasattr(cls, "default_factor"):  # (frequency methods: required, or a default)
            kind, default = "float", cls.default_factor if cls.default_factor is not None else dataclasses.MISSING
        required = default is dataclasses.MISSING or name in cls.required_options or refuses_none(field, default)
        if required and kind.endswith(" | None"):  # (None only stands for "not given", which is refused)
            kind = kind[: -len(" | None")]
        rows.append((name, kind, "(required)" if required else repr(default), plain(meaning_of(field))))
    if not rows:
        print(f"no options (a spec names it alone: {cls.method})")
        return 0
    print("options (set in a spec as name:option=value):")
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    indent = " " * 6
    for name, kind, shown, meaning in rows:
        print(f"  {name:{widths[0]}s}  {kind:{widths[1]}s}  {shown}")
        print(textwrap.fill(meaning or "(no description)", WIDTH, initial_indent=indent, subsequent_indent=indent,
                            break_on_hyphens=False))
    return 0


def _method_name(given: str) -> str:
    """The method ``given`` names, any case (``YARN``); a spec's options are checked, then dropped (``yarn:factor=4``:
    yarn). A combination or ``none`` is refused, saying what to give."""
    text = given.strip()
    parts = [part.strip().split(":", 1)[0].strip() for part in split_spec(text, "+")]
    if len(parts) > 1:
        raise ValueError(f"{text!r} combines {len(parts)} methods; give one at a time: "
                         + ", ".join(f"rope-ext methods {part}" for part in parts))
    name = parts[0].lower() if parts and parts[0].lower() in list_methods() else (parts[0] if parts else text)
    if name == "none":
        raise ValueError("'none' is the unpatched model in --methods (no method, no options); rope-ext methods lists "
                         "the methods")
    if ":" in text:
        make_config(name + text[text.index(":"):])  # (a bad option: its message, not a listing of another spec)
    return name


def refuses_none(field: dataclasses.Field, default: object) -> bool:
    """Whether an option's ``None`` default is "not given" and refused (its declared check is not optional), rather
    than derived when patching."""
    check = field.metadata.get(CHECK)
    return default is None and check is not None and not getattr(check, "optional", True)


def cmd_families(args: argparse.Namespace) -> int:
    """Each family (per group of model types where they differ), its hook kinds and the methods that fit: the
    support predicate ``patch`` checks (``rope_ext.families.support``)."""
    for line in listing():
        print(line)
    return 0

