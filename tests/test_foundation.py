"""The hook-kind foundation and the defects found by hands-on use: dtype casts, peft wrappers, nesting,
shared configs, reload of natively saved methods, checkpoints that already scale RoPE, dynamic methods
with the cache and under torch.compile, combinations, and a toy hook kind and family added from outside."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, native_model, patched_dispatched, tiny_config, tiny_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import rope_ext
import rope_ext.guards as guards
from rope_ext.installers import HookInstaller, PlanBuilder, Site, Sites, register_hook, unregister_hook
from rope_ext.methods import (
    MethodConfig,
    YarnConfig,
    get_method_class,
    list_methods,
    make_config,
    register_method,
    unregister_method,
)
from rope_ext.families import FamilyAdapter, register_family, unregister_family

LONG = 4 * ORIGINAL_CONTEXT
LONG_FACTOR = [1.0 + 3.0 * i / 7 for i in range(8)]


def options_for(method: str, factor: float = 4.0) -> dict:
    return {"factor": factor, **({"long_factor": LONG_FACTOR} if method == "longrope" else {})}


# --- 1. models cast after loading -------------------------------------------------------------------


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
def test_model_cast_after_loading_can_be_patched_and_restored(cast, family):
    model = tiny_model(family)
    model = model.to(torch.bfloat16) if cast == "bfloat16" else model.half()
    ids = input_ids(LONG)
    before = logits(model, ids)
    with rope_ext.patched(model, "yarn", factor=4.0):
        assert not torch.equal(logits(model, ids), before)
    assert torch.equal(logits(model, ids), before)


def test_convention_error_says_what_was_compared():
    model = tiny_model("llama").to(torch.bfloat16)
    model.model.rotary_emb.inv_freq.mul_(0.5)
    with pytest.raises(ValueError, match=r"compared with cat\(freqs, freqs\), its pairs interleaved and one entry a "
                                         r"pair, using inv_freq held in torch.bfloat16 \(cat: max \|diff\|"):
        rope_ext.patch(model, "yarn", factor=2.0)


# --- 3. peft wrappers ------------------------------------------------------------------------------


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


@pytest.mark.parametrize("order", ["patch_then_wrap", "wrap_then_patch"])
def test_patch_and_unpatch_through_a_peft_wrapper(order):
    model = tiny_model("llama")
    ids = input_ids(LONG)
    if order == "patch_then_wrap":
        base = logits(model, ids)
        rope_ext.patch(model, "yarn", factor=4.0)
        wrapped = _lora(model)
    else:
        wrapped = _lora(model)
        base = logits(wrapped, ids)
        rope_ext.patch(wrapped, "yarn", factor=4.0)
    assert rope_ext.get_patch(wrapped) == rope_ext.get_patch(model) == YarnConfig(factor=4.0)
    assert not torch.equal(logits(wrapped, ids), base)
    rope_ext.unpatch(wrapped)
    assert rope_ext.get_patch(wrapped) is None and rope_ext.get_patch(model) is None
    assert torch.equal(logits(wrapped, ids), base)
    assert "rope_ext" not in model.config.to_dict()
    rope_ext.patch(wrapped, "pi", factor=2.0)  # neither refused as patched nor broken
    rope_ext.unpatch(model)
    assert torch.equal(logits(wrapped, ids), base)


# --- 4. nesting ------------------------------------------------------------------------------------


def test_a_model_with_a_patched_part_is_refused_and_reports_that_patch():
    model = tiny_model("llama")
    ids = input_ids(LONG)
    base = logits(model, ids)
    rope_ext.patch(model.model, "yarn", factor=4.0)
    with pytest.raises(RuntimeError, match=r"already patched \(through its submodule LlamaModel\) with YarnConfig"):
        rope_ext.patch(model, "pi", factor=2.0)
    assert rope_ext.get_patch(model) == YarnConfig(factor=4.0)
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, ids), base)


def test_a_part_of_a_patched_model_is_refused():
    model = tiny_model("llama")
    rope_ext.patch(model, "yarn", factor=4.0)
    with pytest.raises(RuntimeError, match=r"part of this model \('rotary_emb'\) is already patched by rope_ext"):
        rope_ext.patch(model.model, "pi", factor=2.0)
    assert rope_ext.get_patch(model) == YarnConfig(factor=4.0)


# --- 5. models sharing one config object -----------------------------------------------------------


def test_models_sharing_a_config_object_are_refused():
    config = tiny_config("llama")
    first, second = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    before = copy.deepcopy(config.to_dict())
    with pytest.raises(ValueError, match=r"config object is shared with another model.*copy.deepcopy\(config\)"):
        rope_ext.patch(first, "yarn", factor=4.0)
    assert config.to_dict() == before and rope_ext.get_patch(first) is None
    del second
    rope_ext.patch(first, "yarn", factor=4.0)  # once the other model is gone


def test_shared_config_scan_runs_only_when_references_are_unexplained(monkeypatch):
    scans = []
    original = guards.foreign_modules
    monkeypatch.setattr(guards, "foreign_modules", lambda *args: scans.append(1) or original(*args))
    for family in ("llama", "gemma3", "phi3"):
        rope_ext.patch(tiny_model(family), "yarn", factor=2.0)
    assert scans == []  # the reference count is fully accounted for: no scan of every object
    config = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(config)
    rope_ext.patch(model, "yarn", factor=2.0)  # `config` above is one more reference: a scan, no refusal
    assert scans == [1]


# --- 6. reload of natively saved methods ------------------------------------------------------------


@pytest.mark.parametrize("method", ["pi", "yarn", "llama3", "ntk_by_parts", "dynamic_ntk", "longrope"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_unpatch_after_reload_gives_the_base_model_back(tmp_path, method, family):
    model = tiny_model(family)
    ids = input_ids(160)
    base, base_config = logits(model, ids), model.config.to_dict()
    options = options_for(method)
    if family == "gemma3" and method == "longrope":
        options["long_factor"] = [1.0 + 3.0 * i / 7 for i in range(8)]
    rope_ext.patch(model, method, **options)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert rope_ext.get_patch(restored) == make_config(method, **options)
    torch.testing.assert_close(logits(restored, ids), expected, rtol=0, atol=1e-5)
    rope_ext.unpatch(restored)
    torch.testing.assert_close(logits(restored, ids), base, rtol=0, atol=1e-5)
    assert restored.config.rope_parameters == base_config["rope_parameters"]
    assert restored.config.max_position_embeddings == ORIGINAL_CONTEXT
    assert not hasattr(restored.config, "rope_ext")


def test_reload_reads_the_single_method_block_of_rope_ext_0_1(tmp_path):
    model = tiny_model("llama")
    rope_ext.patch(model, "ntk", factor=4.0)
    expected = logits(model, input_ids(160))
    rope_ext.unpatch(model)
    model.config.rope_ext = {"method": make_config("ntk", factor=4.0).to_dict(), "layer_types": None}
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert rope_ext.get_patch(restored) == make_config("ntk", factor=4.0)
    assert torch.equal(logits(restored, input_ids(160)), expected)


# --- 7. checkpoints that already scale RoPE ---------------------------------------------------------

EXISTING = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("existing", sorted(EXISTING))
def test_existing_scaling_is_refused_unless_replaced_explicitly(existing):
    model = tiny_model("llama", rope_parameters={"rope_theta": 10000.0, **EXISTING[existing]})
    ids = input_ids(LONG)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=rf"already uses RoPE scaling: \{{'rope_type': '{existing}'.*replace_scaling=True"):
        rope_ext.patch(model, "pi", factor=4.0)
    assert rope_ext.get_patch(model) is None
    rope_ext.patch(model, "pi", factor=4.0, replace_scaling=True)
    reference = tiny_model("llama")  # the same weights with unscaled RoPE, patched the ordinary way
    reference.load_state_dict(model.state_dict())
    with rope_ext.patched(reference, "pi", factor=4.0):
        torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=0, atol=1e-5)
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, ids), before)
    assert model.config.rope_parameters["rope_type"] == existing


def test_phi3_longrope_checkpoint_is_checked_against_its_own_init_function():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": LONG_FACTOR, "short_factor": [1.0] * 8,
            "original_max_position_embeddings": ORIGINAL_CONTEXT}
    model = tiny_model("phi3", rope_parameters=rope)
    with pytest.raises(ValueError, match=r"already uses RoPE scaling: \{'rope_type': 'longrope'"):
        rope_ext.patch(model, "yarn", factor=2.0)
    rope_ext.patch(model, "yarn", factor=2.0, replace_scaling=True)  # the probe passed for longrope
    rope_ext.unpatch(model)
    model.model.rotary_emb.original_inv_freq.mul_(0.5)  # no longer what its rope type gives
    with pytest.raises(ValueError, match=r"not standard RoPE .*rope type 'longrope'"):
        rope_ext.patch(model, "yarn", factor=2.0, replace_scaling=True)


def test_probing_a_dynamic_checkpoint_leaves_its_state_alone():
    model = tiny_model("llama", rope_parameters={"rope_theta": 10000.0, **EXISTING["dynamic"]})
    logits(model, input_ids(LONG))  # transformers' dynamic module grows its cached frequencies
    rotary = model.model.rotary_emb
    state = (rotary.max_seq_len_cached, rotary.inv_freq.clone())
    rope_ext.patch(model, "ntk", factor=2.0, replace_scaling=True)
    assert (rotary.max_seq_len_cached, rotary.inv_freq.tolist()) == (state[0], state[1].tolist())


# --- 8. dynamic methods and the KV cache ------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "native"),
    [
        ("dynamic_ntk", {"rope_type": "dynamic", "factor": 4.0}),
        ("longrope", {"rope_type": "longrope", "factor": 4.0, "long_factor": LONG_FACTOR, "short_factor": [1.0] * 8,
                      "original_max_position_embeddings": ORIGINAL_CONTEXT}),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_cached_generation_crossing_the_original_length_matches_transformers_native(method, native, seed):
    """With the cache, keys keep the rotation of the step that computed them, exactly as transformers' own
    ``dynamic``/``longrope``: greedy tokens are identical to native ones, step for step."""
    model = tiny_model("llama", seed=seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3.0)  # sharper logits: token choices follow small differences
    reference = native_model("llama", native, weights_from=model)
    rope_ext.patch(model, method, **options_for(method))
    prompt = input_ids(40, seed=seed + 10)
    kwargs = dict(max_new_tokens=60, do_sample=False, pad_token_id=0, use_cache=True)
    assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def test_dynamic_forward_depends_only_on_its_inputs():
    model = tiny_model("llama")
    rope_ext.patch(model, "dynamic_ntk", factor=4.0)
    short = input_ids(40)
    first = logits(model, short)
    logits(model, input_ids(LONG))  # a long call leaves nothing behind
    assert torch.equal(logits(model, short), first)


@pytest.mark.parametrize("method", ["dynamic_ntk", "dynamic_yarn", "longrope"])
def test_dynamic_methods_compile_into_one_graph(method):
    model = tiny_model("llama")
    rope_ext.patch(model, method, **options_for(method))
    rotary = model.model.rotary_emb
    compiled = torch.compile(rotary, fullgraph=True, backend="eager", dynamic=False)
    x = torch.zeros(1)
    for length in (ORIGINAL_CONTEXT // 2, LONG):  # inside and beyond the original length
        positions = torch.arange(length)[None]
        for got, expected in zip(compiled(x, positions), rotary(x, positions)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch._dynamo.reset()


# --- 9 and 12. bad input and the config's maximum length --------------------------------------------


@pytest.mark.parametrize("method", [m for m in list_methods() if get_method_class(m).hook == "frequency"])
def test_factor_below_one_is_refused(method):
    with pytest.raises(ValueError, match=rf"{method}: factor must be a number >= 1 .*got 0.5; a factor below 1 would shrink"):
        make_config(method, **options_for(method, factor=0.5))


@pytest.mark.parametrize(
    ("model_arg", "method", "options", "error", "message"),
    [
        ("llama", "yarn", {"factor": 2.0, "original_max_position_embeddings": 128}, ValueError,
         r"original_max_position_embeddings=128 exceeds the model's original context 64 .*valid: 2..64"),
        ("llama", "pi", {"factor": 2.0, "original_max_position_embeddings": 32}, ValueError,
         r"pi: original_max_position_embeddings has no effect"),
        ("llama", "yarn", {"factor": 2.0, "layer_types": []}, ValueError, r"one rotary embedding for every layer \(no layer types to choose from\); leave layer_types out"),
        ("gemma3", "yarn", {"factor": 2.0, "layer_types": []}, ValueError,
         r"layer_types is empty; choose at least one of \['full_attention', 'sliding_attention'\]"),
        ("gemma3", "yarn", {"factor": 2.0, "layer_types": "full_attention"}, ValueError,
         r"layer_types must be a list of layer types"),
        ("llama", "longrope", {"factor": 2.0, "long_factor": [1.0] * 8, "original_max_position_embeddings": 1},
         ValueError, r"original_max_position_embeddings must be an int >= 2, got 1"),
        ("llama", YarnConfig(factor=2.0), {"scale": 3}, ValueError, r"yarn: unknown option\(s\) scale; valid options"),
        ("llama", "yarn", {"factor": 2.0, "replace_scaling": "yes"}, ValueError, r"replace_scaling must be True or False"),
        ("llama", ["yarn:factor=2", "pi:factor=2"], {}, ValueError, r"'yarn' and 'pi' are both 'frequency' methods; .*one method per hook"),
        ("llama", ["yarn", "logn"], {"beta": 2.0}, ValueError,
         r"beta is an option of none of the methods combined \(yarn: factor, .*; logn: original_max_position_embeddings\)"),
        ("llama", [], {}, ValueError, r"give at least one method; valid methods: abs_hierarchical, abs_interp, alibi, dca, deberta_bucket_scale, deberta_bucket_stretch, dynamic_ntk"),
        ("meta-llama/Llama-3.1-8B", "yarn", {"factor": 2.0}, TypeError,
         r"expects a loaded model .*got str 'meta-llama/Llama-3.1-8B'"),
        ({"model_type": "llama"}, "yarn", {"factor": 2.0}, TypeError, r"expects a loaded model .*got dict"),
    ],
)
def test_bad_input_is_refused_with_the_valid_range(model_arg, method, options, error, message):
    model = tiny_model(model_arg) if model_arg in ("llama", "gemma3") else model_arg
    with pytest.raises(error, match=message):
        rope_ext.patch(model, method, **options)
    if isinstance(model, nn.Module):
        assert rope_ext.get_patch(model) is None and not hasattr(model.config, "rope_ext")


def test_unpatch_and_get_patch_refuse_a_non_model():
    for call in (rope_ext.unpatch, rope_ext.get_patch):
        with pytest.raises(TypeError, match=r"expects a loaded model"):
            call("llama")


def test_static_patch_sets_the_extended_length_and_dynamic_keeps_the_original(caplog):
    model = tiny_model("llama")
    with rope_ext.patched(model, "yarn", factor=4.0):
        assert model.config.max_position_embeddings == 4 * ORIGINAL_CONTEXT
        assert model.config.rope_parameters["original_max_position_embeddings"] == ORIGINAL_CONTEXT
        with caplog.at_level("WARNING"):
            model.generate(input_ids(3 * ORIGINAL_CONTEXT), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert "exceeded the model's predefined maximum length" not in caplog.text
    assert model.config.max_position_embeddings == ORIGINAL_CONTEXT
    with rope_ext.patched(model, "dynamic_ntk", factor=4.0):
        assert model.config.max_position_embeddings == ORIGINAL_CONTEXT  # native "dynamic" reads L from it


# --- the foundation: a toy hook kind and a toy family plug in from outside ---------------------------


@dataclass(frozen=True)
class ToyTemperatureConfig(MethodConfig):
    """Divides a toy model's output by ``temperature`` (a hook kind of its own)."""

    method: ClassVar[str] = "toy_temperature"
    hook: ClassVar[str] = "toy_temperature"
    temperature: float = 2.0


