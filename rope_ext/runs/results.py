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


def _warn(message: str) -> None:
    print(f"rope-ext: warning: {message}", file=sys.stderr)


def read_json(path: Path, what: str) -> Any:
    """``path``'s JSON; a file that does not parse is a ``ValueError`` naming it."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is not {what} rope-ext wrote ({type(error).__name__}: {error}); "
            "remove it or pass --overwrite to start the folder afresh"
        ) from None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_differences(
    previous: dict[str, Any],
    current: dict[str, Any],
    *,
    may_change: Iterable[str] = (),
    normalise: Callable[[str, Any], Any] | None = None,
    labels: dict[str, str] | None = None,
) -> list[str]:
    """What differs between two run configurations, one ``"key: <old> before, <new> now"`` per key (a dict
    value: per entry that differs); keys in ``may_change`` are not compared, and ``normalise(key, value)``
    is applied to both sides first (e.g. resolving paths). ``labels[key]`` says what a changed value of
    ``key`` means (an entry of a dict: one in both)."""
    labels = labels or {}
    normalise = normalise or (lambda key, value: value)
    skip = set(may_change)
    differences = []
    for key in [*previous, *(k for k in current if k not in previous)]:
        if key in skip:
            continue
        old, new = normalise(key, previous.get(key)), normalise(key, current.get(key))
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            for entry in [*old, *(e for e in new if e not in old)]:
                if old.get(entry) != new.get(entry):
                    before = _short(old[entry]) if entry in old else "absent"
                    now = _short(new[entry]) if entry in new else "absent"
                    label = f" ({labels[key]})" if key in labels and entry in old and entry in new else ""
                    differences.append(f"{key}[{entry!r}]: {before} before, {now} now{label}")
        else:
            label = f" ({labels[key]})" if key in labels else ""
            differences.append(f"{key}: {_short(old)} before, {_short(new)} now{label}")
    return differences


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
                        f"{_short(line.decode('utf-8', 'replace'), 60)}"
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


class ResultStore:
    """``ResultStore(out, kind, run_config)`` checks ``run_config`` against the folder's at once (see
    ``configure``); with ``run_config=None`` the folder can be read first (``previous``, ``records``) and
    the configuration given later."""

    def __init__(
        self,
        out: str | Path,
        kind: str,
        run_config: dict[str, Any] | None = None,
        overwrite: bool = False,
        *,
        warn: Callable[[str], None] = _warn,
    ) -> None:
        self.out = Path(out)
        self.kind = kind
        self.overwrite = overwrite
        self.warn = warn
        self.run_path = self.out / f"{kind}_run.json"
        self.records_path = self.out / f"{kind}_records.jsonl"
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {str(out)!r} is a file; give a folder (created if missing)")
        self.previous: dict[str, Any] | None = None  # the folder's run configuration
        self.run_config: dict[str, Any] = {}
        self._stale = False  # results of another configuration, to delete before the first write
        if self.run_path.exists():
            try:
                self.previous = read_json(self.run_path, "a run configuration")
                if not isinstance(self.previous, dict):
                    raise ValueError(
                        f"{self.run_path} is not a run configuration rope-ext wrote (a JSON "
                        f"{type(self.previous).__name__}); remove it or pass --overwrite to start the folder afresh"
                    )
            except ValueError:
                if not overwrite:
                    raise
                self.previous, self._stale = None, True
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
            self.refuse(f"of a different configuration (differs in: {'; '.join(differences)})")

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
