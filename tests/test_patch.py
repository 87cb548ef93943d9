"""Families x methods on tiny models: native parity, exact unpatch, generation, save/reload, bad input."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny import (
    FAMILY_MODEL_TYPES,
    ORIGINAL_CONTEXT,
    input_ids,
    logits,
    native_model,
    rotary_dim,
    tiny_model,
)
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext.core import STATE_ATTR
from rope_ext.methods import YarnConfig, get_method_class, list_methods, make_config

#: the frequency methods (the attention-rewrite ones are tested in test_attention.py)
FREQUENCY_METHODS = [m for m in list_methods() if get_method_class(m).hook == "frequency"]

FAMILIES = sorted(FAMILY_MODEL_TYPES)
LONG = 4 * ORIGINAL_CONTEXT


def method_options(method: str, family: str, factor: float = 4.0) -> dict:
    options: dict = {"factor": factor}
    if method == "longrope":
        half = rotary_dim(family) // 2
        options["long_factor"] = [1.0 + 3.0 * i / (half - 1) for i in range(half)]
    return options


def native_parameters(method: str, family: str, factor: float = 4.0) -> dict:
    """transformers' own rope_parameters for the same method, written out by hand."""
    original = {"original_max_position_embeddings": ORIGINAL_CONTEXT}
    return {
        "pi": {"rope_type": "linear", "factor": factor},
        "dynamic_ntk": {"rope_type": "dynamic", "factor": factor},
        "yarn": {"rope_type": "yarn", "factor": factor, **original},
        "ntk_by_parts": {"rope_type": "yarn", "factor": factor, "attention_factor": 1.0, **original},
        "llama3": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0, **original},
        "longrope": {
            "rope_type": "longrope",
            "factor": factor,
            "long_factor": method_options("longrope", family, factor)["long_factor"],
            "short_factor": [1.0] * (rotary_dim(family) // 2),
            **original,
        },
    }[method]