@dataclass(eq=False)
class ToyOutputSite(Site):
    kind: ClassVar[str] = "toy_output"
    module: nn.Module


class ToyTemperatureInstaller(HookInstaller):
    kind = "toy_temperature"
    site_kinds = frozenset({"toy_output"})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        for site in builder.sites.get("toy_output"):
            builder.edit(site.module, "temperature", method.temperature)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig()
        self.head = nn.Linear(4, 4)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) / self.temperature


class ToyFamily(FamilyAdapter):
    name = "toy"
    site_kinds = frozenset({"toy_output"})

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, ToyModel)

    def locate(self, model: nn.Module) -> Sites:
        return Sites(model.config, {"toy_output": [ToyOutputSite(model)]})


@pytest.fixture
def toy_kind():
    register_method(ToyTemperatureConfig)
    register_hook(ToyTemperatureInstaller())
    register_family(ToyFamily())
    yield
    unregister_family("toy")
    unregister_hook("toy_temperature")
    unregister_method("toy_temperature")


def test_a_toy_hook_kind_and_family_plug_in_without_touching_core(toy_kind):
    model, x = ToyModel(), torch.randn(2, 4)
    before = model(x)
    assert "toy" in rope_ext.list_families()
    rope_ext.patch(model, "toy_temperature", temperature=4.0)
    torch.testing.assert_close(model(x), before / 4.0)
    assert model.config.rope_ext["methods"] == [{"method": "toy_temperature", "temperature": 4.0}]
    with pytest.raises(ValueError, match=r"needs a 'frequency' hook, which family 'toy' does not support; methods "
                                         r"for toy: toy_temperature"):
        rope_ext.patch(ToyModel(), "yarn", factor=2.0)
    rope_ext.unpatch(model)
    assert torch.equal(model(x), before) and model.temperature == 1.0
    with pytest.raises(ValueError, match=r"needs a 'toy_temperature' hook, which family 'llama' does not support"):
        rope_ext.patch(tiny_model("llama"), "toy_temperature")


