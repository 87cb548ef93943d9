"""Extending rope_ext from outside the package, as docs/methods.md ("Extending rope_ext") shows: a RoPE family (a
table row), a frequency method, a window rule and a bias, each a class and one registration here, checked against
an expectation that does not go through the code it adds. A new hook kind (an installer and a site) is added the
same way by tests/test_foundation.py (``ToyTemperatureInstaller``)."""

from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import rope_ext
from rope_ext import register_family, register_method, unregister_family, unregister_method
from rope_ext.families import get_family, list_families
from rope_ext.families.rotary import ROTARY_FAMILIES, RotaryFamily
from rope_ext.methods import BiasConfig, FrequencyConfig, WindowRule
from rope_ext.methods.frequency import default_inv_freq
from tests.tiny import tiny_model

#: transformers families with a Llama-like rotary module that the table does not list (yet): the first one left
#: is added as a row here
CANDIDATES = ("hyperclovax", "jais2", "cwm", "helium")


def _ids(n: int = 24, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(3))


# --- a RoPE family: one table row --------------------------------------------------------------------------------


def _tiny_of(model_type: str, rope_parameters: dict | None = None) -> torch.nn.Module:
    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=128, max_position_embeddings=16, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    config = AutoConfig.for_model(model_type, **kwargs)
    params = {"rope_type": "default", "rope_theta": 10000.0}
    config.rope_parameters = {**params, **(rope_parameters or {})}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_a_rope_family_is_one_table_row():
    model_type = next(m for m in CANDIDATES if m not in ROTARY_FAMILIES)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = next(name for name, c in inspect.getmembers(modeling, inspect.isclass)
                  if name.endswith("RotaryEmbedding") and c.__module__ == modeling.__name__)
    discovered = get_family(model_type) if model_type in list_families() else None  # (a row found at run time)
    if discovered is not None:
        unregister_family(model_type)
    family = register_family(RotaryFamily(model_type, f"{model_type}.modeling_{model_type}", rotary))
    try:
        model, ids = _tiny_of(model_type), _ids(40)
        with torch.no_grad():
            before = model(input_ids=ids).logits
            native = _tiny_of(model_type, {"rope_type": "linear", "factor": 4.0})
            native.load_state_dict(model.state_dict())
            expected = native(input_ids=ids).logits  # transformers' own linear scaling, not rope_ext's
            rope_ext.patch(model, "pi", factor=4.0)
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
            rope_ext.unpatch(model)
            assert torch.equal(model(input_ids=ids).logits, before)
            rope_ext.patch(model, "rerope", w=8)  # (the row's attention probes are read: position rules fit)
            assert not torch.allclose(model(input_ids=ids).logits, before)
        assert {"pi", "yarn", "rerope", "alibi"} <= set(family.methods)
    finally:
        unregister_family(model_type)
        if discovered is not None:
            register_family(discovered)


# --- a frequency method ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlowerConfig(FrequencyConfig):
    """Toy: every rotary frequency divided by ``factor`` (what transformers calls linear scaling)."""

    method: ClassVar[str] = "toy_slower"

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        return default_inv_freq(spec.base, spec.dim, device) / self.factor, 1.0


def test_a_frequency_method_is_one_config_class():
    register_method(SlowerConfig)
    try:
        model, ids = tiny_model("llama"), _ids(40)
        native = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0})
        native.load_state_dict(model.state_dict())
        with torch.no_grad():
            before = model(input_ids=ids).logits
            rope_ext.patch(model, "toy_slower:factor=3")
            torch.testing.assert_close(model(input_ids=ids).logits, native(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
            rope_ext.unpatch(model)
            assert torch.equal(model(input_ids=ids).logits, before)
        with pytest.raises(ValueError, match=r"toy_slower: factor must be a number >= 1"):
            SlowerConfig(factor=0.5)  # (the option's check is inherited with the field)
    finally:
        unregister_method("toy_slower")


# --- a window rule ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CappedConfig(WindowRule):
    """Toy: relative positions capped at ``w`` (ReRoPE written again, by the public base only)."""

    method: ClassVar[str] = "toy_capped"

    def far_query(self, i):
        return torch.full_like(i, float(self.w))

    def far_key(self, j):
        return torch.zeros_like(j)

    def relative(self, i, j):
        return torch.clamp(i - j, max=self.w)


def test_a_window_rule_is_one_subclass_of_the_public_base():
    register_method(CappedConfig)
    try:
        model, ids = tiny_model("llama"), _ids(40)
        with torch.no_grad():
            before = model(input_ids=ids).logits
            with rope_ext.patched(model, "toy_capped", w=45):  # a window covering the sequence: the model itself
                torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
            with rope_ext.patched(model, "rerope", w=6):
                built_in = model(input_ids=ids).logits
            with rope_ext.patched(model, "toy_capped", w=6):
                torch.testing.assert_close(model(input_ids=ids).logits, built_in, rtol=1e-5, atol=1e-5)
                assert not torch.allclose(built_in, before)
            assert torch.equal(model(input_ids=ids).logits, before)
    finally:
        unregister_method("toy_capped")


# --- a bias ---------------------------------------------------------------------------------------------------------


class ConstantBias(torch.nn.Module):
    def __init__(self, heads: int, value: float) -> None:
        super().__init__()
        self.heads, self.value = heads, value

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return torch.full((self.heads, len(q_pos), len(k_pos)), self.value)


@dataclass(frozen=True)
class ConstantBiasConfig(BiasConfig):
    """Toy: the same bias for every pair, which a softmax ignores: the model keeps no position encoding at all."""

    method: ClassVar[str] = "toy_constant"
    value: float = 3.0

    def module(self, heads: int, index: int = 0, head_dim: int | None = None) -> torch.nn.Module:
        return ConstantBias(heads, self.value)


def test_a_bias_is_one_config_and_its_module():
    register_method(ConstantBiasConfig)
    try:
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128, bos_token_id=1,
                            eos_token_id=2)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).eval()
        ids = _ids(30)
        with torch.no_grad():
            before = model(input_ids=ids).logits
            without_table = GPT2LMHeadModel(copy.deepcopy(config)).eval()
            without_table.load_state_dict(model.state_dict())
            without_table.transformer.wpe.weight.zero_()  # the bias replaces the learned table
            rope_ext.patch(model, "toy_constant")
            torch.testing.assert_close(model(input_ids=ids).logits, without_table(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-5)
            rope_ext.unpatch(model)
            assert torch.equal(model(input_ids=ids).logits, before)
    finally:
        unregister_method("toy_constant")