NATIVE_METHODS = ["pi", "dynamic_ntk", "yarn", "ntk_by_parts", "llama3", "longrope"]
NATIVE_FAMILIES = ["llama", "qwen2", "gemma3", "gpt_neox", "mistral", "olmo2"]


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
@pytest.mark.parametrize("method", NATIVE_METHODS)
def test_logits_match_transformers_native_rope(family, method):
    model = tiny_model(family)
    native = native_model(family, native_parameters(method, family), weights_from=model)
    rope_ext.patch(model, method, **method_options(method, family))
    # ascending lengths: transformers' dynamic NTK only recomputes when the length grows
    for length in (ORIGINAL_CONTEXT // 2, ORIGINAL_CONTEXT, 96, 160, LONG):
        ids = input_ids(length)
        diff = (logits(model, ids) - logits(native, ids)).abs().max().item()
        assert diff <= 1e-5, (family, method, length, diff)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", FREQUENCY_METHODS)
def test_patch_changes_long_logits_and_unpatch_is_exact(family, method):
    model = tiny_model(family)
    ids = input_ids(LONG, batch=2)
    before = logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    config = copy.deepcopy(model.config.to_dict())
    attributes = set(vars(model))

    assert rope_ext.patch(model, method, **method_options(method, family)) is model
    assert rope_ext.get_patch(model) == make_config(method, **method_options(method, family))
    patched = logits(model, ids)
    assert not torch.allclose(patched, before, atol=1e-5, rtol=0), "patch had no effect on long inputs"

    assert rope_ext.unpatch(model) is model
    assert torch.equal(logits(model, ids), before)
    assert rope_ext.get_patch(model) is None
    assert set(vars(model)) == attributes
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(a is b for a, b in zip(dict(model.named_modules()).values(), modules.values()))
    assert model.config.to_dict() == config
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", FREQUENCY_METHODS)
def test_identity_setting_leaves_logits_unchanged(family, method):
    model = tiny_model(family)
    ids = input_ids(LONG if method not in ("dynamic_ntk", "dynamic_yarn", "longrope") else ORIGINAL_CONTEXT)
    before = logits(model, ids)
    options = method_options(method, family, factor=1.0)
    if method == "longrope":
        options["long_factor"] = [1.0] * len(options["long_factor"])
    with rope_ext.patched(model, method, **options):
        torch.testing.assert_close(logits(model, ids), before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["pi", "ntk", "yarn", "llama3"])
def test_generate_with_kv_cache_matches_no_cache(family, method):
    model = tiny_model(family)
    rope_ext.patch(model, method, **method_options(method, family))
    prompt = input_ids(3 * ORIGINAL_CONTEXT)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    # and the cached decode's logits agree with a full forward over the same tokens
    out = model(input_ids=cached[:, :-1])
    step = model(input_ids=cached[:, :-2], use_cache=True)
    last = model(input_ids=cached[:, -2:-1], past_key_values=step.past_key_values)
    torch.testing.assert_close(last.logits[:, -1], out.logits[:, -1], rtol=1e-4, atol=1e-4)


def test_padded_batch_matches_single_sequences():
    model = tiny_model("llama")
    rope_ext.patch(model, "yarn", factor=4.0)
    long, short = input_ids(160, seed=3)[0], input_ids(100, seed=4)[0]
    batch = torch.zeros(2, 160, dtype=torch.long)
    mask = torch.zeros(2, 160, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 60:], mask[1, 60:] = short, 1  # left padding
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=batch, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(out[0], logits(model, long[None])[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1, 60:], logits(model, short[None])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gpt_neox", "phi3"])
@pytest.mark.parametrize("method", FREQUENCY_METHODS)
def test_save_and_reload(tmp_path, family, method):
    model = tiny_model(family)
    options = method_options(method, family)
    rope_ext.patch(model, method, **options)
    ids = input_ids(160)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_ext"]["methods"] == [make_config(method, **options).to_dict()]

    restored = rope_ext.from_pretrained(tmp_path)
    assert rope_ext.get_patch(restored) == make_config(method, **options)
    torch.testing.assert_close(logits(restored, ids), expected, rtol=0, atol=1e-5)

    rope_params = saved["rope_parameters"]
    if family == "gemma3":
        rope_params = rope_params["full_attention"]
    native = method in NATIVE_METHODS and not (family == "phi3" and method != "longrope")
    if native:
        assert rope_params["rope_type"] != "default"
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert not hasattr(plain, STATE_ATTR)
        torch.testing.assert_close(logits(plain, ids), expected, rtol=0, atol=1e-5)
    else:
        assert rope_params["rope_type"] == "default"


def test_unpatch_after_reload_gives_the_saved_base_model(tmp_path):
    model = tiny_model("llama")
    ids = input_ids(160)
    base = logits(model, ids)
    rope_ext.patch(model, "ntk", factor=4.0)
    model.save_pretrained(tmp_path)
    restored = rope_ext.unpatch(rope_ext.from_pretrained(tmp_path))
    assert torch.equal(logits(restored, ids), base)
    assert not hasattr(restored.config, "rope_ext")


def test_gemma3_patches_full_attention_by_default_and_is_selectable():
    model = tiny_model("gemma3")
    rope_ext.patch(model, "pi", factor=4.0)
    rotary = model.model.rotary_emb
    assert list(rotary.specs) == ["full_attention"]
    x = torch.zeros(1)
    pos = torch.arange(10)[None]
    sliding_native = rotary.original(x, pos, "sliding_attention")
    assert all(torch.equal(a, b) for a, b in zip(rotary(x, pos, "sliding_attention"), sliding_native))
    rope_ext.unpatch(model)

    rope_ext.patch(model, "pi", factor=4.0, layer_types=["full_attention", "sliding_attention"])
    assert sorted(model.model.rotary_emb.specs) == ["full_attention", "sliding_attention"]
    rope_ext.unpatch(model)
    with pytest.raises(ValueError, match=r"unknown layer_types \['global'\]; valid layer types: "):
        rope_ext.patch(model, "pi", factor=4.0, layer_types=["global"])
    with pytest.raises(ValueError, match=r"one rotary embedding for every layer \(no layer types to choose from\); "
                                         r"leave layer_types out \(--layer-types\), got \['full_attention'\]"):
        rope_ext.patch(tiny_model("llama"), "pi", factor=4.0, layer_types=["full_attention"])


def test_patch_accepts_name_dict_and_config_object():
    model = tiny_model("llama")
    expected = YarnConfig(factor=4.0)
    for method in ("yarn", {"method": "yarn", "factor": 4.0}, YarnConfig(factor=4.0)):
        kwargs = {"factor": 4.0} if method == "yarn" else {}
        with rope_ext.patched(model, method, **kwargs):
            assert rope_ext.get_patch(model) == expected
    assert rope_ext.get_patch(model) is None


def test_context_manager_restores_on_error():
    model = tiny_model("llama")
    ids = input_ids(LONG)
    before = logits(model, ids)
    with pytest.raises(KeyError):
        with rope_ext.patched(model, "ntk", factor=2.0):
            raise KeyError("boom")
    assert torch.equal(logits(model, ids), before)
    assert rope_ext.get_patch(model) is None


def test_original_context_defaults_to_model_config_and_can_be_overridden():
    model = tiny_model("llama")
    rope_ext.patch(model, "yarn", factor=2.0)
    assert model.model.rotary_emb.specs[None].original_max_position_embeddings == ORIGINAL_CONTEXT
    rope_ext.unpatch(model)
    rope_ext.patch(model, "yarn", factor=2.0, original_max_position_embeddings=32)
    assert model.model.rotary_emb.specs[None].original_max_position_embeddings == 32


def test_native_dynamic_written_only_when_equivalent():
    model = tiny_model("llama")
    rope_ext.patch(model, "dynamic_ntk", factor=2.0, original_max_position_embeddings=32)
    assert model.config.rope_parameters["rope_type"] == "default"  # transformers would use L=64
    assert model.config.rope_ext["methods"][0]["original_max_position_embeddings"] == 32


# --- bad input -------------------------------------------------------------------------------------


def _assert_untouched(model, ids, before):
    assert rope_ext.get_patch(model) is None
    assert not hasattr(model, STATE_ATTR)
    assert not hasattr(model.config, "rope_ext")
    assert torch.equal(logits(model, ids), before)


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("yarnn", {"factor": 2.0}, r"unknown method 'yarnn'; valid methods: abs_hierarchical, abs_interp, alibi, dca, deberta_bucket_scale, deberta_bucket_stretch, dynamic_ntk, dynamic_yarn, fire, kerple, leaky_rerope, llama3"),
        ("yarn", {"factor": 0.0}, r"yarn: factor must be a number >= 1 and <= 1e6 \(.*\), got 0.0; a factor below 1 would"),
        ("pi", {"factor": float("nan")}, r"pi: factor must be a number >= 1 and <= 1e6 \(.*\), got nan"),
        ("ntk", {"factor": -2}, r"ntk: factor must be a number >= 1 and <= 1e6 \(.*\), got -2; a factor below 1 would"),
        ("yarn", {"factor": 2.0, "beta_fast": 1, "beta_slow": 32}, r"beta_fast must be > beta_slow"),
        ("longrope", {"factor": 2.0, "long_factor": [1.0] * 3}, r"long_factor has 3 entries.*exactly 8"),
        ("yarn", {"factor": 2.0, "scale": 3}, r"unknown option\(s\) scale; valid options: factor"),
    ],
)
def test_bad_input_raises_clear_error_and_leaves_model_untouched(method, options, message):
    model = tiny_model("llama")
    ids = input_ids(LONG)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, method, **options)
    _assert_untouched(model, ids, before)


