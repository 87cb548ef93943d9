"""From a new user's trial of ``rope-ext eval``, ``plot`` and ``methods``: resuming, bad values, method help.

Tiny models in seconds (the ``tiny_checkpoint`` of test_eval: a tiny Llama and a word-level tokenizer).
"""

from __future__ import annotations

import json
import os
import re
from unittest import mock

import pytest
from test_eval import tiny_checkpoint  # noqa: F401  (a fixture)

from rope_ext.cli import main
from rope_ext.runs.results import ResultStore

WORDS = ["alpha", "beta", "gamma", "delta"]


def _text(path, words: int, shift: int = 0):
    path.write_text(" ".join(WORDS[(i + shift) % 4] for i in range(words)))
    return path


def _ppl(checkpoint, out, *extra, lengths="32,64", methods="none", target="16", text=None):
    data = [] if "--text-files" in extra or "--dataset" in extra else ["--text-files", str(text)]
    targets = [] if {"curve", "sliding"} & set(extra) else ["--target-tokens", target]  # (fixed targets only)
    return main(
        ["eval", "ppl", "--model", str(checkpoint), *data, "--lengths", lengths, *targets,
         "--methods", methods, "--out", str(out), "--no-plot", *extra]
    )


def _lines(path) -> list[str]:
    return path.read_text().splitlines()


def _spans(out) -> set[tuple]:
    return {(r["method"], r["length"], r["start"], r["end"]) for r in map(json.loads, _lines(out / "ppl_records.jsonl"))}


# --- 1. a document is known by its content ------------------------------------------------------------


def test_a_changed_document_of_the_same_path_is_another_configuration(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, text=text) == 0
    digest = json.loads((out / "ppl_run.json").read_text())["document_sha256"]["doc.txt"]
    before = _lines(out / "ppl_records.jsonl")
    _text(text, 400, shift=1)  # same path, same length, other text
    capsys.readouterr()
    assert _ppl(checkpoint, out, methods="none,pi:factor=2", text=text) == 2
    err = capsys.readouterr().err
    assert f"document_sha256['doc.txt']: '{digest}' before, '" in err
    assert "(the document changed: same name, other text)" in err and "pass --overwrite" in err
    assert _lines(out / "ppl_records.jsonl") == before  # nothing scored on the new text
    assert _ppl(checkpoint, out, "--overwrite", methods="none,pi:factor=2", text=text) == 0
    assert json.loads((out / "ppl_run.json").read_text())["document_sha256"]["doc.txt"] != digest
    assert len(_lines(out / "ppl_records.jsonl")) == 4


def test_a_folder_without_document_hashes_resumes_with_a_warning(tmp_path, tiny_checkpoint, capsys):
    """Folders written before the hashes (docs/results/*) still resume; the run records the hashes."""
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, text=text) == 0
    run = json.loads((out / "ppl_run.json").read_text())
    old = {k: v for k, v in run.items() if k not in ("document_sha256", "lengths")}
    old |= {"model": os.path.relpath(str(checkpoint)), "model_name": str(checkpoint), "min_tokens": 32768}
    (out / "ppl_run.json").write_text(json.dumps(old))
    capsys.readouterr()
    assert _ppl(checkpoint, out, lengths="48", text=text) == 0
    assert "has no document_sha256 (written by an older rope-ext)" in capsys.readouterr().err
    assert json.loads((out / "ppl_run.json").read_text())["document_sha256"] == run["document_sha256"]
    assert _spans(out) == {("none", 32, 48, 64), ("none", 64, 48, 64), ("none", 48, 48, 64)}


# --- 2. a half-written last record --------------------------------------------------------------------


def test_a_half_written_last_record_is_dropped_and_the_run_resumes(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, text=text) == 0
    records = out / "ppl_records.jsonl"
    whole = _lines(records)
    with records.open("a") as handle:
        handle.write(whole[0][:40])  # an interrupted run: a record cut short, no newline
    capsys.readouterr()
    assert _ppl(checkpoint, out, methods="none,pi:factor=2", text=text) == 0
    err = capsys.readouterr().err
    assert f"rope-ext: warning: {records}, line 3: a half-written record (an interrupted run?) is dropped" in err
    lines = _lines(records)
    assert lines[:2] == whole and len(lines) == 4 and all(json.loads(line) for line in lines)