class ToyRotaryInstaller(HookInstaller):
    """A second hook kind on the rotary site: records its value on the shared replacement module."""

    kind = "toy_temperature"
    site_kinds = frozenset({"rotary"})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        for site in builder.sites.get("rotary"):
            builder.edit(site.replacement(builder), "toy_temperature", method.temperature)


@pytest.fixture
def toy_rotary_kind():
    register_method(ToyTemperatureConfig)
    register_hook(ToyRotaryInstaller())
    yield
    unregister_hook("toy_temperature")
    unregister_method("toy_temperature")


def test_combination_is_one_plan_shares_the_rotary_site_and_round_trips(tmp_path, toy_rotary_kind):
    model = tiny_model("llama")
    ids = input_ids(LONG)
    base, base_config = logits(model, ids), model.config.to_dict()
    combination = [{"method": "yarn", "factor": 4.0}, ToyTemperatureConfig(temperature=3.0)]
    rope_ext.patch(model, combination)
    rotary = model.model.rotary_emb
    assert rotary.method == YarnConfig(factor=4.0) and rotary.toy_temperature == 3.0  # one module, two kinds
    assert rope_ext.get_patch(model) == (YarnConfig(factor=4.0), ToyTemperatureConfig(temperature=3.0))
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    assert [m["method"] for m in json.loads((tmp_path / "config.json").read_text())["rope_ext"]["methods"]] == [
        "yarn", "toy_temperature"]
    restored = rope_ext.from_pretrained(tmp_path)
    assert rope_ext.get_patch(restored) == rope_ext.get_patch(model)
    assert torch.equal(logits(restored, ids), expected)
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, ids), base)
    assert model.config.to_dict() == base_config | {"architectures": ["LlamaForCausalLM"]}  # set by save_pretrained


