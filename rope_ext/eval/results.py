"""An output folder that resumes: the run's configuration, records appended as they are made, tables.

``<kind>_run.json`` holds what makes records comparable (model, protocol, data, ...). A re-run with the
same configuration skips the records already in ``<kind>_records.jsonl``; methods and lengths may be
added. A different configuration is refused unless ``overwrite``, which starts the kind afresh.
Nothing is written before the first record or table, so a run that fails before producing anything
leaves no configuration behind to block its corrected re-run.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any


class ResultStore:
    def __init__(self, out: str | Path, kind: str, run_config: dict[str, Any], overwrite: bool = False) -> None:
        self.out = Path(out)
        self.kind = kind
        self.overwrite = overwrite
        self.run_path = self.out / f"{kind}_run.json"
        self.records_path = self.out / f"{kind}_records.jsonl"
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {str(out)!r} is a file; give a folder (created if missing)")
        self.run_config = json.loads(json.dumps(run_config))  # normalise tuples etc. as JSON would
        self._stale = False  # results of another configuration, to delete before the first write
        self._written = False
        if self.run_path.exists():
            previous = json.loads(self.run_path.read_text())
            if previous != self.run_config:
                keys = previous.keys() | self.run_config.keys()
                changed = sorted(k for k in keys if previous.get(k) != self.run_config.get(k))
                self.refuse(f"of a different configuration (differs in: {', '.join(changed)})")

    def refuse(self, why: str) -> None:
        """Raise ``ValueError`` (the folder holds results this run must not mix with), or with
        ``overwrite`` mark them for deletion before this run's first write."""
        if not self.overwrite:
            raise ValueError(
                f"{self.out} holds {self.kind} results {why}; pass --overwrite to replace them, or choose another --out"
            )
        self._stale = True

    def clear(self) -> None:
        for pattern in (f"{self.kind}_*", f"{self.kind}.*"):
            for path in self.out.glob(pattern):
                path.unlink()

    def _open(self) -> None:
        if self._written:
            return
        if self._stale:
            self.clear()
            self._stale = False
        self.out.mkdir(parents=True, exist_ok=True)
        self.run_path.write_text(json.dumps(self.run_config, indent=2))
        self._written = True

    def records(self) -> list[dict[str, Any]]:
        if self._stale or not self.records_path.exists():
            return []
        return [json.loads(line) for line in self.records_path.read_text().splitlines() if line.strip()]

    def append(self, record: dict[str, Any]) -> None:
        self._open()
        with self.records_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def write_tables(self, records: list[dict[str, Any]], summary: list[dict[str, Any]]) -> dict[str, Path]:
        """``<kind>.json`` (run, records, summary), ``<kind>.csv`` (records), ``<kind>_summary.csv``."""
        self._open()
        paths = {
            "json": self.out / f"{self.kind}.json",
            "csv": self.out / f"{self.kind}.csv",
            "summary_csv": self.out / f"{self.kind}_summary.csv",
        }
        paths["json"].write_text(
            json.dumps({"run": self.run_config, "summary": summary, "records": records}, indent=2)
        )
        _write_csv(paths["csv"], records)
        _write_csv(paths["summary_csv"], summary)
        return paths


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    fields = list(rows[0])
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()})


def load_results(out: str | Path, kind: str) -> dict[str, Any] | None:
    path = Path(out) / f"{kind}.json"
    return json.loads(path.read_text()) if path.exists() else None
