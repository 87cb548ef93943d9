"""The lm-evaluation-harness bridge (rope_ext.eval.harness): a patched model evaluated by lm-eval offline, from
Python and from lm-eval's own command line with the rope_ext model type."""

from __future__ import annotations

import json

import pytest
from tiny import tiny_config, tiny_model
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext.core import patched_length
from rope_ext.eval.harness import MODEL_TYPE, harness_model, main, patched_context, register, with_tokenizer

lm_eval = pytest.importorskip("lm_eval")  # (in the test extras: present wherever the README's setup ran)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama over the default model's vocabulary, saved with its tokenizer (lm-eval's RULER tasks tokenize
    their data with the tokenizer they load from a folder)."""
    from rope_ext.eval.harness import tokenizer_folder
    from rope_ext.runs.models import load_default_tokenizer

    tokenizer = load_default_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-smollm")
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert (__import__("pathlib").Path(tokenizer_folder("default")) / "tokenizer_config.json").is_file()
    return folder


def test_the_context_is_the_one_the_patch_opens():
    model = tiny_model("llama")  # (L 64)
    assert patched_length(model) is None and patched_context(model) == 64
    with rope_ext.patched(model, "yarn:factor=4"):
        assert patched_length(model) == patched_context(model) == 256
    for spec in ("dca:chunk_size=48", "dynamic_ntk:factor=4"):  # (they follow any length: the user says how far)
        with rope_ext.patched(model, spec):
            assert patched_length(model) is None and patched_context(model) is None
            with pytest.raises(ValueError, match=r"^this patch follows any length \(a dynamic method, DCA's chunks\): "
                                                 r"give max_length"):
                harness_model(model, None)


def test_a_patched_model_runs_rulers_offline_tasks_in_lm_eval(checkpoint):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rope_ext.patch(model, "yarn:factor=16")
    lm = harness_model(model, tokenizer, device="cpu")
    assert lm.max_length == 1024 and lm.model is model
    out = lm_eval.simple_evaluate(model=lm, tasks=["niah_single_1", "ruler_vt"], limit=1,
                                  metadata={"tokenizer": str(checkpoint), "max_seq_lengths": [1024]})
    for task in ("niah_single_1", "ruler_vt"):
        assert 0 <= out["results"][task]["1024,none"] <= 1 and out["results"][task]["sample_len"] == 1


def test_rope_ext_lm_eval_is_lm_evals_command_line_with_the_rope_ext_model(checkpoint, tmp_path):
    model_class = register()
    assert register() is model_class and lm_eval.api.registry.MODEL_REGISTRY[MODEL_TYPE] is model_class
    main(["run", "--model", MODEL_TYPE, "--model_args", f"pretrained={checkpoint},methods=yarn:factor=16",
          "--tasks", "niah_single_1", "--limit", "1", "--metadata", '{"max_seq_lengths": [1024]}',
          "--output_path", str(tmp_path), "--device", "cpu"])
    (written,) = tmp_path.rglob("results_*.json")
    results = json.loads(written.read_text())
    assert 0 <= results["results"]["niah_single_1"]["1024,none"] <= 1
    assert results["config"]["model"] == MODEL_TYPE
    assert results["config"]["model_args"] == {"pretrained": str(checkpoint), "methods": "yarn:factor=16",
                                               "tokenizer": str(checkpoint)}  # (the tokenizer named for RULER's data)


def test_the_tokenizer_is_named_for_rulers_tasks_where_model_args_name_none(checkpoint):
    argv = ["run", "--model", MODEL_TYPE, "--model_args", f"pretrained={checkpoint},methods=pi:factor=2"]
    assert with_tokenizer(argv)[-1] == f"pretrained={checkpoint},methods=pi:factor=2,tokenizer={checkpoint}"
    given = [*argv[:-1], f"pretrained={checkpoint},tokenizer=other"]
    assert with_tokenizer(given) == given
    assert with_tokenizer(["run", "--model", "hf", "--model_args", "pretrained=x"])[-1] == "pretrained=x"
    joined = ["run", f"--model={MODEL_TYPE}", f"--model_args=pretrained={checkpoint}"]  # (lm-eval's = form too)
    assert with_tokenizer(joined)[-1] == f"pretrained={checkpoint},tokenizer={checkpoint}"


def test_rope_ext_lm_eval_runs_the_default_model_offline(tmp_path):
    """The issue's own command, offline from a fresh clone: the default model patched with yarn, lm-eval's RULER
    niah_single_1 at 1k (one sample), the tokenizer its data needs saved from the GGUF and named by rope-ext-lm-eval."""
    main(["run", "--model", MODEL_TYPE, "--model_args", "pretrained=default,methods=yarn:factor=2", "--tasks",
          "niah_single_1", "--limit", "1", "--metadata", '{"max_seq_lengths": [1024]}', "--output_path",
          str(tmp_path), "--device", "cpu"])
    (written,) = tmp_path.rglob("results_*.json")
    results = json.loads(written.read_text())
    assert 0 <= results["results"]["niah_single_1"]["1024,none"] <= 1
    assert results["config"]["model_args"]["tokenizer"].endswith("rope_ext/default-tokenizer")