def test_a_failing_method_in_a_combination_leaves_the_model_untouched(toy_rotary_kind):
    model = tiny_model("llama")
    ids = input_ids(LONG)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=4096 exceeds"):
        rope_ext.patch(model, [ToyTemperatureConfig(), YarnConfig(factor=2.0, original_max_position_embeddings=4096)])
    assert rope_ext.get_patch(model) is None and torch.equal(logits(model, ids), before)
    assert not hasattr(model.config, "rope_ext")


def test_cli_specs_combine_methods_of_different_kinds(toy_rotary_kind):
    from rope_ext.runs.specs import parse_methods

    spec = "yarn:factor=4+toy_temperature:temperature=3"
    methods = parse_methods(f"none,{spec}")
    assert methods == {"none": [], spec: [YarnConfig(factor=4.0), ToyTemperatureConfig(temperature=3.0)]}
    model = tiny_model("llama")
    with rope_ext.patched(model, methods[spec]):
        assert rope_ext.get_patch(model) == tuple(methods[spec])



# --- found by a hands-on trial -----------------------------------------------------------------------


@pytest.mark.parametrize("copy_how", ["deepcopy", "pickle"])
def test_a_copied_patched_model_unpatches_cleanly(tmp_path, copy_how):
    import io

    model = tiny_model("llama")
    ids = input_ids(LONG)
    base = logits(model, ids)
    rope_ext.patch(model, "yarn", factor=2.0)
    if copy_how == "deepcopy":
        clone = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    rope_ext.unpatch(clone)
    assert not hasattr(clone.config, "rope_ext") and torch.equal(logits(clone, ids), base)
    clone.save_pretrained(tmp_path)  # the "absent" marker did not end up in the config


