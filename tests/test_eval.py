"""Evaluation protocols, passkey, results folders and the CLI, on tiny models in seconds."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, tiny_model

import rope_ext
from rope_ext.cli import main
from rope_ext.eval.data import Document, load_documents, tokenize_documents
from rope_ext.eval.passkey import NEEDLE, is_correct, passkey_prompt, passkey_trial, trial_key
from rope_ext.eval.perplexity import evaluate_document, parse_lengths, sliding_window_nll, token_nll
from rope_ext.eval.results import ResultStore
from rope_ext.eval.run import parse_methods, run_perplexity

LENGTHS = [32, 64, 128, 256]


@pytest.fixture(scope="module")
def document() -> Document:
    return Document("doc", input_ids(256, seed=7))


def _records(model, document, protocol, dynamic=False, lengths=LENGTHS, **kw):
    return {r.length: r for r in evaluate_document(model, document, lengths, protocol=protocol, dynamic=dynamic, **kw)}


@pytest.mark.parametrize("method", ["none", "yarn:factor=4", "pi:factor=2"])
def test_fixed_and_curve_agree_per_token_for_static_methods(document, method):
    model = tiny_model("llama")
    config = parse_methods(method)[method]
    with rope_ext.patched(model, config) if config else torch.no_grad():
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
    summary = run_perplexity(
        model, [document], {"none": None}, [64, 512], store, target_tokens=16, log=messages.append
    )
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
    assert record.correct == is_correct(record.answer, record.key)


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
    with pytest.raises(FileNotFoundError, match=r"text files not found: .*missing.txt"):
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
    return main(
        [
            "eval", "ppl", "--model", str(checkpoint), "--text-files", str(text), "--min-tokens", "0",
            "--lengths", "32,64,128,1024", "--target-tokens", "16", "--methods", "none,yarn:factor=4",
            "--out", str(tmp_path / "run"), *extra,
        ]
    )


def test_cli_eval_ppl_writes_results_resumes_and_refuses_other_configs(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint
    assert _cli(tmp_path, checkpoint, text) == 0
    out = capsys.readouterr().out
    assert "perplexity (fixed protocol; native context 64)" in out and "plot written to" in out
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

    # another configuration is refused, then replaced with --overwrite
    assert _cli(tmp_path, checkpoint, text, "--protocol", "curve") == 2
    assert "different configuration (differs in: protocol, target_tokens); pass --overwrite" in capsys.readouterr().err
    assert _cli(tmp_path, checkpoint, text, "--protocol", "curve", "--overwrite", "--no-plot") == 0
    assert json.loads((run / "ppl.json").read_text())["run"]["protocol"] == "curve"


def test_cli_bad_input(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint
    assert main(["eval", "ppl", "--model", str(checkpoint), "--methods", "none,yarnn", "--out", str(tmp_path)]) == 2
    assert "unknown method 'yarnn'; valid methods: dynamic_ntk" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", str(checkpoint), "--methods", "yarn:factor", "--out", str(tmp_path)]) == 2
    assert "malformed method option 'factor' in 'yarn:factor'" in capsys.readouterr().err
    assert main(["eval", "ppl", "--lengths", "4x", "--out", str(tmp_path)]) == 2
    assert "malformed length '4x'" in capsys.readouterr().err


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
    assert main(["plot", str(tmp_path / "empty")]) == 2
