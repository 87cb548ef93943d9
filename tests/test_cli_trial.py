"""From a new user's trial of ``rope-ext eval``: results folders that resume after an interrupted run."""

from __future__ import annotations

import re

import pytest

from rope_ext.eval.results import ResultStore


# --- 2. a half-written last record --------------------------------------------------------------------


def test_the_store_drops_a_half_written_last_record_once(tmp_path):
    records = tmp_path / "ppl_records.jsonl"
    records.write_text('{"n": 1}\n{"n": 2}\n{"n": ')
    warnings: list[str] = []
    store = ResultStore(tmp_path, "ppl", {"a": 1}, warn=warnings.append)
    assert store.records() == store.records() == [{"n": 1}, {"n": 2}]
    assert warnings == [f"{records}, line 3: a half-written record (an interrupted run?) is dropped: '{{\"n\": '"]
    store.append({"n": 3})  # (the cut line goes first)
    assert records.read_text() == '{"n": 1}\n{"n": 2}\n{"n": 3}\n' and len(warnings) == 1
    records.write_text('{"n": 1}\nnope\n{"n": 2}\n')
    with pytest.raises(ValueError, match=re.escape(f"{records}, line 2: not a JSON record (Expecting value")):
        ResultStore(tmp_path, "ppl", {"a": 1}).records()
    assert ResultStore(tmp_path, "ppl", {"a": 1}, overwrite=True).records() == []  # (replaced at the first write)


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    store = ResultStore(tmp_path, "ppl", {"a": 1})
    store.append({"n": 1})
    (tmp_path / "ppl_records.jsonl").write_text('{"n": 1}\n{"n": 2}')  # cut just before the newline
    store = ResultStore(tmp_path, "ppl", {"a": 1})
    assert store.records() == [{"n": 1}, {"n": 2}]
    store.append({"n": 3})
    assert store.records() == [{"n": 1}, {"n": 2}, {"n": 3}]
    (tmp_path / "ppl_run.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'ppl_run.json'} is not a run configuration")):
        ResultStore(tmp_path, "ppl", {"a": 1})
