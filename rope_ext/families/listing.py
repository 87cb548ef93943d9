"""What ``rope-ext families`` lists and the families table of the docs, both from ``FamilyAdapter.supports``.

``support_table()`` is the markdown table that README.md and docs/methods.md hold between ``TABLE_START`` and
``TABLE_END`` (``scripts/families_table.py`` rewrites them; a test fails when they drift): families that support
the same hook kinds and methods share a row, with the methods refused among the kinds their sites provide and why.
"""

from __future__ import annotations

import re

from rope_ext.families.base import get_family, list_families
from rope_ext.families.support import Support
from rope_ext.methods import get_method_class

TABLE_START = "<!-- families-table:start -->"
TABLE_END = "<!-- families-table:end -->"
SUMMARY_START = "<!-- families-summary:start -->"
SUMMARY_END = "<!-- families-summary:end -->"


def supports() -> list[Support]:
    """Every family's support, the rows found from transformers' causal-LM model list included (``discover_all``):
    one entry per family, or per group of its model types where they differ."""
    from rope_ext.families.discovered import discover_all

    discover_all()
    return [support for name in list_families() for support in get_family(name).supports()]


def listing() -> list[str]:
    """The lines of ``rope-ext families``: each entry, its hook kinds and its methods."""
    entries = supports()
    width = max(len(s.label) for s in entries) + 2
    lines = [f"{'family (model types)':{width}s}the hook kinds it takes, and its methods (a family refused: why)"]
    for s in entries:
        if s.kinds:
            lines.append(f"{s.label:{width}s}hooks: {', '.join(sorted(s.kinds))}; methods: {', '.join(s.methods)}")
        else:  # (nothing fits: the reason, once)
            why = s.refused.get("yarn") or next(iter(s.refused.values()), "no hook kind fits")  # (a RoPE family's)
            lines.append(f"{s.label:{width}s}refused: {why}")
    return lines


def refused_within(support: Support) -> dict[str, str]:
    """The methods refused although the family's sites provide their hook kind, with why."""
    return {name: why for name, why in support.refused.items() if get_method_class(name).hook in support.provided}


def _entry(support: Support) -> str:
    if support.model_types == (support.family,):
        return support.family
    return f"{support.family} ({', '.join(support.model_types)})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def support_table() -> str:
    """The families table (markdown): families with the same support share a row."""
    rows: dict[tuple, list[Support]] = {}
    for support in supports():
        key = (tuple(sorted(support.kinds)), support.methods, tuple(refused_within(support).items()))
        rows.setdefault(key, []).append(support)
    lines = [
        "| families (model types) | hook kinds | methods | refused, and why |",
        "|---|---|---|---|",
    ]
    for (kinds, methods, refused), members in sorted(rows.items(), key=lambda item: _entry(item[1][0])):
        by_reason: dict[str, list[str]] = {}
        for name, why in refused:
            by_reason.setdefault(why, []).append(name)
        why = "; ".join(f"{', '.join(f'`{n}`' for n in names)}: {reason}" for reason, names in by_reason.items())
        lines.append(
            f"| {', '.join(_entry(s) for s in members)} | {', '.join(kinds) or 'none'} | "
            f"{', '.join(f'`{m}`' for m in methods) or 'none'} | {_cell(why) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def support_summary() -> str:
    """The README's families paragraph: of the causal-LM model types with a rotary embedding, how many take each
    kind of method, and how many are refused."""
    import transformers

    from rope_ext.families.discovered import rope_causal_lm_types

    entries = supports()
    rope = set(rope_causal_lm_types())
    kinds = {t: s.kinds for s in entries for t in s.model_types if t in rope}

    def taking(kind: str) -> int:
        return sum(kind in k for k in kinds.values())

    from rope_ext.families.rotary import RotaryFamily

    others = sorted({s.family for s in entries if not isinstance(get_family(s.family), RotaryFamily)})
    return (
        f"Of the {len(rope)} causal-LM model types of transformers {transformers.__version__} whose modeling code has "
        f"a rotary embedding, {taking('frequency')} take the frequency methods, {taking('position_rule')} the "
        f"attention rewrites and {taking('bias')} the additive biases; {sum(not k for k in kinds.values())} take "
        f"none (each refusal with its reason), and {len(rope) - len(kinds)} are not found. Beside them: "
        f"{', '.join(others)}, with position encodings of their own. Every RoPE family is a row found from "
        "transformers' own model list, its support measured; tests/test_conformance.py patches a tiny model of each causal-LM type "
        "([docs/methods.md](docs/methods.md#families): the table, each refusal with its reason).\n"
    )


def _markers(kind: str) -> tuple[str, str]:
    return (TABLE_START, TABLE_END) if kind == "table" else (SUMMARY_START, SUMMARY_END)


def with_support_table(text: str, table: str | None = None, kind: str = "table") -> str:
    """``text`` (a markdown document) with the block between its markers (``kind``: the table, or the README's
    summary) replaced; raises ``ValueError`` when it has no such block."""
    start, end = _markers(kind)
    pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), flags=re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one block between {start} and {end} (each on its own line)")
    body = table if table is not None else (support_table() if kind == "table" else support_summary())
    return pattern.sub(lambda _: f"{start}\n{body}{end}", text)


def table_in(text: str, kind: str = "table") -> str:
    """The block a document holds between the markers of ``kind``."""
    start, end = _markers(kind)
    match = re.search(re.escape(start) + r"\n(.*?)" + re.escape(end), text, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"no block between {start} and {end}")
    return match[1]
