"""Print the families table (``rope_ext.families.support_table``), or rewrite it in README.md and docs/methods.md
(the block between ``<!-- families-table:start -->`` and ``<!-- families-table:end -->``) with ``--write``.

    python scripts/families_table.py            # print it
    python scripts/families_table.py --write    # rewrite the docs' blocks (tests/test_support.py checks them)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rope_ext.families import support_table, with_support_table

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/methods.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {', '.join(DOCUMENTS)}")
    args = parser.parse_args()
    table = support_table()
    if not args.write:
        print(table, end="")
        return
    for name in DOCUMENTS:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        updated = with_support_table(text, table)
        if updated != text:
            path.write_text(updated, encoding="utf-8")
        print(f"{name}: {'rewritten' if updated != text else 'up to date'}")


if __name__ == "__main__":
    main()
