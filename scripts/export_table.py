"""Print the export table (``rope_ext.serving.table.export_table``), or rewrite it in docs/serving.md (the block between
``<!-- export-table:start -->`` and ``<!-- export-table:end -->``) with ``--write``.

    python scripts/export_table.py            # print it
    python scripts/export_table.py --write    # rewrite docs/serving.md's block (tests/test_serving.py checks it)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rope_ext.serving.table import export_table, with_export_table

DOCUMENT = Path(__file__).resolve().parent.parent / "docs" / "serving.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOCUMENT.name}")
    args = parser.parse_args()
    table = export_table()
    if not args.write:
        print(table, end="")
        return
    text = DOCUMENT.read_text(encoding="utf-8")
    updated = with_export_table(text, table)
    if updated != text:
        DOCUMENT.write_text(updated, encoding="utf-8")
    print(f"{DOCUMENT.name}: {'rewritten' if updated != text else 'up to date'}")


if __name__ == "__main__":
    main()
