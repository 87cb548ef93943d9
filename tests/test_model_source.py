"""What ``--model`` names is told before anything loads (``rope_ext.runs.sources``), and before a results folder is
compared with the run: a mistyped path is named as such, not as "another configuration"."""

from __future__ import annotations

import json
import shutil

import pytest
from test_finetune import checkpoint  # noqa: F401  (a fixture)

from rope_ext.cli import main
from rope_ext.runs.folder import resolved
from rope_ext.runs.sources import could_be_hub_id

GIVE = "give 'default', a folder written by save_pretrained, or a hub id"
NO_FOLDER = "cannot load it (no such folder: nor is it a hub id (a name, or owner/name)); " + GIVE


@pytest.mark.parametrize(("name", "expected"), [
    ("gpt2", True), ("HuggingFaceTB/SmolLM2-135M", True), ("owner/my_model.v2", True), ("a-b.c_d", True),
    ("./model", False), ("../model", False), (".model", False), ("model.", False), ("-model", False),
    ("owner/-model", False), ("a--b", False), ("a..b", False), ("a/b/c", False), ("/abs/model", False),
    ("model/", False), ("", False), ("my model", False),
])
def test_which_names_the_hub_could_take(name, expected):
    assert could_be_hub_id(name) is expected


def _run(command: str, model: str, out, files: list[str]) -> list[str]:
    common = ["--model", model, "--out", str(out)]
    if command == "finetune":
        return ["finetune", *common, "--text-files", *files[:2], "--window", "32", "--target-length", "64",
                "--max-steps", "1"]
    extra = {"ppl": ["--lengths", "32", "--target-tokens", "16", "--text-files", files[0]],
             "passkey": ["--lengths", "256"], "ruler": ["--lengths", "256", "--tasks", "niah_single_1"]}[command]
    return ["eval", command, *common, "--methods", "none", "--no-plot", *extra]


def _loads_nothing(monkeypatch):
    import rope_ext.runs.models

    def loaded(*args, **kwargs):
        raise AssertionError("a model loaded")

    for name in ("from_pretrained", "load_finetuned", "load_default_model", "load_tokenizer"):
        monkeypatch.setattr(rope_ext.runs.models, name, loaded)


@pytest.mark.parametrize("command", ["ppl", "passkey", "ruler", "finetune"])
def test_a_model_that_cannot_be_is_refused_before_anything_loads(checkpoint, tmp_path, monkeypatch, capsys, command):
    model, files = checkpoint
    _loads_nothing(monkeypatch)
    monkeypatch.chdir(tmp_path)
    empty, no_tokenizer, a_file = tmp_path / "empty", tmp_path / "no-tokenizer", tmp_path / "model.txt"
    empty.mkdir()
    no_tokenizer.mkdir()
    shutil.copy(model / "config.json", no_tokenizer)
    a_file.write_text("")
    cases = [
        ("./missing", f"--model './missing': {NO_FOLDER}"),
        ("../missing", f"--model '../missing': {NO_FOLDER}"),
        (".missing", f"--model '.missing': {NO_FOLDER}"),
        (str(empty), f"--model '{empty}': cannot load it (a folder: no config.json: it holds no model); {GIVE}"),
        (str(no_tokenizer), f"--model '{no_tokenizer}' holds a model but no tokenizer: save the model's tokenizer"),
        (str(a_file), f"'{a_file}' is a file; {GIVE}"),
    ]
    for name, message in cases:
        assert main(_run(command, name, tmp_path / "out", files)) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("rope-ext: error: ") and message in err[-1], (name, err)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["ppl", "passkey", "ruler"])
def test_a_mistyped_model_into_a_folder_of_results_is_named_as_such(checkpoint, tmp_path, monkeypatch, capsys,
                                                                    command):
    """Not "another configuration (differs in: model ...)... pass --overwrite": the model cannot be loaded at all."""
    model, files = checkpoint
    _loads_nothing(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    kind = "perplexity" if command == "ppl" else command
    saved = {"model": str(model), "dtype": "float32", "kind": kind}
    (out / f"{command}_run.json").write_text(json.dumps(saved))
    assert main(_run(command, str(tmp_path / "mistyped"), out, files)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    mistyped = tmp_path / "mistyped"
    assert err == f"rope-ext: error: --model '{mistyped}': {NO_FOLDER} (downloading needs HF_HUB_OFFLINE unset)"
    assert json.loads((out / f"{command}_run.json").read_text()) == saved


def test_ppl_options_and_a_changed_haystack_are_compared_before_the_model_loads(checkpoint, tmp_path, monkeypatch,
                                                                                capsys):
    model, files = checkpoint
    _loads_nothing(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "ppl_run.json").write_text(json.dumps({"model": str(model), "dtype": "float32", "kind": "perplexity",
                                                  "protocol": "fixed", "target_tokens": 8,
                                                  "text_files": resolved([files[0]])}))
    assert main([*_run("ppl", str(model), out, files), "--protocol", "fixed"]) == 2  # (else the model's protocol)
    assert "(differs in: target_tokens: 8 before, 16 now); re-run" in capsys.readouterr().err
    assert main([*_run("ppl", str(model), out, files[1:]), "--target-tokens", "8"]) == 2
    assert f"(differs in: text_files: ['{files[0]}'] before, ['{files[1]}'] now); re-run" in capsys.readouterr().err
    haystack = tmp_path / "haystack.txt"
    haystack.write_text("other words than before")
    (out / "ruler_run.json").write_text(json.dumps({
        "model": str(model), "dtype": "float32", "kind": "ruler", "haystack_text": resolved([str(haystack)]),
        "haystack_sha256": "0" * 64}))
    argv = _run("ruler", str(model), out, files)
    argv[argv.index("niah_single_1")] = "niah_single_2"
    assert main([*argv, "--text-files", str(haystack)]) == 2
    err = capsys.readouterr().err
    assert "haystack_sha256: '" in err and "(the haystack's text changed: the same files, other words)" in err, err


@pytest.mark.parametrize("command", ["ppl", "finetune"])
def test_weights_that_do_not_read_are_one_line(checkpoint, tmp_path, capsys, command):
    model, files = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_text("garbage")
    assert main(_run(command, str(broken), tmp_path / "out", files)) == 2
    err = capsys.readouterr().err
    assert f"rope-ext: error: --model '{broken}': cannot load it (a folder: " in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
