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


def supports() -> list[Support]:
    """Every registered family's support: one entry per family, or per group of its model types where they differ."""
    return [support for name in list_families() for support in get_family(name).supports()]


def listing() -> list[str]:
    """The lines of ``rope-ext families``: each entry, its hook kinds and its methods."""
    entries = supports()
    width = max(len(s.label) for s in entries) + 2
    return [f"{s.label:{width}s}hooks: {', '.join(sorted(s.kinds))}; methods: {', '.join(s.methods)}" for s in entries]


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


def with_support_table(text: str, table: str | None = None) -> str:
    """``text`` (a markdown document) with the block between its markers replaced by the table; raises
    ``ValueError`` when it has no such block."""
    pattern = re.compile(re.escape(TABLE_START) + r"\n.*?" + re.escape(TABLE_END), flags=re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one block between {TABLE_START} and {TABLE_END} (each on its own line)")
    block = f"{TABLE_START}\n{table if table is not None else support_table()}{TABLE_END}"
    return pattern.sub(lambda _: block, text)


def table_in(text: str) -> str:
    """The table a document holds between the markers."""
    match = re.search(re.escape(TABLE_START) + r"\n(.*?)" + re.escape(TABLE_END), text, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"no block between {TABLE_START} and {TABLE_END}")
    return match[1]