def test_a_corrupt_record_elsewhere_names_the_file_and_line(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, text=text) == 0
    records = out / "ppl_records.jsonl"
    whole = _lines(records)
    records.write_text(whole[0][:40] + "\n" + whole[1] + "\n")
    capsys.readouterr()
    assert _ppl(checkpoint, out, methods="none,pi:factor=2", text=text) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {records}, line 1: not a JSON record (" in err and "Traceback" not in err
    assert _ppl(checkpoint, out, "--overwrite", methods="none,pi:factor=2", text=text) == 0  # starts afresh
    assert len(_lines(records)) == 4


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


# --- 3. the same inputs spelled differently; adding lengths ------------------------------------------


def test_paths_spelled_differently_are_the_same_configuration(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    checkpoint, _ = tiny_checkpoint
    _text(tmp_path / "doc.txt", 400)
    monkeypatch.chdir(tmp_path)
    assert _ppl(checkpoint, "run", "--text-files", "doc.txt") == 0
    before = _lines(tmp_path / "run" / "ppl_records.jsonl")
    assert _ppl(f"{checkpoint}/", tmp_path / "run", "--text-files", str(tmp_path / "doc.txt")) == 0
    assert _ppl(checkpoint, "run/", "--text-files", "./doc.txt") == 0
    assert _lines(tmp_path / "run" / "ppl_records.jsonl") == before  # resumed: nothing recomputed
    capsys.readouterr()
    # a refusal shows the folder's value and this run's of each difference
    assert _ppl(checkpoint, "run", "--text-files", "doc.txt", "--protocol", "curve") == 2
    assert ("differs in: protocol: 'fixed' before, 'curve' now; target_tokens: 16 before, None now); re-run with its "
            "options to resume") in capsys.readouterr().err


def test_fixed_protocol_lengths_are_added_alone_up_to_the_longest(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, lengths="32,128", text=text) == 0
    # one length, not restating the others: scored on the folder's targets (the last 16 before 128)
    assert _ppl(checkpoint, out, lengths="64", methods="none,pi:factor=2", text=text) == 0
    assert _spans(out) == {("none", 32, 112, 128), ("none", 128, 112, 128), ("none", 64, 112, 128),
                           ("pi:factor=2", 64, 112, 128)}
    assert json.loads((out / "ppl_run.json").read_text())["lengths"] == [32, 64, 128]
    capsys.readouterr()
    assert _ppl(checkpoint, out, lengths="64,256", text=text) == 2
    err = capsys.readouterr().err
    assert ("whose targets --lengths 256 would move: the fixed protocol scores the last 16 tokens before the longest "
            "length, and the folder's is 128. Lengths can be added only where they leave the targets as they were: "
            "here above --target-tokens 16 and up to 128") in err
    assert "; give another --out, or pass --overwrite to replace them" in err
    assert _ppl(checkpoint, out, "--overwrite", lengths="64,256", text=text) == 0
    assert _spans(out) == {("none", 64, 240, 256), ("none", 256, 240, 256)}


def test_curve_protocol_lengths_are_added_alone_beyond_the_last(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, "--protocol", "curve", lengths="32,64", text=text) == 0
    assert _ppl(checkpoint, out, "--protocol", "curve", lengths="128", text=text) == 0
    assert _spans(out) == {("none", 32, 1, 32), ("none", 64, 32, 64), ("none", 128, 64, 128)}
    capsys.readouterr()
    assert _ppl(checkpoint, out, "--protocol", "curve", lengths="48", text=text) == 2
    assert ("whose buckets --lengths 48 would split: the curve protocol scores each length's bucket (previous length, "
            "length], and the folder's lengths are 32,64,128. Lengths can be added only where they leave the buckets "
            "as they were: here beyond the last, 128") in capsys.readouterr().err
    sliding = ("--protocol", "sliding", "--stride", "16")
    assert _ppl(checkpoint, out, *sliding, "--overwrite", lengths="32,64", text=text) == 0
    assert _ppl(checkpoint, out, *sliding, lengths="48", text=text) == 0  # sliding: anywhere
    assert {length for _, length, _, _ in _spans(out)} == {32, 48, 64}


def test_windows_whose_target_end_moves_are_refused_naming_the_end_not_a_changed_document(
        tmp_path, tiny_checkpoint, capsys):
    """``--windows``: each window is the target end's tokens, so a moved end (``--target-end``, or a longer length)
    cuts other windows under the same names; the refusal says the targets differ, before and now, and how to resume
    (it read as 'the document changed')."""
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, "--target-end", "64", "--windows", "2", lengths="32", text=text) == 0
    before = _lines(out / "ppl_records.jsonl")
    capsys.readouterr()
    assert _ppl(checkpoint, out, "--target-end", "128", "--windows", "2", lengths="32", text=text) == 2
    err = capsys.readouterr().err
    assert (f"rope-ext: error: --out {out} holds ppl results whose targets differ (where they end, --target-end: 64 "
            "before, 128 now): --windows 2 scores each document's windows of the target end's tokens, so another end "
            "scores other windows; re-run with --target-end 64 to resume, give another --out, or pass --overwrite to "
            "replace them\n") in err and "the document changed" not in err
    assert _ppl(checkpoint, out, "--windows", "2", lengths="32,64,128", text=text) == 2
    assert ("whose targets differ (where they end, the longest of --lengths: 64 before, 128 now): --windows 2 scores "
            "each document's windows of the target end's tokens, so another end scores other windows; re-run with "
            "lengths up to 64 to resume") in capsys.readouterr().err
    assert _lines(out / "ppl_records.jsonl") == before
    assert _ppl(checkpoint, out, "--target-end", "64", "--windows", "2", lengths="32,64", text=text) == 0  # (resumed)
    assert _ppl(checkpoint, out, "--overwrite", "--target-end", "128", "--windows", "2", lengths="32", text=text) == 0
    assert _spans(out) == {("none", 32, 112, 128)}


def test_a_resumed_run_writes_its_summary_in_the_order_of_a_run_in_one_go(tmp_path, tiny_checkpoint):
    """The summary's rows by method as given, then length (passkey: then depth), however the folder's records came:
    here the methods and lengths of a run in one go, in two runs of which the first did the last method and length."""
    checkpoint, _ = tiny_checkpoint
    text = _text(tmp_path / "doc.txt", 400)
    assert _ppl(checkpoint, tmp_path / "one", lengths="32,64", methods="none,pi:factor=2", text=text) == 0
    assert _ppl(checkpoint, tmp_path / "two", lengths="64", methods="pi:factor=2", text=text) == 0
    assert _ppl(checkpoint, tmp_path / "two", lengths="32,64", methods="none,pi:factor=2", text=text) == 0
    one, two = (_lines(tmp_path / run / "ppl_summary.csv") for run in ("one", "two"))
    assert [line.split(",")[:3] for line in one[1:]] == [["none", "fixed", "32"], ["none", "fixed", "64"],
                                                         ["pi:factor=2", "fixed", "32"], ["pi:factor=2", "fixed", "64"]]
    assert two == one
    passkey = ["eval", "passkey", "--model", str(checkpoint), "--depths", "0.2,0.8", "--trials", "1", "--no-plot"]
    assert main([*passkey, "--lengths", "64,96", "--methods", "none,pi:factor=2", "--out", str(tmp_path / "p1")]) == 0
    assert main([*passkey, "--lengths", "96", "--methods", "pi:factor=2", "--out", str(tmp_path / "p2")]) == 0
    assert main([*passkey, "--lengths", "64,96", "--methods", "none,pi:factor=2", "--out", str(tmp_path / "p2")]) == 0
    one, two = (_lines(tmp_path / run / "passkey_summary.csv") for run in ("p1", "p2"))
    assert [line.split(",")[:3] for line in one[1:3]] == [["none", "64", "0.2"], ["none", "64", "0.8"]]
    assert two == one


# --- 4. files that are not documents; lengths no document provides -----------------------------------


@pytest.mark.parametrize("lengths", ["32,401", "32,4k", "401"])
def test_a_length_no_document_provides_is_an_error_naming_the_longest(tmp_path, tiny_checkpoint, capsys, lengths):
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, lengths=lengths, text=text) == 2
    too_long = ",".join(str(int(L[:-1]) * 1024 if L.endswith("k") else int(L)) for L in lengths.split(",")[-1:])
    assert (f"rope-ext: error: --lengths {too_long}: no document is that long (the longest, 'doc.txt', has 400 "
            "tokens); give lengths up to 400 and above --target-tokens 16, or longer texts") in capsys.readouterr().err
    assert not out.exists()


