"""From a new user's trial (issue #34): merging over another fine-tune, loading a LoRA folder, messages and help,
checkpoint names, noise on every run, ``rope-ext train --tokenizer`` and ``saved`` as the default on a trained
folder. Tiny models in seconds (the ``checkpoint`` of test_finetune: a tiny Llama and a word-level tokenizer)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from test_finetune import checkpoint  # noqa: F401  (a fixture)

import rope_ext
from rope_ext.cli import main
from rope_ext.runs.models import UnfinishedRun, load_finetune_base
from rope_ext.train.config import FinetuneConfig, TrainConfig
from rope_ext.train.finetune import finetune
from rope_ext.train.pretrain import build_model, train

ROOT = Path(__file__).resolve().parent.parent


def finetune_config(checkpoint, out, **options) -> FinetuneConfig:
    model, files = checkpoint
    values = dict(model=str(model), text_files=files[:2], methods="yarn:factor=4", sequence_length=32, target_length=128,
                  max_steps=3, save_every=0, micro_batch=2, lr=1e-3, warmup_steps=0, out=str(out))
    values.update(options)
    return FinetuneConfig(**values)


def train_config(checkpoint, out, **options) -> TrainConfig:
    _, files = checkpoint
    values = dict(text_files=files[:2], sequence_length=32, hidden=32, layers=1, heads=2, micro_batch=4, max_steps=2,
                  lr=3e-3, warmup_steps=0, schedule="constant_with_warmup", save_every=0, out=str(out))
    values.update(options)
    return TrainConfig(**values)


def ids(n: int = 96) -> torch.Tensor:
    return torch.randint(4, 23, (1, n), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def finetuned(checkpoint, tmp_path_factory):
    """A LoRA fine-tune under yarn:factor=4 (3 steps)."""
    out = tmp_path_factory.mktemp("finetuned") / "run"
    finetune(finetune_config(checkpoint, out))
    return out


# --- 1. merge --overwrite over another fine-tune --------------------------------------------------------------


def test_merge_overwrite_into_another_finetune_leaves_none_of_its_adapter(checkpoint, finetuned, tmp_path):
    from peft import PeftModel

    other = tmp_path / "other"
    finetune(finetune_config(checkpoint, other, methods="none", max_steps=1))
    assert (other / "adapter_config.json").is_file()
    assert main(["merge", str(finetuned), str(other), "--overwrite"]) == 0
    left = {p.name for p in other.iterdir()}
    assert not left & {"adapter_config.json", "adapter_model.safetensors", "finetune.json", "finetune_config.json",
                       "inputs.json", "loss.json"}, left
    with torch.no_grad():
        expected = PeftModel.from_pretrained(load_finetune_base(finetuned), str(finetuned)).eval()(ids()).logits
        merged = rope_ext.from_pretrained(other).eval()
        torch.testing.assert_close(merged(ids()).logits, expected, rtol=0, atol=2e-5)


def test_merge_never_writes_over_the_finetunes_base_nor_a_folder_holding_it(checkpoint, finetuned, tmp_path):
    """(A second trial: ``merge FT BASE --overwrite`` replaced the base's weights, and the fine-tune then loaded its
    adapter onto the merged model, silently.)"""
    base = Path(checkpoint[0])
    before = {p.name: p.stat().st_mtime_ns for p in base.iterdir()}
    for out in (base, base / "inside", base.parent):
        assert main(["merge", str(finetuned), str(out), "--overwrite"]) == 2
    assert main(["merge", str(finetuned), str(finetuned.parent), "--overwrite"]) == 2  # (it holds the fine-tune)
    assert {p.name: p.stat().st_mtime_ns for p in base.iterdir()} == before


def test_overwrite_removes_an_evaluations_files_and_an_evaluation_never_writes_into_a_models_folder(
    checkpoint, finetuned, tmp_path
):
    from rope_ext.runs.folder import clear_outputs

    folder = tmp_path / "eval"
    folder.mkdir()
    names = ["ppl.json", "ppl.csv", "ppl_records.jsonl", "ppl_run.json", "ppl_summary.csv", "ppl.png",
             "passkey.json", "passkey_records.jsonl", "notes.txt"]
    for name in names:
        (folder / name).write_text("x")
    clear_outputs(folder)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    command = ["eval", "ppl", "--model", str(checkpoint[0]), "--methods", "none", "--lengths", "64", "--target-tokens",
               "16", "--text-files", str(checkpoint[1][0]), "--no-plot", "--overwrite", "--out"]
    for out in (finetuned, checkpoint[0]):
        kept = sorted(p.name for p in Path(out).iterdir())
        assert main([*command, str(out)]) == 2
        assert sorted(p.name for p in Path(out).iterdir()) == kept
    assert main([*command, str(tmp_path / "results")]) == 0  # (the same evaluation, into a folder of its own)


@pytest.mark.parametrize("option, value", [("--lengths", "64,,128"), ("--lengths", "64,"), ("--depths", "0.1,,0.5")])
def test_an_empty_item_in_a_list_is_refused(option, value, capsys):
    command = "passkey" if option == "--depths" else "ppl"
    assert main(["eval", command, option, value, "--out", "/nonexistent/never"]) == 2
    assert "(two commas in a row, or one at an end)" in capsys.readouterr().err


# --- 2. from_pretrained of a LoRA folder ----------------------------------------------------------------------


def test_from_pretrained_of_a_lora_folder_is_the_trained_model(finetuned):
    from peft import PeftModel

    with torch.no_grad():
        expected = PeftModel.from_pretrained(load_finetune_base(finetuned), str(finetuned)).eval()(ids()).logits
        base = load_finetune_base(finetuned).eval()(ids()).logits
        loaded = rope_ext.from_pretrained(finetuned).eval()
        assert isinstance(rope_ext.get_patch(loaded), rope_ext.methods.YarnConfig)
        torch.testing.assert_close(loaded(ids()).logits, expected, rtol=0, atol=2e-5)
    assert not torch.allclose(base, expected, rtol=0, atol=1e-4)  # (the adapter changed the model)


# --- 3. the two-process equality's condition ------------------------------------------------------------------


def test_the_docs_state_that_two_processes_equal_one_only_without_lora_dropout():
    text = " ".join((ROOT / "docs" / "finetune.md").read_text().split())
    assert "equal to 1e-6 with LoRA dropout off (`--lora-dropout 0`)" in text
    assert "2.55e-3 apart with the default 0.05" in text


# --- 4. messages and help -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "option"), [("longrope", "long_factor"), ("xlnet_clamp", "clamp_len")])
def test_an_option_refused_when_left_out_is_shown_required(capsys, name, option):
    assert main(["methods", name]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(option + " "))
    assert row.rstrip().endswith("(required)") and "derived when patching" not in row, row
    with pytest.raises(ValueError, match=f"{option}"):
        rope_ext.methods.get_method_class(name)()


def test_train_without_a_method_does_not_recommend_saved(checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    _, files = checkpoint
    assert main(["train", "--text-files", *files[:2], "--window", "32", "--hidden", "32", "--layers", "1", "--heads",
                 "2", "--max-steps", "2", "--save-every", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "saved" not in printed.splitlines()[-1] and "--methods none,..." in printed
    assert "--methods saved" not in card and "--methods none,..." in card


def test_eval_of_an_unfinished_finetune_says_how_to_finish_it(checkpoint, tmp_path, capsys):
    out = tmp_path / "run"

    def stop(progress):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(finetune_config(checkpoint, out, save_every=1), on_step=stop)
    assert (out / "finetune_config.json").is_file() and not (out / "finetune.json").exists()
    _, files = checkpoint
    assert main(["eval", "ppl", "--model", str(out), "--text-files", files[2], "--lengths", "64", "--target-tokens",
                 "16", "--out", str(tmp_path / "ppl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"rope-ext: error: --model '{out}' is an unfinished rope-ext finetune run (finetune_config.json there, no "
        "finetune.json yet: it was stopped, or is still training); finish it by re-running its command, e.g. "
        f"`rope-ext finetune --config {out}/finetune_config.json --out {out}` (its own options: it resumes from the "
        "newest checkpoint), then use the folder"
    )
    with pytest.raises(UnfinishedRun):
        rope_ext.from_pretrained(out)
    assert main(["finetune", "--config", str(out / "finetune_config.json"), "--out", str(out)]) == 0  # as it says
    assert "resuming from" in capsys.readouterr().out
    assert json.loads((out / "finetune.json").read_text())["steps"] == 3


@pytest.mark.parametrize(("command", "module", "kept"), [
    ("finetune", "finetune", "the newest checkpoint (checkpoints/, every --save-every steps) is kept: re-run the same "
                             "command to resume from it"),
    ("train", "train", "the newest checkpoint (checkpoints/, every --save-every steps) is kept: re-run the same "
                       "command to resume from it"),
])
def test_an_interrupted_training_says_its_checkpoint_is_kept(tmp_path, capsys, monkeypatch, command, module, kept):
    import rope_ext.cli.training

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rope_ext.cli.training, module, interrupted)
    assert main([command, "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == f"rope-ext: interrupted ({kept})"


def test_an_interrupted_evaluation_says_its_records_are_kept(tmp_path, capsys, monkeypatch):
    import rope_ext.cli.evaluate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rope_ext.cli.evaluate, "load_for_evaluation", interrupted)
    assert main(["eval", "passkey", "--out", str(tmp_path / "run"), "--methods", "none"]) == 130
    assert capsys.readouterr().err.strip() == "rope-ext: interrupted (records written so far are kept: re-run to resume)"


@pytest.mark.parametrize("command", ["ppl", "passkey", "ruler"])
def test_saved_asked_of_a_model_saved_without_a_patch_is_refused_before_it_loads(checkpoint, tmp_path, capsys,
                                                                                   monkeypatch, command):
    import rope_ext.cli.evaluate

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(rope_ext.cli.evaluate, "load_for_evaluation", loaded)
    message = ("rope-ext: error: --methods: method 'saved' evaluates the patch a model was saved with; this model was "
               "saved without one (give the methods to apply instead)")
    for model in ("default", str(checkpoint[0])):  # (the checkpoint's config.json records no patch)
        assert main(["eval", command, "--model", model, "--methods", "none,saved", "--out", str(tmp_path / model[-3:]),
                     "--no-plot"]) == 2
        assert capsys.readouterr().err.splitlines()[0] == message
        assert not (tmp_path / model[-3:]).exists()


@pytest.mark.parametrize("command", ["ppl", "passkey", "ruler"])
def test_a_folder_of_another_configuration_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, command):
    """What a folder records apart from the model's native context is compared before the model loads; with
    --overwrite the run goes on (to the load, here made to fail) and the folder's results are kept until its first
    write."""
    import json

    import rope_ext.cli.evaluate

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(rope_ext.cli.evaluate, "load_for_evaluation", loaded)
    monkeypatch.setattr(rope_ext.cli.evaluate, "early_tokenizer", lambda args: None)  # (the load alone, faster)
    out = tmp_path / "run"
    out.mkdir()
    saved = {"model": "default", "model_name": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "native_context": 8192,
             "site_options": {}, "kind": "perplexity" if command == "ppl" else command, "seed": 7}
    (out / f"{command}_run.json").write_text(json.dumps(saved))
    assert main(["eval", command, "--methods", "none", "--out", str(out), "--no-plot"]) == 2
    err = capsys.readouterr().err.splitlines()[0]
    assert err.startswith(f"rope-ext: error: --out {out} holds {command} results of another configuration "
                          "(differs in: dtype: 'bfloat16' before, 'float32' now"), err
    assert ("seed: 7 before" in err) == (command != "ppl")  # (ppl's run records no seed: not compared)
    with pytest.raises(AssertionError, match="the model loaded"):
        main(["eval", command, "--methods", "none", "--out", str(out), "--no-plot", "--overwrite"])
    assert json.loads((out / f"{command}_run.json").read_text()) == saved


def test_help_names_every_architecture_train_builds_and_the_model_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "(GPT-2, Llama, T5 or DeBERTa; accelerate)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model MODEL 'default' (embedded SmolLM2-135M), a folder or a hub id (default: default)" in text


def test_eval_text_files_take_a_comma_separated_list(checkpoint, tmp_path):
    _, files = checkpoint
    out = tmp_path / "ppl"
    assert main(["eval", "ppl", "--model", str(checkpoint[0]), "--text-files", f"{files[0]},{files[1]}", files[2],
                 "--documents", "3", "--lengths", "64", "--target-tokens", "16", "--methods", "none", "--out", str(out),
                 "--no-plot"]) == 0
    run = json.loads((out / "ppl_run.json").read_text())
    assert sorted(run["document_sha256"]) == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert run["text_files"] == [os.path.realpath(f) for f in files]


def test_a_finetune_folder_has_a_model_card(finetuned, checkpoint):
    card = (finetuned / "README.md").read_text()
    model = Path(checkpoint[0]).resolve()
    assert f"base_model: {model}\n" in card and "library_name: peft" in card
    assert "under `yarn:factor=4`" in card and "for 3 steps at sequences of 32 tokens" in card
    assert "rope_ext.from_pretrained(folder)" in card and "PeftModel.from_pretrained(rope_ext.load_finetune_base" in card


def test_plot_of_a_folder_of_collected_runs_says_what_it_holds(tmp_path, capsys):
    (tmp_path / "ppl.json").write_text(json.dumps({"native_context": 256, "rows": []}))
    (tmp_path / "gpt2_alibi" / "ppl").mkdir(parents=True)
    (tmp_path / "gpt2_alibi" / "ppl" / "ppl.json").write_text(json.dumps({"run": {}, "summary": []}))
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"rope-ext: error: {tmp_path / 'ppl.json'} holds a JSON object of 'native_context', 'rows', not one "
        "evaluation's results: rope-ext plot draws a folder rope-ext eval wrote (its ppl.json holds 'run' and "
        f"'summary'); results folders inside it: {tmp_path / 'gpt2_alibi' / 'ppl'}"
    )


# --- 5. checkpoints named by optimizer step --------------------------------------------------------------------


def test_checkpoints_are_named_by_optimizer_step_also_when_resumed(checkpoint, tmp_path, caplog):
    out = tmp_path / "run"
    names = lambda: sorted(p.name for p in (out / "checkpoints").iterdir())  # noqa: E731
    with caplog.at_level(logging.INFO):
        finetune(finetune_config(checkpoint, out, max_steps=4, save_every=3, keep_checkpoints=2, warmup_steps=0))
        assert names() == ["checkpoint_3", "checkpoint_4"]
        finetune(finetune_config(checkpoint, out, max_steps=7, save_every=3, keep_checkpoints=2, warmup_steps=0))
        assert names() == ["checkpoint_6", "checkpoint_7"]
    assert "Deleting" not in caplog.text  # (accelerate's line inside the progress bar: old ones go quietly)


# --- 6. noise ---------------------------------------------------------------------------------------------------


def test_runs_raise_no_future_warning_of_pyarrow_or_transformers(checkpoint, finetuned, tmp_path):
    rng = random.Random(1)  # (new texts: datasets would reuse its cached sort of texts seen before)
    files = [tmp_path / f"new{i}.txt" for i in range(3)]
    for path in files:
        path.write_text(" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(400)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        finetune(finetune_config(checkpoint, tmp_path / "run", text_files=[str(f) for f in files[:2]], max_steps=1,
                                 gradient_checkpointing=True))
        rope_ext.from_pretrained(finetuned)
        assert main(["eval", "ppl", "--model", str(finetuned), "--text-files", str(files[2]), "--lengths", "64",
                     "--target-tokens", "16", "--out", str(tmp_path / "ppl"), "--no-plot"]) == 0
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, future


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_a_built_model_names_its_loss(checkpoint, tmp_path, architecture):
    """(transformers warns ``loss_type=None ... unrecognized`` inside the progress bar where it guesses the loss)"""
    from transformers import AutoTokenizer

    model = build_model(train_config(checkpoint, tmp_path, architecture=architecture),
                        AutoTokenizer.from_pretrained(checkpoint[0]))
    assert model.loss_type == "ForCausalLM"


# --- 7. train --tokenizer; eval's default methods on a trained folder ------------------------------------------


def test_train_takes_a_tokenizer_and_records_it(checkpoint, tmp_path):
    from transformers import AutoTokenizer

    model, _ = checkpoint
    out = tmp_path / "run"
    run = train(train_config(checkpoint, out, tokenizer=str(model)))
    vocabulary = len(AutoTokenizer.from_pretrained(model))
    assert run.model.config.vocab_size == vocabulary == 23
    assert json.loads((out / "train_config.json").read_text())["tokenizer"] == str(Path(model).resolve())
    assert json.loads((out / "train.json").read_text())["tokenizer"] == str(Path(model).resolve())
    assert f"the tokenizer of `{Path(model).resolve()}`, 23 tokens" in (out / "README.md").read_text()
    assert len(AutoTokenizer.from_pretrained(out)) == vocabulary  # (saved beside the model)


def test_a_bad_tokenizer_is_one_line_and_writes_nothing(checkpoint, tmp_path, capsys):
    _, files = checkpoint
    (tmp_path / "empty").mkdir()
    for given in (str(tmp_path / "nowhere"), str(tmp_path / "empty")):
        assert main(["train", "--text-files", *files[:2], "--window", "32", "--tokenizer", given, "--out",
                     str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"rope-ext: error: --tokenizer {given!r}: cannot load it (") and "give 'default'" in err
        assert not (tmp_path / "run").exists()


def test_a_train_folder_of_an_older_rope_ext_resumes_without_a_tokenizer_option(checkpoint, tmp_path):
    out = tmp_path / "run"
    train(train_config(checkpoint, out))
    options = json.loads((out / "train_config.json").read_text())
    del options["tokenizer"]  # (written before --tokenizer existed: the default model's)
    (out / "train_config.json").write_text(json.dumps(options))
    assert train(train_config(checkpoint, out)).model is None  # the same run: complete
    with pytest.raises(ValueError, match=r"tokenizer: 'default' before, '/"):
        train(train_config(checkpoint, out, tokenizer=str(checkpoint[0])))


def test_eval_defaults_to_saved_on_a_folder_saved_with_a_patch(checkpoint, finetuned, tmp_path, capsys):
    from rope_ext.cli.evaluate import choose_methods

    _, files = checkpoint
    out = tmp_path / "ppl"
    assert main(["eval", "ppl", "--model", str(finetuned), "--text-files", files[2], "--lengths", "64",
                 "--target-tokens", "16", "--out", str(out), "--no-plot"]) == 0
    assert "--methods saved: " in capsys.readouterr().out
    assert {row["method"] for row in json.loads((out / "ppl.json").read_text())["summary"]} == {"saved"}
    for model, expected in ((finetuned, ["saved"]), (checkpoint[0], ["none", "yarn:factor=2"]),
                            ("default", ["none", "yarn:factor=2"])):
        args = argparse.Namespace(model=str(model), methods=None, default_methods="none,yarn:factor=2")
        choose_methods(args)
        assert list(args.methods) == expected
    given = argparse.Namespace(model=str(finetuned), methods={"none": []}, default_methods="none,yarn:factor=2")
    choose_methods(given)
    assert list(given.methods) == ["none"]  # (given: kept)


# --- a third trial: missing text files, a YAML file's values, --no-X, methods as a YAML list ----------------------


def test_every_missing_text_file_is_named_in_one_line(tmp_path, capsys):
    present = tmp_path / "present.txt"
    present.write_text("words " * 50)
    files = f"{tmp_path}/a.txt,{present},{tmp_path}/b.txt"
    assert main(["eval", "ppl", "--text-files", files, f"{tmp_path}/c.txt", "--methods", "none", "--lengths", "64",
                 "--target-tokens", "16", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"rope-ext: error: --text-files: {tmp_path}/a.txt, {tmp_path}/b.txt and {tmp_path}/c.txt not found\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("yaml", "flags", "message"),
    [
        ("lora_r: 0\n", [], "--config {file}: lora_r: must be an integer >= 1, got 0"),
        ("lora-r: 0\n", [], "--config {file}: lora_r: must be an integer >= 1, got 0"),
        ("packing: foo\n", [], "--config {file}: packing: 'foo' is not one of packed, document"),
        ("sequence_length: 256\ntarget_length: 128\n", [],
         "--config {file}: sequence_length 256 is above target_length 128: "),
        ("window: 256\n", ["--target-length", "128"], "sequence_length 256 is above --target-length 128: a sequence is "
         "trained at positions below the target; give a sequence length up to the target length, or a longer target "
         "(--target-length from the command line, sequence_length from --config {file})\n"),  # (each named by where
        # it came from; window: the old name, read as the new one)
        ("methods: yarn:factr=4\n", [], "--config {file}: methods 'yarn:factr=4': yarn: unknown option(s) factr; "),
        ("lora_r: 4\n", ["--lora-r", "0"], "--lora-r: must be an integer >= 1, got 0"),  # (the flag's value)
    ],
)
def test_a_bad_value_of_a_config_file_names_its_key_and_the_file(tmp_path, capsys, yaml, flags, message):
    file = tmp_path / "run.yaml"
    file.write_text(yaml)
    assert main(["finetune", "--config", str(file), *flags, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"rope-ext: error: {message.format(file=file)}")


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["finetune", "--no-pose"], "(--pose is off unless given; to switch off a --config file's pose: true, give "
                                    "--pose false) (see rope-ext finetune --help)"),
        (["train", "--no_full"], None),  # (train has no --full: the plain message)
        (["finetune", "--no_full"], "(--full is off unless given; to switch off a --config file's full: true, give "
                                    "--full false)"),
        (["eval", "ppl", "--no-overwrite"], "(--overwrite is off unless given: leave it out) (see rope-ext eval ppl "
                                            "--help)"),
    ],
)
def test_no_x_for_a_boolean_option_says_how_to_switch_it_off(capsys, argv, hint):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rope-ext: error: unrecognized arguments: {argv[-1]}") and len(err.splitlines()) == 1
    assert (hint in err) if hint else err.endswith(f"{argv[-1]} (see rope-ext {argv[0]} --help)\n")


def test_a_boolean_flag_false_switches_off_the_config_files_true(tmp_path):
    from rope_ext.cli import build_parser
    from rope_ext.cli.options import config_flags

    file = tmp_path / "run.yaml"
    file.write_text("pose: true\nwindow: 64\ntarget_length: 128\n")
    args = build_parser().parse_args(["finetune", "--config", str(file), "--pose", "false"])
    assert FinetuneConfig.from_sources(args.config, config_flags(args, FinetuneConfig)).pose is False
    assert FinetuneConfig.from_sources(file).pose is True
    for text, value in (("'false'", False), ("'Yes'", True), ("'0'", False)):  # (quoted: read as the flag's text)
        file.write_text(f"pose: {text}\nwindow: 64\ntarget_length: 128\n")
        assert FinetuneConfig.from_sources(file).pose is value


@pytest.mark.parametrize("argv", [["eval", "ppl", "--text-files", "{present},"], ["eval", "ppl", "--text-files",
                                  "{present},,{present}"], ["finetune", "--lora-targets", "q_proj,"]])
def test_an_empty_item_in_a_list_flag_is_refused(tmp_path, capsys, argv):
    """As in ``--lengths``: ``a,`` and ``a,,b`` are refused, not read as ``a`` and ``a,b``."""
    present = tmp_path / "present.txt"
    present.write_text("words " * 50)
    argv = [arg.format(present=present) for arg in argv]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "(two commas in a row, or one at an end); give the names with one comma between each two" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given", ["YARN", "yarn:factor=4", " Yarn "])
def test_methods_name_takes_any_case_and_a_whole_spec(capsys, given):
    assert main(["methods", given]) == 0
    assert capsys.readouterr().out.startswith("yarn (hook kind: frequency)")


@pytest.mark.parametrize(("given", "message"), [
    ("yarn:factor=2+dca", "'yarn:factor=2+dca' combines 2 methods; give one at a time: rope-ext methods yarn, "
                          "rope-ext methods dca"),
    ("dca:bogus=1", "dca: unknown option(s) bogus; valid options: chunk_size, local_window, scale_queries"),
    ("yarn:factor=0", "yarn: factor must be a number >= 1"),
    ("none", "'none' is the unpatched model in --methods (no method, no options)"),
])
def test_methods_name_refuses_what_it_would_drop(capsys, given, message):
    """A combination, a bad option or ``none`` are not listed as if they were one method (a trial found them
    silently dropped)."""
    assert main(["methods", given]) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("methods", "expected"),
    [
        ("yarn:factor=4+dca", "yarn:factor=4+dca"),
        ("[yarn:factor=4+dca]", "yarn:factor=4+dca"),  # (a list of one spec)
        ("[yarn:factor=4, dca]", "--config {file}: methods: a list is the evaluation's specs to compare "
                                 "(yarn:factor=4, dca), and a run trains under one spec; write one text, '+' joining "
                                 "methods of different kinds (methods: yarn:factor=4+dca), or run once per method"),
        ("[none, alibi]", "(methods: alibi)"),
        ("[]", "--config {file}: methods: an empty list; give one spec, e.g. methods: yarn:factor=4"),
        ("yarn:factor=4,dca", "--config {file}: methods 'yarn:factor=4,dca': a run trains under one spec; '+' joins "
                              "methods of different kinds (yarn:factor=4+dca)"),
    ],
)
def test_methods_in_a_config_file_read_as_the_flag_writes_them(tmp_path, methods, expected):
    """A YAML list is ``--methods``' comma list (specs to compare: one for a run), as the flag refuses
    ``--methods yarn:factor=4,dca``; '+' combines in both."""
    file = tmp_path / "run.yaml"
    file.write_text(f"methods: {methods}\n")
    if not expected.startswith(("--", "(")):
        assert FinetuneConfig.from_sources(file).methods == expected
        return
    with pytest.raises(ValueError) as error:
        FinetuneConfig.from_sources(file)
    assert expected.format(file=file) in str(error.value)
    with pytest.raises(ValueError, match=r"^--methods 'yarn:factor=4,dca': a run trains under one spec"):
        FinetuneConfig.from_sources(None, {"methods": "yarn:factor=4,dca"})


# --- a fourth trial: each value named by where it came from; missing inputs first; what rope-ext methods lists ------


def test_an_unknown_lora_target_of_a_config_file_is_named_by_its_key(checkpoint, tmp_path, capsys):
    model, files = checkpoint
    file = tmp_path / "run.yaml"
    file.write_text(f"model: {model}\ntext_files: [{files[0]}]\nwindow: 32\nlora_targets: q_proj,nope\n")
    assert main(["finetune", "--config", str(file), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"rope-ext: error: --config {file}: lora_targets: LlamaForCausalLM has no linear layer named 'nope'; its "
        "linear layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"
    )
    assert main(["finetune", "--config", str(file), "--lora-targets", "nope", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("rope-ext: error: --lora-targets: LlamaForCausalLM has")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("yaml", "flags", "message"), [
    ("heads: 3\n", ["--hidden", "32"], "--hidden 32 must be a multiple of heads 3 (--hidden from the command line, "
                                       "heads from --config {file})"),
    ("hidden: 32\n", ["--heads", "3"], "hidden 32 must be a multiple of --heads 3 (--heads from the command line, "
                                       "hidden from --config {file})"),
    ("hidden: 32\nheads: 3\n", [], "--config {file}: hidden 32 must be a multiple of heads 3"),
    ("", ["--hidden", "32", "--heads", "3"], "--hidden 32 must be a multiple of --heads 3"),
])
def test_a_flag_and_a_files_value_in_one_message_are_each_named_by_their_source(tmp_path, capsys, yaml, flags,
                                                                                  message):
    file = tmp_path / "run.yaml"
    file.write_text(yaml)
    assert main(["train", "--config", str(file), *flags, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"rope-ext: error: {message.format(file=file)}\n"


def test_a_path_under_a_file_is_missing_too(tmp_path, capsys):
    present = tmp_path / "present.txt"
    present.write_text("words " * 50)
    assert main(["eval", "ppl", "--text-files", f"{tmp_path}/a.txt", f"{present}/b.txt", f"{tmp_path}/c/d.txt",
                 "--methods", "none", "--lengths", "64", "--target-tokens", "16", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"rope-ext: error: --text-files: {tmp_path}/a.txt, {present}/b.txt and {tmp_path}/c/d.txt not found\n"
    )


def test_a_missing_text_file_is_named_before_the_options_it_goes_with(tmp_path, capsys):
    """(--target-tokens' default, 1024, is above --lengths 64: the file is what the user fixes first.)"""
    assert main(["eval", "ppl", "--lengths", "64", "--text-files", f"{tmp_path}/a.txt", "--out",
                 str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"rope-ext: error: --text-files: {tmp_path}/a.txt not found\n"


def test_an_empty_text_is_no_names_for_a_list_whose_default_is_none(tmp_path, capsys):
    from rope_ext.cli import build_parser
    from rope_ext.cli.options import config_flags

    file = tmp_path / "run.yaml"
    file.write_text("exclude: ''\ntrainable: ''\n")
    assert FinetuneConfig.from_sources(file).exclude == [] and FinetuneConfig.from_sources(file).trainable == []
    file.write_text("exclude: [Genesis]\n")
    args = build_parser().parse_args(["train", "--config", str(file), "--exclude", ""])
    assert TrainConfig.from_sources(args.config, config_flags(args, TrainConfig)).exclude == []  # (the file's: off)
    file.write_text("text_files: ''\n")  # (no default names: '' is not "none", leave the option out)
    with pytest.raises(ValueError, match="text_files: give comma-separated names"):
        TrainConfig.from_sources(file)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "the books an evaluation scores) (default: '');" in " ".join(capsys.readouterr().out.split())


def test_a_runs_saved_options_hold_its_folder_resolved(checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    finetune(finetune_config(checkpoint, "run", methods="none", max_steps=1))
    saved = json.loads((tmp_path / "run" / "finetune_config.json").read_text())
    assert saved["out"] == str((tmp_path / "run").resolve()) and saved["model"] == str(Path(checkpoint[0]).resolve())


def test_methods_lists_no_option_the_method_refuses(capsys):
    assert main(["methods", "pi"]) == 0
    assert "original_max_position_embeddings" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="pi: original_max_position_embeddings has no effect"):
        rope_ext.methods.make_config("pi:factor=2:original_max_position_embeddings=4096")


def test_methods_of_a_method_without_options(capsys):
    from dataclasses import dataclass

    from rope_ext.methods import MethodConfig, register_method, unregister_method

    @dataclass(frozen=True)
    class Plain(MethodConfig):
        method: ClassVar[str] = "toy_plain"
        hook: ClassVar[str] = "frequency"
        summary: ClassVar[str] = "A toy method of no options."

    register_method(Plain)
    try:
        assert main(["methods", "toy_plain"]) == 0
    finally:
        unregister_method("toy_plain")
    assert capsys.readouterr().out == (
        "toy_plain (hook kind: frequency)\n\nA toy method of no options.\n\nno options (a spec names it alone: toy_plain)\n"
    )


@pytest.mark.parametrize(("yaml", "flags", "message"), [
    ("text_files: [{missing}]\n", [], "--config {file}: text_files: {missing} not found"),
    ("", ["--text-files", "{missing}"], "--text-files: {missing} not found"),
    ("text_files: [{doc}]\nexclude: [nowhere]\n", [], "--config {file}: document 'nowhere' (exclude) is not in the "
                                                      "data; its documents: doc0.txt"),
    ("text_files: [{doc}]\n", ["--eval-document", "nowhere", "--eval-target-tokens", "8"], "document 'nowhere' (--eval-document) is not in the "
                                                               "data; its documents: doc0.txt"),
    ("text_files: [{doc}]\nmicro_batch: 1000\n", [], "--config {file}: micro_batch 1000: the training text makes "),
])
def test_a_data_error_names_the_option_as_it_was_given(checkpoint, tmp_path, capsys, yaml, flags, message):
    model, files = checkpoint
    file = tmp_path / "run.yaml"
    names = {"missing": tmp_path / "missing.txt", "doc": files[0], "file": file}
    file.write_text(yaml.format(**names) + "window: 32\n")
    argv = [flag.format(**names) for flag in flags]
    assert main(["train", "--config", str(file), "--tokenizer", str(model), *argv, "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"rope-ext: error: {message.format(**names)}")


@pytest.mark.parametrize("command, option, value, message", [
    ("passkey", "--depths", "0.5,0.5", "depth 0.5 is given twice in '0.5,0.5'; give each depth once, e.g. 0.1,0.5,0.9"),
    ("ruler", "--depths", "0.1,0.50,.5", "depth 0.5 is given twice in '0.1,0.50,.5' (0.50 and .5); give each depth"),
    ("ppl", "--lengths", "64,128,64", "length 64 is given twice in '64,128,64'; give each length once"),
    ("passkey", "--lengths", "1k,1024", "length 1024 is given twice in '1k,1024' (1k and 1024); give each length once"),
    ("ruler", "--tasks", "vt,fwe,vt", "task 'vt' is given twice in 'vt,fwe,vt'; give each task once, e.g. "
                                      "niah_single_1,vt (or all)"),
    ("ppl", "--methods", "none,none", "method 'none' is given twice in 'none,none'; give each method once, e.g. "
                                      "none,yarn:factor=4"),
    ("passkey", "--methods", "none,yarn:factor=4,yarn:factor=4.0", "method 'yarn:factor=4' is given twice in "
     "'none,yarn:factor=4,yarn:factor=4.0' (yarn:factor=4 and yarn:factor=4.0: the same configs); give each method"),
    ("ruler", "--methods", "yarn:factor=4+dca,dca+yarn:factor=4", "method 'yarn:factor=4+dca' is given twice in "),
    ("ruler", "--methods", "saved,saved", "method 'saved' is given twice in 'saved,saved'; give each method once"),
])
def test_a_value_given_twice_in_a_list_is_refused_naming_it(tmp_path, capsys, command, option, value, message):
    """As ``--depths 0.5,`` is refused, so is ``--depths 0.5,0.5``: not read as ``0.5``, in one line."""
    missing = str(tmp_path / "no-model")  # (were the value taken, the run would stop there, not evaluate)
    assert main(["eval", command, option, value, "--model", missing, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rope-ext: error: argument {option}: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_methods_that_patch_differently_are_not_a_repeat():
    """Only equal configs are one method twice: ``saved`` (the folder's patch) is not ``none``; factors differ."""
    from rope_ext.runs.specs import parse_methods

    assert list(parse_methods("none,saved,yarn:factor=4,yarn:factor=8,yarn:factor=4+dca")) == [
        "none", "saved", "yarn:factor=4", "yarn:factor=8", "yarn:factor=4+dca"]