@pytest.mark.parametrize("method", ["pi", "yarn", "llama3", "ntk"])
def test_casting_before_or_after_patching_gives_the_same_model(method):
    ids = input_ids(LONG)
    cast_first = tiny_model("llama").to(torch.bfloat16)
    rope_ext.patch(cast_first, method, factor=4.0)
    patch_first = tiny_model("llama")
    rope_ext.patch(patch_first, method, factor=4.0)
    patch_first = patch_first.to(torch.bfloat16)
    assert torch.equal(logits(cast_first, ids), logits(patch_first, ids))


FACTOR_RANGE = r"factor must be a number >= 1 and <= 1e6"
OVERFLOW = r"these options give non-finite or zero rotary frequencies"


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [("pi", {"factor": 2**70}, FACTOR_RANGE), ("yarn", {"factor": 1e308}, FACTOR_RANGE),
     ("dynamic_ntk", {"factor": 1e308}, FACTOR_RANGE), ("dynamic_ntk", {"factor": 2**70}, FACTOR_RANGE),
     ("yarn", {"factor": 2.0, "attention_factor": 1e200}, OVERFLOW)],
)
def test_values_that_overflow_are_refused(method, options, message):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"{method}: {message}"):
        rope_ext.patch(model, method, **options)
    assert rope_ext.get_patch(model) is None