def test_patching_twice_raises_and_keeps_first_patch():
    model = tiny_model("llama")
    rope_ext.patch(model, "yarn", factor=2.0)
    with pytest.raises(RuntimeError, match=r"already patched with YarnConfig.*call rope_ext.unpatch\(model\)"):
        rope_ext.patch(model, "pi", factor=2.0)
    assert rope_ext.get_patch(model) == YarnConfig(factor=2.0)


def test_unpatch_unpatched_model_raises():
    with pytest.raises(RuntimeError, match=r"not patched"):
        rope_ext.unpatch(tiny_model("llama"))


def test_unsupported_family_lists_supported_ones():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(n_layer=1, n_head=2, hidden_size=16, vocab_size=64))
    with pytest.raises(ValueError, match=r"does not support BloomForCausalLM \(model_type 'bloom'\); supported ") as info:
        rope_ext.patch(model, "yarn", factor=2.0)
    assert info.value.args[0].endswith("families: " + ", ".join(rope_ext.list_families()))
    assert {"llama", "qwen2", "gemma3", "gpt_neox", "phi3"} <= set(rope_ext.list_families())
    assert not hasattr(model, STATE_ATTR)


def test_missing_original_context_length():
    model = tiny_model("llama")
    object.__setattr__(model.config, "max_position_embeddings", None)  # a config that does not say
    with pytest.raises(ValueError, match=r"no original context length.*pass original_max_position_embeddings"):
        rope_ext.patch(model, "yarn", factor=2.0)
    assert not hasattr(model, STATE_ATTR)
    rope_ext.patch(model, "yarn", factor=2.0, original_max_position_embeddings=64)


def test_failed_apply_rolls_back(monkeypatch):
    """An error half way through installing leaves no edit behind."""
    from rope_ext.installers import base

    model = tiny_model("llama")
    ids = input_ids(LONG)
    before = logits(model, ids)
    rotary = model.model.rotary_emb
    original_apply = base.AttrEdit.apply
    calls = {"n": 0}

    def failing_apply(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk full")
        original_apply(self)

    monkeypatch.setattr(base.AttrEdit, "apply", failing_apply)
    with pytest.raises(RuntimeError, match="disk full"):
        rope_ext.patch(model, "yarn", factor=2.0)
    monkeypatch.undo()
    assert calls["n"] == 2
    _assert_untouched(model, ids, before)
    assert model.model.rotary_emb is rotary


def test_unknown_rope_variant_is_refused():
    model = tiny_model("llama")
    model.model.rotary_emb.inv_freq.mul_(0.5)  # not base ** (-2i/d) any more
    with pytest.raises(ValueError, match=r"rotary embedding is not standard RoPE with base=10000.0, rotary dim=16"):
        rope_ext.patch(model, "yarn", factor=2.0)
    assert not hasattr(model, STATE_ATTR)
