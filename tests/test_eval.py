"""Evaluation protocols, passkey, results folders and the CLI, on tiny models in seconds."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import re
import os
import subprocess
import sys

import pytest
import torch
from tiny import input_ids, tiny_model

import rope_ext
from rope_ext.cli import main
from rope_ext.runs.specs import parse_method_spec, parse_methods
from rope_ext.eval.data import Document, load_documents, tokenize_documents
from rope_ext.eval.passkey import NEEDLE, is_correct, passkey_prompt, passkey_trial, trial_key
from rope_ext.eval.perplexity import (
    MAX_LENGTH,
    PerplexityRecord,
    evaluate_document,
    parse_length,
    parse_lengths,
    sliding_window_nll,
    summarize,
    token_nll,
)
from rope_ext.runs.results import ResultStore
from rope_ext.eval.run import run_perplexity
from rope_ext.methods import make_config, make_configs

LENGTHS = [32, 64, 128, 256]


@pytest.fixture(scope="module")
def document() -> Document:
    return Document("doc", input_ids(256, seed=7))


def _records(model, document, protocol, dynamic=False, lengths=LENGTHS, **kw):
    return {r.length: r for r in evaluate_document(model, document, lengths, protocol=protocol, dynamic=dynamic, **kw)}


@pytest.mark.parametrize("method", ["none", "yarn:factor=4", "pi:factor=2"])
def test_fixed_and_curve_agree_per_token_for_static_methods(document, method):
    model = tiny_model("llama")
    configs = parse_methods(method)[method]
    with rope_ext.patched(model, configs[0]) if configs else torch.no_grad():
        ids = document.input_ids
        full = token_nll(model, ids, start=1)  # one forward: position p's loss is full[p - 1]
        for length in LENGTHS:
            prefix = token_nll(model, ids[:, :length], start=length // 2)
            torch.testing.assert_close(prefix, full[length // 2 - 1 : length - 1], rtol=1e-5, atol=1e-5)
        fixed = _records(model, document, "fixed", target_tokens=16)
        curve = _records(model, document, "curve")
    # at the longest length both protocols score the same tokens with the same context
    longest = max(LENGTHS)
    assert fixed[longest].tokens_scored == 16
    torch.testing.assert_close(fixed[longest].mean_nll, float(full[-16:].double().mean()), rtol=1e-6, atol=1e-6)
    # curve buckets partition positions 1..255
    assert sum(r.tokens_scored for r in curve.values()) == longest - 1
    assert [(r.start, r.length) for r in curve.values()] == [(1, 32), (32, 64), (64, 128), (128, 256)]


def test_curve_evaluates_dynamic_methods_once_per_length(document):
    model = tiny_model("llama")
    with rope_ext.patched(model, "dynamic_ntk", factor=2.0):
        curve = _records(model, document, "curve", dynamic=True)
        ids = document.input_ids
        for lo, hi in [(64, 128), (128, 256)]:
            expected = token_nll(model, ids[:, :hi], start=lo)  # its own forward at length hi
            torch.testing.assert_close(curve[hi].mean_nll, float(expected.double().mean()), rtol=1e-6, atol=1e-6)
        # one long forward would have used the 256-token scaling for the 128 bucket: a different number
        one_pass = token_nll(model, ids, start=1)[64 - 1 : 128 - 1]
        own_pass = token_nll(model, ids[:, :128], start=64)
        assert (one_pass - own_pass).abs().max() > 1e-5


def test_fixed_targets_are_the_same_tokens_at_every_length(document):
    model = tiny_model("llama")
    fixed = _records(model, document, "fixed", target_tokens=16)
    assert {r.start for r in fixed.values()} == {256 - 16}
    assert all(r.tokens_scored == 16 for r in fixed.values())


def test_targets_depend_on_the_run_not_on_the_lengths_already_recorded(document):
    model = tiny_model("llama")
    fresh = _records(model, document, "fixed", target_tokens=16)
    resumed = _records(model, document, "fixed", target_tokens=16, skip=lambda length: length == 256)
    assert sorted(resumed) == [32, 64, 128]
    for length, record in resumed.items():
        assert (record.start, record.end) == (fresh[length].start, fresh[length].end) == (240, 256)
        assert record.mean_nll == fresh[length].mean_nll
    curve = _records(model, document, "curve", skip=lambda length: length < 128)
    assert [(r.start, r.end, r.tokens_scored) for r in curve.values()] == [(64, 128, 64), (128, 256, 128)]


def test_resumed_runs_keep_their_targets_or_are_refused(document, tmp_path):
    model = tiny_model("llama")
    kwargs = dict(target_tokens=16, log=lambda message: None)
    records_path = tmp_path / "ppl_records.jsonl"

    def spans() -> set[tuple[int, int]]:
        return {(r["start"], r["end"]) for r in ResultStore(tmp_path, "ppl", {}).records()}

    run_perplexity(model, [document], {"none": []}, [64, 256], ResultStore(tmp_path, "ppl", {}), **kwargs)
    # resumed with a shorter length and an identity patch (PI at factor 1) added: every record scores
    # the same 16 tokens, so the identity patch matches the unpatched model at every length
    methods = {"none": [], "pi:factor=1": [make_config("pi", factor=1.0)]}
    summary = run_perplexity(model, [document], methods, [64, 128, 256], ResultStore(tmp_path, "ppl", {}), **kwargs)
    assert len(records_path.read_text().splitlines()) == 6 and spans() == {(240, 256)}
    ppl = {(row["method"], row["length"]): row["perplexity"] for row in summary}
    for length in (64, 128, 256):
        assert ppl["pi:factor=1", length] == pytest.approx(ppl["none", length], rel=1e-5)
    # a length list with another longest length would score other tokens: refused, nothing written
    before = records_path.read_text()
    for lengths in ([64, 128], [64, 128, 256 - 8]):
        with pytest.raises(ValueError, match=r"results that score other positions than this run: none / 'doc' at "
                           r"length 64 scored \[240, 256\), this run scores \[\d+, \d+\); give another --out, or "
                           r"pass --overwrite"):
            run_perplexity(model, [document], methods, lengths, ResultStore(tmp_path, "ppl", {}), **kwargs)
    assert records_path.read_text() == before
    store = ResultStore(tmp_path, "ppl", {}, overwrite=True)
    run_perplexity(model, [document], methods, [64, 128], store, **kwargs)
    assert len(records_path.read_text().splitlines()) == 4 and spans() == {(112, 128)}


def test_curve_buckets_changed_by_an_added_length_are_refused(document, tmp_path):
    model = tiny_model("llama")
    run_perplexity(model, [document], {"none": []}, [64, 256], ResultStore(tmp_path, "ppl", {}), protocol="curve")
    with pytest.raises(ValueError, match=r"length 256 scored \[64, 256\), this run scores \[128, 256\)"):
        run_perplexity(model, [document], {"none": []}, [64, 128, 256], ResultStore(tmp_path, "ppl", {}),
                       protocol="curve")


def _record(method: str, length: int, start: int, end: int) -> PerplexityRecord:
    return PerplexityRecord(method, [], "fixed", "doc", length, start, end, end - start, 2.0, 7.39, 0.1, 1.0)


def test_summary_never_mixes_records_that_score_different_positions():
    rows = summarize([_record("none", 64, 240, 256), _record("pi", 64, 240, 256), _record("pi", 128, 240, 256)])
    assert len(rows) == 3
    with pytest.raises(ValueError, match=r"fixed-protocol records of document 'doc' score different positions "
                       r"\(\[112, 128\), \[240, 256\)\): they come from runs with different length lists"):
        summarize([_record("none", 64, 240, 256), _record("pi", 128, 112, 128)])


def test_records_are_plain_fields():
    """Runs key records by ``record_key`` / ``passkey_key`` on their dicts; the classes carry no second key."""
    from rope_ext.eval.passkey import PasskeyRecord

    for cls in (PerplexityRecord, PasskeyRecord):
        assert [name for name, value in vars(cls).items() if isinstance(value, property)] == []


def test_sliding_window(document):
    model = tiny_model("llama")
    ids = document.input_ids
    # window covering the whole document = one forward
    torch.testing.assert_close(sliding_window_nll(model, ids, 256, 64), token_nll(model, ids, 1))
    # stride == window: independent chunks, each chunk's first token unscored
    chunks = torch.cat([token_nll(model, ids[:, b : b + 64], 1) for b in range(0, 256, 64)])
    torch.testing.assert_close(sliding_window_nll(model, ids, 64, 64), chunks)
    # overlapping windows score every token but the first exactly once, each with >= 48 tokens of context
    overlapping = sliding_window_nll(model, ids, 64, 16)
    assert overlapping.numel() == 255
    torch.testing.assert_close(overlapping[-16:], token_nll(model, ids[:, 192:256], 48))
    with pytest.raises(ValueError, match=r"stride must be in \[1, window=64\]"):
        sliding_window_nll(model, ids, 64, 65)


def test_lengths_beyond_the_document_are_skipped_with_a_message(document, tmp_path):
    model = tiny_model("llama")
    store = ResultStore(tmp_path, "ppl", {"run": 1})
    messages: list[str] = []
    summary = run_perplexity(model, [document], {"none": []}, [64, 512], store, target_tokens=16, log=messages.append)
    assert [row["length"] for row in summary] == [64]
    assert messages == ["skipping length 512 for 'doc': it provides 256 tokens, not enough (no padding)"]


def test_parse_lengths_and_methods():
    assert parse_lengths("2k,4K,100") == [100, 2048, 4096]
    with pytest.raises(ValueError, match=r"malformed length '4kb'"):
        parse_lengths("4kb")
    assert list(parse_methods("none, yarn:factor=2")) == ["none", "yarn:factor=2"]
    with pytest.raises(ValueError, match=r"unknown method 'yarm'; valid methods"):
        parse_methods("none,yarm:factor=2")
    with pytest.raises(ValueError, match=r"malformed method option 'factor'"):
        parse_methods("yarn:factor")


def test_lengths_take_an_m_suffix_as_they_take_k_and_a_bad_suffix_is_named(tmp_path, capsys):
    assert parse_length("1M") == parse_length("1m") == parse_length("1024k") == 1048576
    assert parse_length(" 16M ") == MAX_LENGTH and parse_lengths("1M,32k,2m") == [32768, 1048576, 2097152]
    with pytest.raises(ValueError, match=r"^malformed length '32g': unknown suffix 'g'; use k \(x1024\) or M "
                                         r"\(x1048576\), e.g. 4k or 1M$"):
        parse_lengths("4k,32g")
    with pytest.raises(ValueError, match=r"^length '17M' is over 16777216 tokens \(16M\), the most a run takes$"):
        parse_length("17M")
    for negative in ("-5", " -4k", "- 2"):  # a sign is a value too small, not a malformed length
        with pytest.raises(ValueError, match=rf"^length must be at least 2 tokens, got '{negative}'$"):
            parse_length(negative)
    assert main(["eval", "ppl", "--lengths", "1kb", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == ("rope-ext: error: argument --lengths: malformed length '1kb': unknown suffix "
                                       "'kb'; use k (x1024) or M (x1048576), e.g. 4k or 1M (see rope-ext eval ppl "
                                       "--help)\n")


def test_method_specs_take_json_values_and_combinations():
    assert parse_method_spec(" none ") == []
    assert parse_method_spec("yarn:factor=4:beta_fast=16") == [make_config("yarn", factor=4, beta_fast=16)]
    assert parse_method_spec("yarn:factor=1e+1:attention_factor=null") == [make_config("yarn", factor=10.0)]
    assert parse_method_spec("yarn:factor=4:truncate=False:mscale=None") == [make_config("yarn", factor=4, truncate=False)]
    for number in (".5e+1", "+5", "5.", "0.5e+1"):  # Python's spellings JSON refuses; a sign after '=' joins nothing
        assert parse_method_spec(f"yarn:factor={number}+dca") == list(make_configs("yarn+dca", factor=5))
    with pytest.raises(ValueError, match=r"'W=16' after 'self_extend:G=4' is an option, not a method: options are "
                                         r"separated by ':' \(self_extend:G=4:W=16\)"):
        parse_methods("none,self_extend:G=4,W=16")
    with pytest.raises(ValueError, match=r"options are separated by ':' \(e.g. longrope:long_factor=\[1,2\]:short"):
        parse_method_spec("longrope:long_factor=[1,2],short_factor=[1,1]")
    (longrope,) = parse_method_spec("longrope:factor=2:long_factor=[1,1.5,2]")
    assert longrope.long_factor == (1.0, 1.5, 2.0)
    with pytest.raises(ValueError, match=r"'yarn' and 'pi' are both 'frequency' methods"):  # one per hook kind
        parse_method_spec("yarn:factor=4+pi:factor=2")
    with pytest.raises(ValueError, match=r"factor must be a number >= 1 and <= 1e6 \(.*\), got 'abc'"):  # not JSON: a string
        parse_method_spec("yarn:factor=abc")
    longrope = "longrope:factor=2:long_factor=[1,1.5]:short_factor=[1,1]"
    methods = parse_methods(f"none, {longrope},ntk:factor=2")
    assert list(methods) == ["none", longrope, "ntk:factor=2"]
    assert methods["none"] == [] and [c.method for c in methods["ntk:factor=2"]] == ["ntk"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("yarn:factor", "malformed method option 'factor' in 'yarn:factor'; expected name[:key=value...]"),
        ("yarn:=4", "malformed method option '=4' in 'yarn:=4'; expected name[:key=value...]"),
        ("yarn:factor=[1,2", "unbalanced brackets or quotes in 'yarn:factor=[1,2'; expected name[:key=value...]"),
        ("yarn:factor=4]", "unbalanced brackets or quotes in 'yarn:factor=4]'; expected name[:key=value...]"),
        ("yarn:factor=4+", "missing method name in 'yarn:factor=4+'; expected name[:key=value...]"),
        (":factor=4", "missing method name in ':factor=4'; expected name[:key=value...]"),
        ("none+yarn:factor=2", "'none' (the unpatched model) takes no options and combines with nothing"),
        ("yarn:factor=2:factor=3", "option 'factor' given twice in 'yarn:factor=2:factor=3'"),
        ("yarm:factor=2", "unknown method 'yarm'; valid methods"),
    ],
)
def test_malformed_method_specs_name_the_syntax(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_methods(spec)


class _CharTokenizer:
    """Characters as tokens: enough for the passkey prompt's arithmetic."""

    pad_token_id = 0
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        if isinstance(text, list):
            return {"input_ids": [[ord(c) % 120 + 3 for c in t] for t in text]}
        return {"input_ids": [ord(c) % 120 + 3 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def test_passkey_prompt_has_exact_length_and_needle_at_depth():
    tokenizer = _CharTokenizer()
    key = trial_key(0, 2000, 0.5, 0)
    assert key == trial_key(0, 2000, 0.5, 0) and len(key) == 5
    needle = tokenizer(NEEDLE.format(key=key))["input_ids"]
    positions = {}
    for depth in (0.0, 0.5, 1.0):
        ids = passkey_prompt(tokenizer, 2000, depth, key)[0].tolist()
        assert len(ids) == 2000
        positions[depth] = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
    assert positions[0.0] < positions[0.5] < positions[1.0]
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tokenizer, 50, 0.5, key)


def test_passkey_answer_check():
    assert is_correct(" 71432. Remember", "71432")
    assert not is_correct(" 7143", "71432")
    assert not is_correct(" 714321", "71432")
    assert not is_correct(" the key", "71432")


def test_passkey_trial_runs_on_a_tiny_model():
    model = tiny_model("llama")
    record = passkey_trial(model, _CharTokenizer(), 300, 0.5, 0, method="none")
    assert record.length == 300 and len(record.key) == 5 and isinstance(record.correct, bool)
    assert record.config == []


def test_a_passkey_trials_prompt_and_answer_read_exactly_its_length():
    """A trial of length L reads L positions, its answer's included (an L-token prompt would take the answer past
    L: past what a patch was made for, at the length the table reports)."""
    model = tiny_model("llama")
    read: list[int] = []

    def last_position(module, args, kwargs):  # (the rotary module: every position the model reads)
        read.append(int(kwargs.get("position_ids", args[-1]).max()))

    handle = model.model.rotary_emb.register_forward_pre_hook(last_position, with_kwargs=True)
    try:
        passkey_trial(model, _CharTokenizer(), 300, 0.5, 0, method="none")
    finally:
        handle.remove()
    assert max(read) == 300 - 1


class _AnsweringModel(torch.nn.Module):
    """Answers every prompt with ``answer`` (as token ids that ``_CharTokenizer.decode`` turns back into it)."""

    def __init__(self, answer: str) -> None:
        super().__init__()
        self.answer = answer
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.prompt_lengths: list[int] = []

    def generate(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        self.prompt_lengths.append(ids.shape[-1])
        return torch.cat([ids, torch.tensor([[ord(c) for c in self.answer]])], dim=-1)


def test_passkey_trial_scores_the_answer_against_the_hidden_key():
    key = trial_key(0, 300, 0.5, 0)
    model = _AnsweringModel(f" {key}. Remember it.")
    right = passkey_trial(model, _CharTokenizer(), 300, 0.5, 0, seed=0)
    assert model.prompt_lengths == [300 - 7]  # (the answer's 7 positions within the 300)
    assert (right.key, right.answer, right.correct) == (key, f" {key}. Remember it.", True)
    other = str((int(key) - 10_000 + 1) % 90_000 + 10_000)  # another 5-digit number
    wrong = passkey_trial(_AnsweringModel(f" {other}. Remember it."), _CharTokenizer(), 300, 0.5, 0, seed=0)
    assert (wrong.key, wrong.correct) == (key, False)
    shifted = passkey_trial(_AnsweringModel(f" {key}."), _CharTokenizer(), 300, 0.5, 0, seed=1)
    assert shifted.key != key and shifted.correct is False  # another seed hides another key


# --- data, results folder and CLI -------------------------------------------------------------------


def test_text_files_become_documents(tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 50)
    (tmp_path / "b.txt").write_text("short")
    data = load_documents(text_files=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert data["title"] == ["a.txt", "b.txt"]
    docs = tokenize_documents(data, _CharTokenizer(), min_tokens=100)
    assert [d.title for d in docs] == ["a.txt"] and docs[0].num_tokens == len("alpha beta gamma " * 50)
    with pytest.raises(ValueError, match=r"no document has at least 100000 tokens"):
        tokenize_documents(data, _CharTokenizer(), min_tokens=100_000)
    with pytest.raises(FileNotFoundError, match=r"--text-files: .*missing.txt not found"):
        load_documents(text_files=[str(tmp_path / "missing.txt")])


def test_saved_dataset_is_accepted(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"body": ["one two three"]}).save_to_disk(tmp_path / "ds")
    data = load_documents(str(tmp_path / "ds"), text_column="body")
    assert data.column_names == ["title", "text"] and data["text"] == ["one two three"]
    with pytest.raises(ValueError, match=r"no column 'content'; columns: body"):
        load_documents(str(tmp_path / "ds"), text_column="content")


def test_missing_corpus_package_gives_an_instruction(monkeypatch):
    import rope_ext.eval.corpus as corpus

    monkeypatch.setattr(corpus.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"apt-get install bible-kjv bible-kjv-text"):
        load_documents()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Llama plus a small word-level tokenizer, saved like any local model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["alpha", "beta", "gamma", "delta", "the", "pass", "key", "is", "."] + [str(d) for d in range(10)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    text = tmp_path_factory.mktemp("text") / "doc.txt"
    text.write_text(" ".join(words[i % 4] for i in range(400)))
    return path, text


def _cli(tmp_path, checkpoint, text, *extra):
    targets = [] if {"curve", "sliding"} & set(extra) else ["--target-tokens", "16"]  # (fixed targets only)
    return main(
        [
            "eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--min-tokens", "0",
            "--lengths", "32,64,128", *targets, "--methods", "none,yarn:factor=4",
            "--out", str(tmp_path / "run"), *extra,
        ]
    )


def test_cli_eval_ppl_with_combined_attention_methods(tmp_path, tiny_checkpoint):
    checkpoint, text = tiny_checkpoint
    methods = "none,dca+yarn:factor=4,rerope:w=16+logn"
    assert _cli(tmp_path, checkpoint, text, "--methods", methods, "--no-plot") == 0
    results = json.loads((tmp_path / "run" / "ppl.json").read_text())
    by_method = {(r["method"], r["length"]): r for r in results["summary"]}
    assert {m for m, _ in by_method} == {"none", "dca+yarn:factor=4", "rerope:w=16+logn"}
    assert by_method[("rerope:w=16+logn", 128)]["perplexity"] != by_method[("none", 128)]["perplexity"]


def test_cli_eval_ppl_writes_results_resumes_and_refuses_other_configs(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint
    assert _cli(tmp_path, checkpoint, text) == 0
    out = capsys.readouterr().out
    assert "perplexity (fixed protocol; native context 64; this run's methods and lengths" in out and "plot written to" in out
    run = tmp_path / "run"
    results = json.loads((run / "ppl.json").read_text())
    assert {(r["method"], r["length"]) for r in results["summary"]} == {
        (m, L) for m in ("none", "yarn:factor=4") for L in (32, 64, 128)
    }
    assert (run / "ppl.csv").read_text().startswith("method,config,protocol,document,length")
    assert (run / "ppl.png").stat().st_size > 10_000
    lines = (run / "ppl_records.jsonl").read_text().splitlines()
    assert len(lines) == 6

    # re-run: everything is already there, nothing is recomputed
    assert _cli(tmp_path, checkpoint, text, "--no-plot") == 0
    assert (run / "ppl_records.jsonl").read_text().splitlines() == lines
    # adding a method computes only that method
    assert main(["eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--min-tokens", "0",
                 "--lengths", "32,64,128", "--target-tokens", "16", "--methods", "none,pi:factor=2",
                 "--out", str(run), "--no-plot"]) == 0
    assert len((run / "ppl_records.jsonl").read_text().splitlines()) == 9
    # the tables cover the folder: the earlier run's yarn rows stay, with pi's; a run of fewer lengths keeps them
    assert main(["eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--min-tokens", "0",
                 "--lengths", "128", "--target-tokens", "16", "--methods", "ntk:factor=2",
                 "--out", str(run), "--no-plot"]) == 0
    summary = json.loads((run / "ppl.json").read_text())["summary"]
    assert {(r["method"], r["length"]) for r in summary} == {
        (m, L) for m in ("none", "yarn:factor=4", "pi:factor=2") for L in (32, 64, 128)
    } | {("ntk:factor=2", 128)}
    assert len((run / "ppl.csv").read_text().splitlines()) == 1 + 10

    # another configuration is refused, then replaced with --overwrite
    assert _cli(tmp_path, checkpoint, text, "--protocol", "curve") == 2
    assert ("holds ppl results of another configuration (differs in: protocol: 'fixed' before, 'curve' now; "
            "target_tokens: 16 before, None now); re-run with its options to resume, give another --out, or pass "
            "--overwrite to replace them") in capsys.readouterr().err
    assert _cli(tmp_path, checkpoint, text, "--protocol", "curve", "--overwrite", "--no-plot") == 0
    assert json.loads((run / "ppl.json").read_text())["run"]["protocol"] == "curve"


def test_a_learned_table_is_evaluated_at_its_own_lengths_beside_methods_that_reach_further(
        tmp_path, tiny_checkpoint, capsys):
    """GPT-2's ``none`` at the lengths its 64-row table reaches, in the same run as methods read past it; its longer
    lengths are left out (said once), not the whole run refused; passkey alike."""
    from transformers import GPT2Config, GPT2LMHeadModel

    checkpoint, text = tiny_checkpoint
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=64)).save_pretrained(
        tmp_path / "gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "gpt2" / name).write_bytes((checkpoint / name).read_bytes())
    run = tmp_path / "run"
    common = ["--model", str(tmp_path / "gpt2"), "--no-plot", "--out", str(run)]
    assert main(["eval", "ppl", *common, "--text-files", str(text), "--min-tokens", "0", "--lengths", "32,64,128",
                 "--target-tokens", "16", "--methods", "none,abs_interp:factor=2,alibi"]) == 0
    out = capsys.readouterr().out
    assert ("method 'none': this model's learned position table reaches 64 positions; length 128 is left out for "
            "it (read it further with abs_interp, abs_hierarchical or sinusoidal to evaluate it)") in out
    assert ("method 'abs_interp:factor=2': this model's learned position table reaches 127 positions; length 128 "
            "is left out for it (give abs_interp a larger factor to evaluate it)") in out
    assert "'alibi'" not in out
    summary = json.loads((run / "ppl.json").read_text())["summary"]
    assert {(r["method"], r["length"]) for r in summary} == {
        ("none", 32), ("none", 64), *((m, L) for m in ("abs_interp:factor=2", "alibi") for L in (32, 64)),
        ("alibi", 128)}
    # the default --methods cut to what GPT-2 takes (no RoPE method), saying so
    assert main(["eval", "ppl", "--model", str(tmp_path / "gpt2"), "--no-plot", "--out", str(tmp_path / "default"),
                 "--text-files", str(text), "--min-tokens", "0", "--lengths", "32,64", "--target-tokens", "16"]) == 0
    assert ("--methods (default none,yarn:factor=2,dynamic_ntk:factor=2,dca): yarn:factor=2 (frequency), "
            "dynamic_ntk:factor=2 (frequency), dca (position_rule) left out: gpt2 takes absolute, bias, wrapper hooks; "
            "methods for it: abs_hierarchical,") in capsys.readouterr().out
    rows = json.loads((tmp_path / "default" / "ppl.json").read_text())["summary"]
    assert {r["method"] for r in rows} == {"none"}
    assert main(["eval", "passkey", *common, "--lengths", "61,64,65,120", "--depths", "0.5", "--trials", "1",
                 "--methods", "none,alibi"]) == 0
    assert "lengths 65, 120 are left out for it (read it" in capsys.readouterr().out  # (the answer within L: 64 reads
    rows = json.loads((run / "passkey.json").read_text())["summary"]  # 64 rows)
    assert {(r["method"], r["length"]) for r in rows} == {("none", 61), ("none", 64),
                                                         *(("alibi", L) for L in (61, 64, 65, 120))}


def test_cli_bad_input(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint
    assert main(["eval", "ppl", "--model", str(checkpoint), "--methods", "none,yarnn", "--out", str(tmp_path)]) == 2
    assert "unknown method 'yarnn'; valid methods: abs_hierarchical, abs_interp, alibi, dca, deberta_bucket_scale, deberta_bucket_stretch, dynamic_ntk" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", str(checkpoint), "--methods", "yarn:factor", "--out", str(tmp_path)]) == 2
    assert "malformed method option 'factor' in 'yarn:factor'" in capsys.readouterr().err
    assert main(["eval", "ppl", "--lengths", "4x", "--out", str(tmp_path)]) == 2
    assert "malformed length '4x'" in capsys.readouterr().err


def test_a_passkey_folder_of_the_earlier_protocol_is_not_resumed(tmp_path, tiny_checkpoint, capsys):
    """Its prompts were L tokens with the answer past L: other trials than this run's, refused (or --overwrite)."""
    checkpoint, _ = tiny_checkpoint
    args = ["eval", "passkey", "--model", str(checkpoint), "--methods", "none", "--lengths", "64", "--depths", "0.5",
            "--trials", "1", "--no-plot", "--out", str(tmp_path)]
    assert main(args) == 0
    run = tmp_path / "passkey_run.json"
    config = json.loads(run.read_text())
    assert config["answer_within_length"] is True
    del config["answer_within_length"]
    run.write_text(json.dumps(config))
    capsys.readouterr()
    assert main(args) == 2
    assert "answer_within_length" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0


def test_cli_passkey_and_plot(tmp_path, tiny_checkpoint, capsys):
    checkpoint, _ = tiny_checkpoint
    args = ["eval", "passkey", "--model", str(checkpoint), "--methods", "none,yarn:factor=2",
            "--lengths", "64,128", "--depths", "0,1", "--trials", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    results = json.loads((tmp_path / "passkey.json").read_text())
    assert len(results["records"]) == 2 * 2 * 2 * 2
    assert {row["trials"] for row in results["summary"]} == {2}
    assert (tmp_path / "passkey.png").stat().st_size > 10_000
    assert main(["plot", str(tmp_path)]) == 0
    assert "passkey.png" in capsys.readouterr().out
    again = ["eval", "passkey", "--model", str(checkpoint), "--methods", "pi:factor=2", "--lengths", "128",
             "--depths", "0,1", "--trials", "2", "--out", str(tmp_path), "--no-plot"]
    assert main(again) == 0  # the tables keep both runs
    results = json.loads((tmp_path / "passkey.json").read_text())
    assert {row["method"] for row in results["summary"]} == {"none", "yarn:factor=2", "pi:factor=2"}
    assert len(results["records"]) == 2 * 2 * 2 * 2 + 2 * 2
    assert main(["plot", str(tmp_path / "empty")]) == 2


def test_plots_of_many_methods_stay_readable(tmp_path):
    """Fourteen methods: the passkey heatmaps wrap onto rows of five (one row of fourteen was 40 inches wide) and
    the perplexity legend moves beside the axes, off the curves; long specs wrap after their separators."""
    from matplotlib.image import imread

    from rope_ext.eval.plot import _wrapped, plot_passkey, plot_perplexity

    methods = [f"yarn:factor={n}" for n in range(2, 16)]
    passkey = [{"method": m, "length": n, "depth": d, "accuracy": 1.0, "trials": 1}
               for m in methods for n in (1024, 2048) for d in (0.1, 0.9)]
    ppl = [{"method": m, "length": n, "perplexity": 10.0 + i} for i, m in enumerate(methods) for n in (1024, 2048)]
    run = {"protocol": "fixed", "model_name": "tiny", "native_context": 1024}
    (tmp_path / "passkey.json").write_text(json.dumps({"run": run, "summary": passkey}))
    (tmp_path / "ppl.json").write_text(json.dumps({"run": run, "summary": ppl}))
    height, width = imread(plot_passkey(tmp_path)).shape[:2]
    assert width < 2 * height  # three rows of five, not 14 x 1
    height, width = imread(plot_perplexity(tmp_path)).shape[:2]
    assert width < 2.2 * height
    long = "yarn:factor=8:beta_fast=64+dca:chunk_size=6144:local_window=1024+logn"
    assert _wrapped(long, 28).split("\n") == ["yarn:factor=8:beta_fast=64+", "dca:chunk_size=6144:", "local_window=1024+logn"]
    assert _wrapped("dca", 28) == "dca"


def _ppl(checkpoint, out, *extra, text=None, lengths="32,64,128", methods="none"):
    data = [] if "--dataset" in extra or "--text-files" in extra else ["--text-files", str(text)]
    targets = [] if {"curve", "sliding"} & set(extra) or "--target-tokens" in extra else ["--target-tokens", "16"]
    return main(
        ["eval", "ppl", "--model", str(checkpoint), *data, "--min-tokens", "0", "--lengths", lengths,
         *targets, "--methods", methods, "--out", str(out), "--no-plot", *extra]
    )


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_resumed_runs_keep_their_targets_or_are_refused(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint  # one document of 400 tokens
    out = tmp_path / "run"
    assert _ppl(checkpoint, out, text=text, lengths="32,128") == 0
    assert json.loads((out / "ppl_run.json").read_text())["target_end"] == {"doc.txt": 128}
    # a shorter length and a method added: the targets stay the last 16 tokens before 128
    assert _ppl(checkpoint, out, text=text, lengths="32,64,128", methods="none,pi:factor=2") == 0
    records = _jsonl(out / "ppl_records.jsonl")
    assert len(records) == 6 and {(r["start"], r["end"]) for r in records} == {(112, 128)}
    pi = make_config("pi", factor=2).to_dict()
    assert {r["method"]: r["config"] for r in records} == {"none": [], "pi:factor=2": [pi]}
    capsys.readouterr()
    # another longest length would move the targets: refused before computing anything
    assert _ppl(checkpoint, out, text=text, lengths="32,64,256") == 2
    assert ("results whose targets --lengths 256 would move: the fixed protocol scores the last 16 tokens before the "
            "longest length, and the folder's is 128") in capsys.readouterr().err
    # fewer lengths leave the folder's longest deciding the targets: nothing to compute
    assert _ppl(checkpoint, out, text=text, lengths="32,64") == 0
    assert _jsonl(out / "ppl_records.jsonl") == records
    assert _ppl(checkpoint, out, "--overwrite", text=text, lengths="32,64,256") == 0
    assert {(r["start"], r["end"]) for r in _jsonl(out / "ppl_records.jsonl")} == {(240, 256)}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lengths", "512,1k"], "--lengths 512,1024: no document is that long (the longest, 'doc.txt', has 400 "
         "tokens); give lengths up to 400 and above --target-tokens 16, or longer texts"),
        (["--text-files", "{empty}"], "--text-files: {empty} is empty"),
        (["--documents", "0"], "argument --documents: must be an integer >= 1, got '0'"),
        (["--target-tokens", "0"], "argument --target-tokens: must be an integer >= 1, got '0'"),
        (["--target-tokens", "128"], "--lengths 32,64,128: not above --target-tokens 128"),
        (["--protocol", "curve", "--target-tokens", "8"], "--target-tokens: only for the fixed, masked-lm and "
         "span-corruption protocols; --protocol curve scores every token of each length (leave --target-tokens out)"),
        (["--protocol", "fixed", "--stride", "8"], "--stride: only for --protocol sliding (leave it out with "
         "--protocol fixed)"),
        (["--protocol", "sliding", "--stride", "0"], "argument --stride: must be an integer >= 1, got '0'"),
        (["--protocol", "sliding", "--stride", "-3"], "argument --stride: must be an integer >= 1, got '-3'"),
        (["--protocol", "sliding", "--stride", "64"], "--stride 64 must be at most the shortest of --lengths (32)"),
        (["--protocol", "nope"], "argument --protocol: invalid choice: 'nope'"),
        (["--threads", "-1"], "argument --threads: must be an integer in [0, 1024], got '-1'"),
        (["--min-tokens", "-5"], ("argument --min-tokens: must be 0 (no minimum) or a length of at least 2 tokens, "
                                   "got '-5'")),
        (["--min-tokens", "1"], ("argument --min-tokens: must be 0 (no minimum) or a length of at least 2 tokens, "
                                  "got '1'")),
        (["--model", "{tmp}/no-model"], ("--model '{tmp}/no-model': cannot load it (no such folder: nor is it a hub id (a "
                                          "name, or owner/name)); give 'default', a folder")),
        (["--model", "{tmp}"], "--model '{tmp}': cannot load it (a folder: "),
        (["--out", "{file}"], "argument --out: '{file}' is a file; give a folder"),
        (["--dataset", "{tmp}/no-data"], "--dataset '{tmp}/no-data': "),
        (["--text-files", "{binary}"], "--text-files: {binary} is not UTF-8 text"),
        (["--methods", "none,longrope:long_factor=[1,2]"], "method 'longrope:long_factor=[1,2]' cannot patch this "
         "model: longrope: long_factor has 2 entries"),
    ],
)
def test_cli_bad_values_give_one_line_and_leave_nothing_behind(tmp_path, tiny_checkpoint, capsys, extra, message):
    checkpoint, text = tiny_checkpoint
    files = {"tmp": tmp_path / "elsewhere", "empty": tmp_path / "empty.txt", "file": tmp_path / "file",
             "binary": tmp_path / "binary.txt"}
    files["tmp"].mkdir()
    files["empty"].write_text("")
    files["file"].write_text("")
    files["binary"].write_bytes(bytes(range(256)))
    extra = [arg.format(**files) for arg in extra]
    out = tmp_path / "run"
    assert _ppl(checkpoint, out, *extra, text=text) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {message.format(**files)}" in err and "Traceback" not in err
    assert not out.exists()


def test_cli_corrected_rerun_after_a_failure_is_not_blocked(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint
    assert _ppl(checkpoint, tmp_path, "--target-tokens", "0", text=text) == 2
    assert _ppl(checkpoint, tmp_path, "--target-tokens", "8", text=text) == 0
    assert json.loads((tmp_path / "ppl_run.json").read_text())["target_tokens"] == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--depths", "abc"], "argument --depths: malformed depth 'abc'; give comma-separated numbers in [0, 1]"),
        (["--depths", "0.5,2"], "argument --depths: malformed depth '2'; give comma-separated numbers in [0, 1]"),
        (["--trials", "0"], "argument --trials: must be an integer in [1, 10000], got '0'"),
        (["--lengths", "10"], "--lengths: length 10 is too short for the passkey prompt"),
        (["--methods", "none,yarn:factor"], "argument --methods: malformed method option 'factor' in 'yarn:factor'"),
    ],
)
def test_cli_passkey_bad_values(tmp_path, tiny_checkpoint, capsys, extra, message):
    checkpoint, _ = tiny_checkpoint
    args = ["eval", "passkey", "--model", str(checkpoint), "--lengths", "64", "--out", str(tmp_path / "run"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_cli_output_into_a_closed_pipe_ends_quietly():
    """``rope-ext families | head -1``: no traceback, the status a shell reports for SIGPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "rope_ext.cli", "families"], stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")


def test_plotting_leaves_the_matplotlib_backend_alone(tmp_path):
    import matplotlib

    import rope_ext.eval.plot as plot

    ResultStore(tmp_path, "ppl", {"protocol": "fixed", "native_context": 64}).write_tables(
        [], [{"method": m, "length": L, "perplexity": p} for m, p in (("none", 9.0), ("yarn", 8.0)) for L in (32, 64)]
    )
    ResultStore(tmp_path, "passkey", {}).write_tables(
        [], [{"method": "none", "length": L, "depth": d, "accuracy": 1.0} for L in (32, 64) for d in (0.0, 1.0)]
    )
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        importlib.reload(plot)  # the module's import as a notebook would do it, after choosing its backend
        assert [p.name for p in plot.plot_run(tmp_path)] == ["ppl.png", "passkey.png"]
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert (tmp_path / "ppl.png").read_bytes()[:4] == b"\x89PNG"


def _copy_tokenizer(checkpoint, folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (checkpoint / name).exists():
            (folder / name).write_bytes((checkpoint / name).read_bytes())


def test_cli_site_options_reach_patch(tmp_path, tiny_checkpoint, capsys):
    """A checkpoint that already scales RoPE needs --replace-scaling; the option is recorded with the run."""
    checkpoint, text = tiny_checkpoint
    scaled = tmp_path / "scaled"
    model = tiny_model("llama", rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0})
    model.save_pretrained(scaled)
    _copy_tokenizer(checkpoint, scaled)
    args = ["eval", "ppl", "--model", str(scaled), "--text-files", str(text), "--min-tokens", "0", "--lengths", "32,64",
            "--target-tokens", "16", "--methods", "none,yarn:factor=2:original_max_position_embeddings=64",
            "--out", str(tmp_path / "run"), "--no-plot"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already uses RoPE scaling: {" in err and "'rope_type': 'linear'" in err and "(rope-ext: --replace-scaling)" in err
    assert not (tmp_path / "run").exists()
    assert main([*args, "--replace-scaling"]) == 0
    run = json.loads((tmp_path / "run" / "ppl.json").read_text())["run"]
    assert run["site_options"] == {"replace_scaling": True}
    assert main([*args[:-3], "--out", str(tmp_path / "other"), "--layer-types", "full_attention", "--no-plot"]) == 2
    assert "one rotary embedding for every layer (no layer types to choose from); leave layer_types out" in capsys.readouterr().err


def test_plot_of_a_malformed_results_file_names_it(tmp_path, capsys):
    (tmp_path / "ppl.json").write_text("{}")
    assert main(["plot", str(tmp_path)]) == 2
    assert f"{tmp_path / 'ppl.json'} holds an empty JSON object, not one evaluation's results: rope-ext plot draws a " \
           "folder rope-ext eval wrote (its ppl.json holds 'run' and 'summary')\n" in capsys.readouterr().err
    (tmp_path / "ppl.json").write_text("not json")
    assert main(["plot", str(tmp_path)]) == 2
    assert "is not a results file rope-ext wrote (JSONDecodeError" in capsys.readouterr().err


def test_cli_evaluates_a_folder_saved_while_patched_from_the_unpatched_model(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint
    saved = tmp_path / "saved"
    model = tiny_model("llama")
    rope_ext.patch(model, "ntk", factor=2.0)
    model.save_pretrained(saved)
    _copy_tokenizer(checkpoint, saved)
    args = ["eval", "ppl", "--text-files", str(text), "--min-tokens", "0", "--lengths", "32,64", "--target-tokens",
            "16", "--methods", "none,ntk:factor=2", "--no-plot"]
    assert main([*args, "--model", str(saved), "--out", str(tmp_path / "a")]) == 0
    assert "saved with rope_ext patch ntk; evaluating from the unpatched model" in capsys.readouterr().out
    assert main([*args, "--model", str(checkpoint), "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / "ppl.json").read_text())["summary"] for d in ("a", "b"))
    assert [r["perplexity"] for r in a] == [r["perplexity"] for r in b]  # same weights, same numbers


def test_device_is_checked_before_the_model_loads_and_a_dispatched_model_gives_the_same_results(
        tmp_path, tiny_checkpoint, capsys, monkeypatch):
    """``--device``: a malformed one is refused naming the forms, one this machine lacks naming those it has, both
    before anything loads or is written; ``auto`` (accelerate's device map; here only the CPU) scores as the model
    whole on its device, and the folder records a device other than the CPU (a CPU run does not resume it)."""
    from rope_ext.runs import devices

    checkpoint, text = tiny_checkpoint
    assert _cli(tmp_path, checkpoint, text, "--device", "gpu") == 2
    assert "argument --device: unknown device 'gpu'; give one of cpu, cuda, cuda:N, mps, auto" in capsys.readouterr().err
    here = devices.devices_here()
    missing = "cuda:7" if "cuda:7" not in here else "mps"
    assert _cli(tmp_path, checkpoint, text, "--device", missing) == 2
    err = capsys.readouterr().err
    assert f"--device {missing}: this machine has no such device" in err and f"here: {', '.join(here)}\n" in err
    assert not (tmp_path / "run").exists()
    assert _cli(tmp_path, checkpoint, text, "--no-plot") == 0
    on_cpu = json.loads((tmp_path / "run" / "ppl.json").read_text())
    assert "device" not in on_cpu["run"]
    dispatched = []
    placed = devices.placed
    monkeypatch.setattr(devices, "devices_here", lambda: ["cpu", "auto"])
    monkeypatch.setattr("rope_ext.eval.plan.placed", lambda model, device: dispatched.append(device) or placed(
        model, device))
    out = tmp_path / "auto"
    assert main(["eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--min-tokens", "0",
                 "--lengths", "32,64,128", "--target-tokens", "16", "--methods", "none,yarn:factor=4",
                 "--out", str(out), "--device", "auto", "--no-plot"]) == 0
    assert dispatched == ["auto"]
    on_auto = json.loads((out / "ppl.json").read_text())
    assert on_auto["run"]["device"] == "auto"
    assert [r["perplexity"] for r in on_auto["summary"]] == [r["perplexity"] for r in on_cpu["summary"]]
    assert main(["eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--min-tokens", "0",
                 "--lengths", "32,64,128", "--target-tokens", "16", "--methods", "none", "--out", str(out),
                 "--no-plot"]) == 2
    assert "(differs in: device: 'auto' before, None now)" in capsys.readouterr().err


def test_windows_are_independent_targets_with_intervals_and_a_paired_ratio(tmp_path, tiny_checkpoint, capsys):
    """``--windows 4``: each document's consecutive stretches of the target end's tokens, scored alike, each a record
    (the units of the 95% bootstrap interval); the ratio to the unpatched model is paired per window. ``--target-end``
    places the targets apart from the lengths: a run of the short lengths alone scores the same tokens as the long
    run; both options refused where the protocol scores every token, and a target end below the lengths."""
    checkpoint, text = tiny_checkpoint  # (400 tokens: four windows of 64)
    out = tmp_path / "windows"
    common = ["eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--target-tokens", "16",
              "--methods", "none,yarn:factor=4", "--no-plot"]
    assert main([*common, "--lengths", "32,64", "--windows", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "with 95% intervals over 4 windows" in printed and "(paired), with its 95% interval" in printed
    assert "--windows 4: 4 window(s) of 64 tokens from the document(s) (doc.txt)" in printed
    results = json.loads((out / "ppl.json").read_text())
    assert results["run"]["windows"] == 4
    assert sorted({r["document"] for r in results["records"]}) == ["doc.txt @0", "doc.txt @128", "doc.txt @192",
                                                                   "doc.txt @64"]
    rows = {(r["method"], r["length"]): r for r in results["summary"]}
    for (method, length), row in rows.items():
        assert row["documents"] == 4 and row["low"] <= row["perplexity"] <= row["high"]
        records = [r for r in results["records"] if (r["method"], r["length"]) == (method, length)]
        assert row["perplexity"] == pytest.approx(math.exp(sum(r["mean_nll"] for r in records) / 4))  # (16 each)
        if method == "none":
            assert row["ratio_to_none"] is None
        else:
            assert row["ratio_to_none"] == pytest.approx(row["perplexity"] / rows[("none", length)]["perplexity"])
            assert row["ratio_low"] <= row["ratio_to_none"] <= row["ratio_high"]
    short = tmp_path / "short"
    assert main([*common, "--lengths", "32", "--target-end", "64", "--windows", "4", "--out", str(short)]) == 0
    scored = lambda records: {(r["method"], r["document"]): (r["start"], r["end"], r["mean_nll"])  # noqa: E731
                              for r in records if r["length"] == 32}
    assert scored(json.loads((short / "ppl.json").read_text())["records"]) == scored(results["records"])
    for extra, message in ((["--protocol", "curve", "--windows", "2"], "--windows: only for the fixed-target protocols"),
                           (["--protocol", "sliding", "--target-end", "64"], "--target-end: only for the fixed-target"),
                           (["--target-end", "16"], "--target-end 16: below the longest of --lengths (32)")):
        targets = [] if "--protocol" in extra else ["--target-tokens", "16"]
        argv = ["eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--lengths", "32", *targets,
                "--out", str(tmp_path / "bad"), *extra]
        assert main(argv) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["none", "yarn:factor=4", "rerope:w=16", "alibi", "dca:chunk_size=48"])
def test_trials_sharing_a_prompts_beginning_reuse_its_cache_with_the_same_answers(tiny_checkpoint, spec):
    """Passkey trials at one length and depth share the prompt up to the key: the second on reuses the first's cache
    (``PrefixCache``, cut back to the shared tokens) and answers as the prompt run whole, for every kind of method
    whose cache is exact; a prefix shorter than ``MIN_SHARED`` or than 40% of the prompt runs whole, and one token is
    always computed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rope_ext.eval.prefix import MIN_SHARED, PrefixCache

    checkpoint, _ = tiny_checkpoint
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prefix = PrefixCache()
    with contextlib.nullcontext() if spec == "none" else rope_ext.patched(model, spec):
        for depth in (0.9, 0.2):
            whole = [passkey_trial(model, tokenizer, 200, depth, t) for t in range(3)]
            reused = [passkey_trial(model, tokenizer, 200, depth, t, prefix=prefix) for t in range(3)]
            assert [r.answer for r in reused] == [r.answer for r in whole]
            assert all(r.reused_tokens == 0 for r in whole)
            if depth == 0.9:
                assert reused[0].reused_tokens == 0 and all(r.reused_tokens >= MIN_SHARED for r in reused[1:])
    short = PrefixCache()
    short.ids, short.cache = torch.arange(200)[None], object()
    changed = torch.arange(200)[None].clone()
    changed[0, MIN_SHARED - 1] = -1  # (one token fewer shared than MIN_SHARED: the prompt runs whole)
    assert short.shared(changed) == 0 and short.shared(torch.arange(300)[None]) == 200
    assert short.shared(torch.arange(200)[None]) == 199  # (the same prompt: its last token computed again)
    assert short.shared(torch.arange(500)[None]) == 200 and short.shared(torch.arange(501)[None]) == 0  # (40%)
    assert PrefixCache(enabled=False).shared(torch.arange(10)[None]) == 0
