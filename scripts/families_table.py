"""Print the families table (``rope_ext.families.support_table``), or rewrite it in docs/methods.md (the block between
``<!-- families-table:start -->`` and ``<!-- families-table:end -->``) and README.md's summary of it (between
``<!-- families-summary:start -->`` and ``<!-- families-summary:end -->``) with ``--write``.

    python scripts/families_table.py            # print it
    python scripts/families_table.py --write    # rewrite the docs' blocks (tests/test_support.py checks them)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rope_ext.families import support_summary, support_table, with_support_table

ROOT = Path(__file__).resolve().parent.parent
#: each document and the block it holds
DOCUMENTS = {"README.md": "summary", "docs/methods.md": "table"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {', '.join(DOCUMENTS)}")
    args = parser.parse_args()
    table = support_table()
    if not args.write:
        print(table, end="")
        return
    blocks = {"table": table, "summary": support_summary()}
    for name, kind in DOCUMENTS.items():
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        updated = with_support_table(text, blocks[kind], kind)
        if updated != text:
            path.write_text(updated, encoding="utf-8")
        print(f"{name}: {'rewritten' if updated != text else 'up to date'}")


if __name__ == "__main__":
    main()
