"""An output folder that resumes: the run's configuration, records appended as they are made, tables.

``<kind>_run.json`` holds what makes records comparable (model, protocol, data, ...). A re-run with the
same configuration skips the records already in ``<kind>_records.jsonl``; methods and lengths may be
added. A different configuration is refused unless ``overwrite``, which starts the kind afresh; the
refusal names each value that differs, the folder's and this run's. Nothing is written before the first
record or table, so a run that fails before producing anything leaves no configuration behind to block
its corrected re-run.

Records are appended one JSON line at a time, so an interrupted run may leave a half-written last line:
it is dropped, with a warning naming the file and line, and the next write removes it. A line that does
not parse elsewhere is an error naming the file and line.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rope_ext.runs.folder import RunFolder, config_differences, short


def _warn(message: str) -> None:
    print(f"rope-ext: warning: {message}", file=sys.stderr)


def read_records(path: Path, warn: Callable[[str], None] = _warn) -> tuple[list[dict[str, Any]], int | None]:
    """The records of a ``<kind>_records.jsonl`` and, when its last line is half-written (an interrupted
    run: no newline at its end, and no JSON), the size the file has without it (else ``None``)."""
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    lines = data.split(b"\n")
    offset = 0
    for number, line in enumerate(lines, start=1):
        last = number == len(lines)  # (the text after the final newline: empty unless it was cut short)
        if line.strip():
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                if last:
                    warn(
                        f"{path}, line {number}: a half-written record (an interrupted run?) is dropped: "
                        f"{short(line.decode('utf-8', 'replace'), 60)}"
                    )
                    return records, offset
                raise ValueError(
                    f"{path}, line {number}: not a JSON record ({error}); fix or delete that line, or pass "
                    "--overwrite to start the folder afresh"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}, line {number}: not a record (a JSON {type(record).__name__}, not an object); fix or "
                    "delete that line, or pass --overwrite to start the folder afresh"
                )
            records.append(record)
        offset += len(line) + 1
    return records, None


class ResultStore(RunFolder):
    """``ResultStore(out, kind, run_config)`` checks ``run_config`` against the folder's at once (see
    ``configure``); with ``run_config=None`` the folder can be read first (``previous``, ``records``) and
    the configuration given later. Its options file is ``<kind>_run.json``; the rules and the refusal are
    ``RunFolder``'s, with one difference: ``overwrite`` replaces only this kind's files, at the first write."""

    def __init__(
        self,
        out: str | Path,
        kind: str,
        run_config: dict[str, Any] | None = None,
        overwrite: bool = False,
        *,
        warn: Callable[[str], None] = _warn,
    ) -> None:
        super().__init__(out, f"{kind}_run.json", f"{kind} results", overwrite)
        self.kind = kind
        self.warn = warn
        self.run_path = self.options_path
        self.records_path = self.out / f"{kind}_records.jsonl"
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {str(out)!r} is a file; give a folder (created if missing)")
        self.previous: dict[str, Any] | None = None  # the folder's run configuration
        self.run_config: dict[str, Any] = {}
        self._stale = False  # results of another configuration, to delete before the first write
        try:
            self.previous = self.saved()
        except ValueError:
            if not overwrite:
                raise
            self._stale = True
        self._written = False
        self._cached: tuple[list[dict[str, Any]], int | None] | None = None
        if run_config is not None:
            self.configure(run_config)

    @property
    def stale(self) -> bool:
        """Whether the folder's results are to be replaced (refused with ``overwrite``)."""
        return self._stale

    def configure(
        self,
        run_config: dict[str, Any],
        *,
        may_change: Iterable[str] = (),
        normalise: Callable[[str, Any], Any] | None = None,
        unchecked: Iterable[str] = (),
        labels: dict[str, str] | None = None,
    ) -> None:
        """This run's configuration; one that differs from the folder's is refused (``refuse``).

        ``may_change``: keys whose value may differ (this run's is written); ``normalise(key, value)`` is
        applied to both sides before comparing; ``unchecked``: keys a folder written by an older rope-ext may
        lack (accepted with a warning, then recorded); ``labels``: see ``config_differences``.
        """
        self.run_config = json.loads(json.dumps(run_config))  # normalise tuples etc. as JSON would
        if self.previous is None or self._stale:
            return
        lacking = [key for key in unchecked if key not in self.previous and key in self.run_config]
        if lacking:
            self.warn(
                f"{self.run_path} has no {', '.join(lacking)} (written by an older rope-ext): resuming without "
                "checking it; this run records it"
            )
        differences = config_differences(
            self.previous, self.run_config, may_change=[*may_change, *lacking], normalise=normalise, labels=labels
        )
        if differences:
            self.refuse_differences(differences)

    def precheck(self, partial: dict[str, Any], *, may_change: Iterable[str] = (),
                 normalise: Callable[[str, Any], Any] | None = None, labels: dict[str, str] | None = None) -> None:
        """``configure``'s refusal on the keys of ``partial`` the folder records, before what the others need (the
        model) is loaded; ``configure`` later checks the whole."""
        if self.previous is None or self._stale:
            return
        partial = {key: value for key, value in json.loads(json.dumps(partial)).items() if key in self.previous}
        previous = {key: self.previous[key] for key in partial}
        differences = config_differences(previous, partial, may_change=may_change, normalise=normalise,
                                         labels=labels)
        if differences:
            self.refuse_differences(differences)

    def refuse(self, why: str, resume: str = "") -> None:
        """Raise ``ValueError`` (the folder holds results this run must not mix with), or with
        ``overwrite`` mark them for deletion before this run's first write."""
        if not self.overwrite:
            super().refuse(why, resume)
        self._stale = True

    def clear(self) -> None:
        for pattern in (f"{self.kind}_*", f"{self.kind}.*"):
            for path in self.out.glob(pattern):
                path.unlink()
        self._cached = None

    def _read(self) -> tuple[list[dict[str, Any]], int | None]:
        if self._cached is None:  # (read once: the warning on a half-written last line is given once)
            self._cached = read_records(self.records_path, self.warn)
        return self._cached

    def _read_or_replace(self) -> list[dict[str, Any]]:
        try:
            return list(self._read()[0])
        except ValueError:  # a corrupt line: an error, or with overwrite records to replace
            if not self.overwrite:
                raise
            self._stale = True
            return []

    def _open(self) -> None:
        if self._written:
            return
        if self._stale:
            self.clear()
            self._stale = False
        elif self.records_path.exists():
            _, cut = self._read()
            if cut is not None:  # drop the half-written line, so the next record starts a line of its own
                with self.records_path.open("r+b") as handle:
                    handle.truncate(cut)
            elif self.records_path.stat().st_size and not self.records_path.read_bytes().endswith(b"\n"):
                with self.records_path.open("ab") as handle:  # a whole record cut before its newline
                    handle.write(b"\n")
        self.out.mkdir(parents=True, exist_ok=True)
        self.run_path.write_text(json.dumps(self.run_config, indent=2))
        self._written = True

    def records(self) -> list[dict[str, Any]]:
        if self._stale or not self.records_path.exists():
            return []
        if not self._written:
            return self._read_or_replace()
        return read_records(self.records_path, self.warn)[0]  # (this run's own writes included)

    def append(self, record: dict[str, Any]) -> None:
        self._open()
        with self.records_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def write_tables(
        self, records: list[dict[str, Any]], summary: list[dict[str, Any]], extra: dict[str, Any] | None = None
    ) -> dict[str, Path]:
        """``<kind>.json`` (run, summary, ``extra``'s keys, records), ``<kind>.csv`` (records),
        ``<kind>_summary.csv``."""
        self._open()
        paths = {
            "json": self.out / f"{self.kind}.json",
            "csv": self.out / f"{self.kind}.csv",
            "summary_csv": self.out / f"{self.kind}_summary.csv",
        }
        paths["json"].write_text(
            json.dumps({"run": self.run_config, "summary": summary, **(extra or {}), "records": records}, indent=2)
        )
        _write_csv(paths["csv"], records)
        _write_csv(paths["summary_csv"], summary)
        return paths


def in_order(
    rows: list[dict[str, Any]], methods: Iterable[str] = (), key: Callable[[dict[str, Any]], Any] = lambda row: ()
) -> list[dict[str, Any]]:
    """Summary rows in one order whatever the order of the records they summarise (a resumed run appends its records
    after the folder's): by method, ``methods`` first as given and any other as it first comes, then by ``key(row)``
    (the length ascending, ...)."""
    rank = {method: i for i, method in enumerate(dict.fromkeys([*methods, *(row["method"] for row in rows)]))}
    return sorted(rows, key=lambda row: (rank[row["method"]], key(row)))


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
