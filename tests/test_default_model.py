"""The real default model (SmolLM2-135M, native context 8192), offline."""

from __future__ import annotations

import math
import os

import pytest
import torch

import rope_ext
from rope_ext.eval.corpus import kjv_book
from rope_ext.eval.perplexity import token_nll

pytestmark = pytest.mark.real_model

NATIVE = 8192
# Measured (fp32, SDPA, KJV Genesis): unpatched perplexity of the tokens past 8192 only overtakes
# yarn/dynamic_ntk at factor 2 once the document passes ~10.5k tokens (9216 tokens: none 5.79,
# yarn 6.22, dynamic_ntk 5.88); at 11264 it is 9.66 against 7.51 for yarn.
LENGTH = 11264


@pytest.fixture(scope="module")
def default_model():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    model, tokenizer = rope_ext.load_default_model()
    return model, tokenizer


def test_default_model_loads_offline(default_model):
    model, tokenizer = default_model
    assert model.config.model_type == "llama"
    assert model.config.max_position_embeddings == NATIVE
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    assert rope_ext.get_patch(model) is None
    # the weights really are the pretrained ones: Genesis (surely in its training data) is easy for it
    ids = tokenizer(kjv_book("Genesis"), return_tensors="pt").input_ids[:, :512]
    assert math.exp(token_nll(model, ids, 1).mean()) < 8.0


def test_frequency_methods_lower_perplexity_beyond_native_window(default_model):
    model, tokenizer = default_model
    ids = tokenizer(kjv_book("Genesis"), return_tensors="pt").input_ids[:, :LENGTH]
    assert ids.shape[-1] == LENGTH
    unpatched = math.exp(token_nll(model, ids, NATIVE).mean())
    results = {}
    for method in ("yarn", "dynamic_ntk"):
        with rope_ext.patched(model, method, factor=2.0):
            nll = token_nll(model, ids, NATIVE)
        assert nll.numel() == LENGTH - NATIVE
        results[method] = math.exp(nll.mean())
    print({"none": unpatched, **results})
    for method, perplexity in results.items():
        assert perplexity < 0.9 * unpatched, (method, perplexity, unpatched)
    assert rope_ext.get_patch(model) is None


def test_the_default_model_saves_patched_and_reloads(default_model, tmp_path):
    """transformers' GGUF loader dequantizes this model into plain float modules: once its quantized marks are
    dropped it saves like any model, patched, and comes back with the same logits (what `rope-ext merge` needs)."""
    model, tokenizer = default_model
    ids = tokenizer("In the beginning God created the heaven and the earth.", return_tensors="pt").input_ids
    with rope_ext.patched(model, "yarn:factor=4"):
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path)
    assert isinstance(rope_ext.get_patch(reloaded), rope_ext.methods.YarnConfig)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


def test_rulers_tasks_run_on_the_default_model(default_model, tmp_path):
    """RULER's tasks on the default model offline (its GGUF's tokenizer): the prompt and answer within the length,
    scored, the unpatched model finding the single needle at 1k (the noise haystack: its easiest task; one trial a
    method, the rest is tests/test_ruler.py's on a tiny model)."""
    from rope_ext.eval.ruler import run_ruler
    from rope_ext.eval.ruler_tasks import TASKS
    from rope_ext.methods import make_configs
    from rope_ext.runs.results import ResultStore

    model, tokenizer = default_model
    store = ResultStore(tmp_path, "ruler", {"kind": "ruler"})
    methods = {"none": [], "yarn:factor=2": make_configs("yarn:factor=2")}
    summary = run_ruler(model, tokenizer, methods, ["niah_single_1"], [1024], 1, [0.5], store)
    records = store.records()
    assert len(records) == 2
    assert all(r["prompt_tokens"] + TASKS[r["task"]].answer_tokens <= 1024 for r in records)
    found = {(r["method"], r["task"]): r["score"] for r in summary}
    assert found[("none", "niah_single_1")] == 100.0