def test_patched_keeps_the_bodys_exception_when_the_body_unpatched():
    model = tiny_model("llama")
    with pytest.raises(KeyError, match="boom"):
        with rope_ext.patched(model, "yarn", factor=2.0):
            rope_ext.unpatch(model)
            raise KeyError("boom")


def test_messages_name_site_options_valid_methods_and_the_patched_part():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"unknown option\(s\) layer_type; .*site options \(keyword arguments of patch, not part of a method's options\): "
                                         r"layer_types, replace_scaling"):
        rope_ext.patch(model, "yarn", factor=2.0, layer_type=["full_attention"])
    with pytest.raises(TypeError, match=r"not NoneType None; valid methods: abs_hierarchical, abs_interp, alibi, dca, deberta_bucket_scale, deberta_bucket_stretch, dynamic_ntk"):
        rope_ext.patch(model, None)
    rope_ext.patch(model, "yarn", factor=2.0)
    with pytest.raises(RuntimeError, match=r"part of this model \('the module itself'\) is already patched"):
        rope_ext.patch(model.model.rotary_emb, "pi", factor=2.0)
    with pytest.raises(RuntimeError, match=r"not patched itself, but part of it \('rotary_emb'\) was replaced"):
        rope_ext.unpatch(model.model)


def test_reload_of_a_0_1_block_beside_native_rope_parameters(tmp_path):
    """rope_ext 0.1 saved native yarn rope_parameters and a one-method block, without the base values."""
    model = tiny_model("llama")
    ids = input_ids(160)
    base = logits(model, ids)
    rope_ext.patch(model, "yarn", factor=4.0)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["rope_ext"] = {"method": saved["rope_ext"]["methods"][0], "layer_types": None}
    saved["max_position_embeddings"] = ORIGINAL_CONTEXT  # 0.1 left it alone
    (tmp_path / "config.json").write_text(json.dumps(saved))
    restored = rope_ext.from_pretrained(tmp_path)
    assert rope_ext.get_patch(restored) == YarnConfig(factor=4.0)
    torch.testing.assert_close(logits(restored, ids), expected, rtol=0, atol=1e-5)
    rope_ext.unpatch(restored)
    torch.testing.assert_close(logits(restored, ids), base, rtol=0, atol=1e-5)