def test_fixed_protocol_lengths_up_to_the_target_are_an_error(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    text, out = _text(tmp_path / "doc.txt", 400), tmp_path / "run"
    assert _ppl(checkpoint, out, lengths="16,64", text=text) == 2
    assert ("rope-ext: error: --lengths 16: not above --target-tokens 16: the fixed-target protocol scores the last "
            "--target-tokens tokens of each length") in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "path, message",
    [
        ("/dev/null", "--text-files: /dev/null is not a regular file (a device, pipe or socket)"),
        ("{tmp}", "--text-files: {tmp} is a folder; give plain-text files"),
        ("{tmp}/empty.txt", "--text-files: {tmp}/empty.txt is empty"),
        ("{tmp}/missing.txt", "--text-files: {tmp}/missing.txt not found"),
    ],
)
def test_text_files_that_are_no_documents_say_what_they_are(tmp_path, tiny_checkpoint, capsys, path, message):
    checkpoint, _ = tiny_checkpoint
    (tmp_path / "empty.txt").write_text("")
    assert _ppl(checkpoint, tmp_path / "run", "--text-files", path.format(tmp=tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {message.format(tmp=tmp_path)}" in err
    assert ("not found" in err) == ("missing" in path)  # (it exists: not "not found")


# --- 5. --min-tokens follows the lengths --------------------------------------------------------------


def test_min_tokens_defaults_to_the_longest_length(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    long, short = _text(tmp_path / "long.txt", 400), _text(tmp_path / "short.txt", 50)
    out = tmp_path / "run"
    assert _ppl(checkpoint, out, "--text-files", str(long), str(short), "--documents", "2", lengths="32,64") == 0
    run = json.loads((out / "ppl_run.json").read_text())
    assert run["min_tokens"] == 64 and list(run["document_sha256"]) == ["long.txt"]  # short.txt cannot provide 64
    assert "1 document(s): long.txt (400 tokens)" in capsys.readouterr().out
    assert _ppl(checkpoint, tmp_path / "b", "--text-files", str(short), lengths="32,64") == 2
    assert ("--lengths 64: no document is that long (the longest, 'short.txt', has 50 tokens)"
            in capsys.readouterr().err)
    assert _ppl(checkpoint, tmp_path / "c", "--text-files", str(short), "--min-tokens", "100", lengths="32") == 2
    assert ("--min-tokens 100: no document has at least 100 tokens (the longest, 'short.txt', has 50)"
            in capsys.readouterr().err)


# --- 6. rope-ext methods ------------------------------------------------------------------------------


def test_methods_lists_hook_kinds_and_meanings(capsys):
    import rope_ext
    from rope_ext.methods import get_method_class

    assert main(["methods"]) == 0
    out = capsys.readouterr().out.split("\n\n")[0]
    assert max(len(line) for line in out.splitlines()) <= 120  # (wrapped under the summary's column)
    entries: dict[str, str] = {}
    for line in out.splitlines():  # (a method's line, then its summary's continuation lines, indented)
        if line[:1].strip():
            name = line.split()[0]
            entries[name] = line
        else:
            entries[name] += " " + line.strip()
    assert list(entries) == rope_ext.list_methods()
    lines = list(entries.values())
    for name, line in entries.items():
        assert line.split()[1] == get_method_class(name).hook and len(line.split()) > 3  # a meaning follows
        assert "(no description)" not in line, f"rope-ext methods prints no description for {name}: {line}"
    assert any(re.match(r"dca +position_rule +Dual Chunk Attention", line) for line in lines)
    assert any(re.match(r"pi +frequency +Position Interpolation", line) for line in lines)  # (its declared summary)
    yarn = entries["yarn"]  # (the summary's first sentence)
    assert yarn.endswith("(or DeepSeek's mscale / mscale_all_dim ratio).") and "Saved as" not in yarn


def test_methods_name_shows_options_types_defaults_and_documentation(capsys):
    assert main(["methods", "yarn"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("yarn (hook kind: frequency)")
    assert re.search(r"^  factor +float +\(required\)$", out, flags=re.MULTILINE)
    assert re.search(r"^  beta_fast +float +32\.0$", out, flags=re.MULTILINE)
    assert re.search(r"^  original_max_position_embeddings +int \| None +None\n +L, the context the model was "
                     r"trained at; None: the model config's", out, flags=re.MULTILINE)
    assert "YaRN" in out
    assert main(["methods", "dynamic_ntk"]) == 0
    assert re.search(r"^  factor +float +1\.0$", capsys.readouterr().out, flags=re.MULTILINE)
    assert main(["methods", "dca"]) == 0
    out = capsys.readouterr().out
    assert "Dual Chunk Attention" in out and "chunk_size" in out and "None: 3L/4 (the reference's)" in out
    for name in ("t5_bucket_extend", "deberta_bucket_stretch", "xlnet_interp"):  # (None means "not given": refused,
        # so the type shown has no "| None")
        assert main(["methods", name]) == 0
        assert re.search(r"^  factor +float +\(required\)$", capsys.readouterr().out, flags=re.MULTILINE)
    assert main(["methods", "yarm"]) == 2
    assert "rope-ext: error: unknown method 'yarm'; valid methods: abs_hierarchical, abs_interp, alibi, dca, deberta_bucket_scale, deberta_bucket_stretch, dynamic_ntk" in capsys.readouterr().err


def option_meanings(out: str) -> dict[str, str]:
    """Each option row of ``rope-ext methods NAME`` and the indented lines under it, joined: ``{option: meaning}``."""
    meanings: dict[str, list[str]] = {}
    rows = out.split("options (set in a spec as name:option=value):\n", 1)[1].splitlines()
    for line in rows:
        if re.match(r"^  \S", line):
            meanings[line.split()[0]] = []
        else:
            assert line.startswith("      ") and len(line) <= 100, f"a meaning line not wrapped and indented: {line!r}"
            meanings[list(meanings)[-1]].append(line.strip())
    return {name: " ".join(lines) for name, lines in meanings.items()}


def test_methods_name_prints_each_options_declared_meaning_under_it(capsys):
    import dataclasses

    import rope_ext
    from rope_ext.methods import get_method_class
    from rope_ext.methods.options import meaning_of

    assert main(["methods", "yarn"]) == 0
    meanings = option_meanings(capsys.readouterr().out)
    assert meanings["truncate"] == ("whether the correction range's bounds (the ramp's ends as dimension indices) are "
                                    "floored and ceiled to whole dimensions, as transformers and the YaRN reference do; "
                                    "False: kept fractional")
    assert "DeepSeek's attention-temperature" in meanings["mscale"] and "rotations" in meanings["beta_fast"]
    for name in rope_ext.list_methods():  # (every option of every method: its declared meaning, nothing else)
        cls = get_method_class(name)
        assert main(["methods", name]) == 0
        out = capsys.readouterr().out
        assert " ".join(cls.summary.split()).replace("``", "") in " ".join(out.split())
        declared = {f.name: " ".join(meaning_of(f).split()).replace("``", "") for f in dataclasses.fields(cls)
                    if f.name not in cls.unused_shared_options}  # (an option it refuses is not listed)
        assert option_meanings(out) == declared and "(no description)" not in out


# --- 7. every bad value: `rope-ext: error: ...` naming the option, status 2, nothing written -----------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", ""], "argument --model: must not be empty"),
        (["--model", "{file}"], "argument --model: '{file}' is a file"),
        (["--out", ""], "argument --out: must not be empty"),
        (["--out", "{file}/sub"], "argument --out: '{file}/sub' cannot be created: '{file}' is a file"),
        (["--lengths", ""], "argument --lengths: give at least one length"),
        (["--lengths", "0"], "argument --lengths: length must be at least 2 tokens, got '0'"),
        (["--lengths", "-64"], "argument --lengths: length must be at least 2 tokens, got '-64'"),
        (["--lengths", "99999999999"], "argument --lengths: length '99999999999' is over 16777216 tokens"),
        (["--methods", ""], "argument --methods: give at least one method"),
        (["--methods", ","], "argument --methods: give at least one method"),
        (["--threads", "abc"], "argument --threads: must be an integer in [0, 1024], got 'abc'"),
        (["--threads", "100000"], "argument --threads: must be an integer in [0, 1024], got '100000'"),
        (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["--layer-types", ","], "argument --layer-types: give at least one layer type"),
        (["--target-tokens", "abc"], "argument --target-tokens: must be an integer >= 1, got 'abc'"),
        (["--target-tokens", "-1"], "argument --target-tokens: must be an integer >= 1, got '-1'"),
        (["--stride", "abc"], "argument --stride: must be an integer >= 1, got 'abc'"),
        (["--documents", "-1"], "argument --documents: must be an integer >= 1, got '-1'"),
        (["--min-tokens", "abc"], "argument --min-tokens: malformed length 'abc'"),
        (["--min-tokens", ""], "argument --min-tokens: malformed length ''"),
        (["--text-files", ""], "argument --text-files: must not be empty"),
        (["--dataset", ""], "argument --dataset: must not be empty"),
        (["--dataset", "{file}"], "argument --dataset: '{file}' is a file"),
        (["--dataset", "{data}", "--split", ""], "argument --split: must not be empty"),
        (["--dataset", "{data}", "--split", "test"], "--split 'test': {data} holds one split"),
        (["--dataset", "{data}", "--text-column", ""], "argument --text-column: must not be empty"),
        (["--dataset", "{data}", "--text-column", "n"], "--text-column 'n': the column holds Value('int64'), not text"),
        (["--dataset", "{data}", "--text-column", "body"], "--text-column 'body': the dataset has no column 'body'"),
        (["--split", "train"], "--split: only for --dataset"),
        (["--text-column", "text"], "--text-column: only for --dataset"),
    ],
)
def test_eval_ppl_bad_values(tmp_path, tiny_checkpoint, capsys, extra, message):
    from datasets import Dataset

    checkpoint, text = tiny_checkpoint
    files = {"file": tmp_path / "file", "data": tmp_path / "data"}
    files["file"].write_text("x")
    Dataset.from_dict({"text": ["alpha beta " * 100], "n": [1]}).save_to_disk(files["data"])
    extra = [arg.format(**files) for arg in extra]
    out = tmp_path / "run"
    if "--out" not in extra:
        extra += ["--out", str(out)]
    data = [] if "--dataset" in extra or "--text-files" in extra else ["--text-files", str(text)]
    assert main(["eval", "ppl", "--model", str(checkpoint), *data, "--lengths", "32,64", "--target-tokens", "16",
                 "--methods", "none", "--no-plot", *extra]) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {message.format(**files)}" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # (transformers builds an empty GPT-2 tokenizer from nothing)
def test_a_model_folder_without_a_tokenizer_is_an_error(tmp_path, tiny_checkpoint, capsys, family):
    from test_biases import MODELS

    checkpoint, text = tiny_checkpoint
    bare = tmp_path / "bare"
    MODELS[family]().save_pretrained(bare)
    with mock.patch("rope_ext.runs.models.from_pretrained", side_effect=AssertionError("the weights were loaded")):
        assert _ppl(bare, tmp_path / "run", text=text) == 2  # (refused before the weights load)
    err = capsys.readouterr().err
    assert f"rope-ext: error: --model '{bare}' holds a model but no tokenizer: save the model's tokenizer beside it " \
           "with tokenizer.save_pretrained(folder)" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seed", "abc"], "argument --seed: must be an integer, got 'abc'"),
        (["--trials", "abc"], "argument --trials: must be an integer in [1, 10000], got 'abc'"),
        (["--trials", "1000000"], "argument --trials: must be an integer in [1, 10000], got '1000000'"),
        (["--depths", ""], "argument --depths: give at least one depth in [0, 1]"),
        (["--depths", "nan"], "argument --depths: malformed depth 'nan'"),
        (["--lengths", "-1"], "argument --lengths: length must be at least 2 tokens, got '-1'"),
        (["--out", ""], "argument --out: must not be empty"),
        (["--model", ""], "argument --model: must not be empty"),
    ],
)
def test_eval_passkey_bad_values(tmp_path, tiny_checkpoint, capsys, extra, message):
    checkpoint, _ = tiny_checkpoint
    args = ["eval", "passkey", "--model", str(checkpoint), "--lengths", "64", "--out", str(tmp_path / "run"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_results_files_that_rope_ext_did_not_write_are_named(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    out = tmp_path / "run"
    out.mkdir()
    (out / "passkey_run.json").write_text("not json")
    args = ["eval", "passkey", "--model", str(checkpoint), "--lengths", "64", "--depths", "0.5", "--trials", "1",
            "--methods", "none", "--out", str(out), "--no-plot"]
    assert main(args) == 2
    assert (f"rope-ext: error: {out / 'passkey_run.json'} is not a run configuration rope-ext wrote (JSONDecodeError"
            in capsys.readouterr().err)
    assert main([*args, "--overwrite"]) == 0
    (out / "passkey_records.jsonl").write_text('{"method": "none"}\n')
    assert main(args) == 2
    assert f"{out / 'passkey_records.jsonl'} holds a line that is not a passkey record" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, message",
    [
        (None, "argument results: must not be empty"),
        ("missing", "{path}: no such folder; give a results folder"),
        ("file", "{path} is a file; give a results folder"),
        ("folder", "no ppl.json, passkey.json or ruler.json in {path}"),
        ("empty", "ppl.json in {path} holds no results (an empty summary): nothing to plot"),
    ],
)
def test_plot_bad_folders(tmp_path, capsys, make, message):
    path = tmp_path / "results"
    if make == "file":
        path.write_text("x")
    elif make in ("folder", "empty"):
        path.mkdir()
    if make == "empty":
        (path / "ppl.json").write_text(json.dumps({"run": {"protocol": "fixed"}, "summary": [], "records": []}))
    assert main(["plot", str(path) if make else ""]) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {message.format(path=path)}" in err and "Traceback" not in err


def test_site_options_with_only_none_and_empty_specs_are_refused(tmp_path, capsys):
    """From the refactor's trial: ``--methods none --layer-types foo`` configured nothing yet was recorded (every
    later run in the folder refused); ``none,,dca`` dropped the empty spec silently."""
    doc = tmp_path / "doc.txt"
    doc.write_text("word " * 50)
    for extra, message in [
        (["--methods", "none", "--layer-types", "foo"], "--layer-types: only with a method that patches the model"),
        (["--methods", "none", "--replace-scaling"], "--replace-scaling: only with a method that patches the model"),
        (["--methods", "none,,dca"], "an empty method spec in 'none,,dca'"),
    ]:
        code = main(["eval", "ppl", "--text-files", str(doc), "--out", str(tmp_path / "out"), "--lengths", "64",
                     "--target-tokens", "16", *extra])
        assert code == 2 and message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
