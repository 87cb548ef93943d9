"""`rope-ext train`: small models trained from scratch under a position method, on the fine-tuning loop; saved
patched, reloaded as trained, and evaluated as trained (the method spec `saved`)."""

from __future__ import annotations

import json
import re

import pytest
import torch

import rope_ext
from rope_ext.cli import main
from rope_ext.train.config import TrainConfig
from rope_ext.train.pretrain import train


def _config(texts, out, **options) -> TrainConfig:
    values = dict(text_files=[str(texts / "one.txt"), str(texts / "two.txt")], eval_document="two.txt",
                  eval_target_tokens=16, sequence_length=64, hidden=32, layers=1, heads=2, micro_batch=4, max_steps=6, lr=3e-3,
                  warmup_steps=1, save_every=3, out=str(out))
    values.update(options)
    config = TrainConfig(**values)
    config.check()
    return config


@pytest.mark.parametrize(("architecture", "methods"), [("gpt2", "alibi"), ("gpt2", "fire"), ("llama", "xpos"),
                                                        ("gpt2", "none")])
def test_training_lowers_the_loss_and_the_folder_reloads_as_trained(texts, tmp_path, architecture, methods):
    run = train(_config(texts, tmp_path / "run", architecture=architecture, methods=methods))
    losses = [row["loss"] for row in json.loads((tmp_path / "run" / "loss.json").read_text())["log"]]
    assert len(losses) == 6 and losses[-1] < losses[0]
    record = json.loads((tmp_path / "run" / "train.json").read_text())
    assert record["steps"] == 6 and record["excluded"] == ["two.txt"] and record["evals"][-1]["length"] == 64
    assert f"under `{methods}`" in (tmp_path / "run" / "README.md").read_text() or methods == "none"
    ids = torch.randint(0, 1000, (1, 150))
    restored = rope_ext.from_pretrained(tmp_path / "run")
    if methods == "none":
        assert rope_ext.get_patch(restored) is None
        ids = ids[:, :64]  # (GPT-2's table: 64 rows)
    else:
        assert rope_ext.get_patch(restored).method == methods
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, run.model(ids).logits, rtol=0, atol=0)


def test_a_learned_bias_trains_and_a_grown_run_equals_an_uninterrupted_one(texts, tmp_path):
    fixed = {"schedule": "constant_with_warmup"}  # (cosine depends on --max-steps: a grown run is refused)
    whole = train(_config(texts, tmp_path / "whole", methods="kerple", max_steps=6, **fixed))
    first = train(_config(texts, tmp_path / "grown", methods="kerple", max_steps=3, **fixed))
    assert not torch.equal(first.model.rope_ext.kerple.layers[0].r1, whole.model.rope_ext.kerple.layers[0].r1)
    grown = train(_config(texts, tmp_path / "grown", methods="kerple", max_steps=6, **fixed))
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), grown.model.state_dict().items()):
        assert torch.equal(a, b), name
    again = train(_config(texts, tmp_path / "grown", methods="kerple", max_steps=6, **fixed))
    assert again.model is None  # complete: nothing to do


def test_a_complete_cosine_run_says_it_cannot_grow(texts, tmp_path, capsys):
    train(_config(texts, tmp_path / "run", max_steps=2, warmup_steps=8))
    train(_config(texts, tmp_path / "run", max_steps=2, warmup_steps=8))
    out = capsys.readouterr().out
    assert "its cosine schedule is fixed by --max-steps, so it cannot grow; --overwrite starts again" in out
    assert "the warm-up (8 steps) is longer than the run (2 steps): the learning rate never reaches --lr" in out


def test_evaluation_as_saved_keeps_the_trained_parameters(texts, tmp_path, capsys):
    train(_config(texts, tmp_path / "run", methods="kerple", lr=3e-2))
    out = tmp_path / "eval"
    code = main(["eval", "ppl", "--model", str(tmp_path / "run"), "--methods", "saved,kerple",
                 "--text-files", str(texts / "one.txt"), "--lengths", "64,128", "--target-tokens", "16",
                 "--out", str(out), "--no-plot"])
    assert code == 0
    rows = {(r["method"], r["length"]): r for r in map(json.loads, (out / "ppl_records.jsonl").read_text().splitlines())}
    assert rows[("saved", 64)]["config"][0]["method"] == "kerple"
    assert rows[("saved", 128)]["mean_nll"] != rows[("kerple", 128)]["mean_nll"]  # trained r1, r2 against fresh ones
    assert "saved with rope_ext patch kerple" in capsys.readouterr().out
    code = main(["eval", "ppl", "--model", "default", "--methods", "saved", "--lengths", "64", "--target-tokens", "16",
                 "--out", str(tmp_path / "bad")])
    assert code == 2
    assert "method 'saved' evaluates the patch a model was saved with; this model was saved without one" in (
        capsys.readouterr().err)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--architecture", "bert"], r"argument --architecture: invalid choice: 'bert' \(choose from 'gpt2', 'llama', "
                                           r"'t5', 'deberta'\)"),
        (["--hidden", "30", "--heads", "4"], "--hidden 30 must be a multiple of --heads 4"),
        (["--kv-heads", "2"], "--kv-heads: only for --architecture llama"),
        (["--architecture", "llama", "--heads", "4", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
        (["--methods", "yarn:factor=4"], "--methods yarn:factor=4 on --architecture gpt2: method 'yarn' needs a "
                                         "'frequency' hook, which family 'gpt2' does not support"),
        (["--methods", "saved"], "unknown method 'saved'"),
        (["--methods", "alibi:factor=0.5"], "alibi: factor must be a number >= 1 and <= 1e6"),
        (["--dropout", "1"], r"--dropout: must be in \[0, 1\), got 1.0"),
        (["--layers", "0"], "--layers: must be an integer >= 1, got 0"),
        (["--rope-theta", "500"], "--rope-theta: only for --architecture llama"),
        (["--methods", "alibi,kerple"], r"--methods 'alibi,kerple': a run trains under one spec; '\+' joins methods"),
        (["--optimizer", "sgd", "--adam-beta2", "0.9"], r"--adam-beta2: only for --optimizer adamw or adam"),
        (["--schedule", "constant", "--warmup-steps", "3"], r"--warmup-steps: the 'constant' schedule has no warm-up"),
        (["--methods", "alibi,"], r"an empty method spec in 'alibi,'"),
        (["--methods", "kerple:form=power,r=1"], r"options are separated by ':'"),
    ],
)
def test_bad_options_are_refused_in_one_line_and_nothing_is_written(texts, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    code = main(["train", "--text-files", str(texts / "one.txt"), "--window", "64", "--hidden", "32", "--layers",
                 "1", "--max-steps", "1", "--out", str(out), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not out.exists()


def test_a_saved_sgd_run_config_reads_back(tmp_path):
    """A run's saved options hold every default, Adam's beta2 too: they read back under SGD (another beta2 does not)."""
    from rope_ext.train.config import TrainConfig

    saved = TrainConfig(optimizer="sgd").options()
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps(saved))
    assert TrainConfig.from_sources(path).options() == saved
    path.write_text(json.dumps({**saved, "adam_beta2": 0.9}))
    with pytest.raises(ValueError, match=r"train_config.json: adam_beta2: only for optimizer adamw or adam"):  # (its keys)
        TrainConfig.from_sources(path)
    constant = TrainConfig(schedule="constant").options()  # (the default warm-up, saved, is no warm-up asked for)
    path.write_text(json.dumps(constant))
    assert TrainConfig.from_sources(path).options() == constant