# --- found by a review ------------------------------------------------------------------------------


def _tiny_gemma3_multimodal():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_config("gemma3").to_dict()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).eval()


def test_a_multimodal_model_edits_its_text_config_and_reloads_unpatched(tmp_path):
    model = _tiny_gemma3_multimodal()
    ids = input_ids(160)
    base = logits(model, ids)
    rope_ext.patch(model, "yarn", factor=4.0)
    assert model.config.text_config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert set(model.config.rope_ext["base"]) == {"text_config.max_position_embeddings", "text_config.rope_parameters"}
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    torch.testing.assert_close(logits(restored, ids), expected, rtol=0, atol=1e-5)
    rope_ext.unpatch(restored)
    torch.testing.assert_close(logits(restored, ids), base, rtol=0, atol=1e-5)
    assert restored.config.text_config.rope_parameters["full_attention"]["rope_type"] == "default"


def test_from_pretrained_takes_transformers_keyword_arguments(tmp_path):
    model = tiny_model("llama")
    rope_ext.patch(model, "yarn", factor=4.0)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path, use_cache=False, dtype=torch.bfloat16)
    assert restored.config.use_cache is False and restored.dtype == torch.bfloat16
    assert rope_ext.get_patch(restored) == YarnConfig(factor=4.0)
    config = AutoConfig.from_pretrained(tmp_path)
    snapshot = copy.deepcopy(config.to_dict())
    rope_ext.from_pretrained(tmp_path, config=config)
    assert config.to_dict() == snapshot  # the caller's config object is left as it was


def test_replacing_a_scaling_that_states_no_original_length_needs_one():
    model = tiny_model("llama", rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"'linear' scaling gives no original context length .*pass "
                                         r"original_max_position_embeddings"):
        rope_ext.patch(model, "yarn", factor=2.0, replace_scaling=True)
    rope_ext.patch(model, "yarn", factor=2.0, original_max_position_embeddings=32, replace_scaling=True)


@pytest.mark.parametrize(
    ("methods", "alone", "native", "length"),
    [
        ([{"method": "yarn", "factor": 4.0}, "dca"], "yarn:factor=4", "yarn", 4 * ORIGINAL_CONTEXT),
        ([{"method": "pi", "factor": 4.0}, "rerope"], "pi:factor=4", "linear", 4 * ORIGINAL_CONTEXT),
        ([{"method": "ntk", "factor": 4.0}, "dca"], "ntk:factor=4", "default", 4 * ORIGINAL_CONTEXT),
        (["dca"], None, "default", ORIGINAL_CONTEXT),
        (["yarn:factor=4", "logn"], "yarn:factor=4", "yarn", 4 * ORIGINAL_CONTEXT),
    ],
    ids=["yarn+dca", "pi+rerope", "ntk+dca", "dca", "yarn+logn"],
)
def test_a_saved_patch_claims_only_what_plain_transformers_honours(tmp_path, methods, alone, native, length):
    """config.json keeps the frequency method's native rope_parameters and its extended length where transformers
    has the method (a plain from_pretrained gives that method alone, honestly; static NTK is its new base, rope_type
    default), and otherwise the unpatched rotation with the original length: never the unpatched rotation beside a
    longer max_position_embeddings."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    ids = input_ids(LONG)
    base = logits(model, ids)
    rope_ext.patch(model, methods)
    patched = logits(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == native and saved["max_position_embeddings"] == length
    theta = tiny_model("llama").config.rope_parameters["rope_theta"]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    new_theta = theta * 4.0 ** (head_dim / (head_dim - 2)) if methods[0] == {"method": "ntk", "factor": 4.0} else theta
    assert saved["rope_parameters"]["rope_theta"] == pytest.approx(new_theta, rel=1e-15)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected = base
    if alone is not None:  # plain transformers honours the frequency part
        expected = logits(rope_ext.patch(tiny_model("llama"), alone), ids)
    torch.testing.assert_close(logits(plain, ids), expected, rtol=0, atol=1e-5)
    restored = rope_ext.from_pretrained(tmp_path)
    assert torch.equal(logits(restored, ids), patched)


def test_a_combination_with_a_toy_kind_keeps_the_native_frequency_part(toy_rotary_kind):
    model = tiny_model("llama")
    rope_ext.patch(model, [YarnConfig(factor=4.0), ToyTemperatureConfig()])
    assert model.config.rope_parameters["rope_type"] == "yarn"  # what a plain reload can honour: yarn alone
    rope_ext.unpatch(model)
    assert model.config.rope_parameters["rope_type"] == "default"


@pytest.mark.parametrize("spec", ["yarn:factor=4", "rerope:w=8", "alibi", "kerple"])
def test_a_model_dispatched_across_cpu_and_disk_patches_generates_and_unpatches(tmp_path, spec):
    """A model too large for one device, loaded through ``from_pretrained(..., device_map=...)`` with a layer offloaded
    to disk (accelerate's hooks load its weights for each forward): patched, it gives the plain patched model's
    logits, generates, and ``unpatch`` restores its own logits bit-exactly."""
    _, before, patched = patched_dispatched(tiny_model("llama"), tmp_path, spec, input_ids(40))
    assert not torch.equal(patched, before)


def test_a_model_with_quantized_weights_patches_generates_and_unpatches():
    """torchao's int8 weight-only quantization (the linear layers' weights; the rotary module and attention stay in
    floating point) takes a patch as any model does (tests/quantized.py, in a process of its own with torchao, which
    ``make setup`` keeps in .venv/quantization: in site-packages transformers would import it on every start): YaRN
    equal to the same quantized weights with transformers' own yarn exactly; YaRN, ReRoPE and ALiBi within twice the
    unpatched quantization error of the float model patched alike; generation; a bit-exact ``unpatch``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folder = Path(sys.prefix) / "quantization"
    assert (folder / "torchao").is_dir(), f"torchao is not in {folder}: run make setup"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(root / "tests"), str(root)]),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(root / "tests" / "quantized.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    checked = json.loads(run.stdout.strip().splitlines()[-1])
    assert checked == {"quantized": True, "yarn_native_equal": True,
                       "specs": ["yarn:factor=4", "rerope:w=8", "alibi"]}, checked
