"""The attention program is open: a toy bias term, a toy learnable bias and a toy wrapper term, added from this
file (a method config and an installer), combine with a frequency method and a position rule, on a Llama and on a
GPT-2 (its family locator: attention modules, no rotary module) built from configs; fast == the plain reference, the identity term ==
the unpatched logits, and a learnable term trains, saves, reloads and unpatches as documented."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, tiny_model
from torch import nn

import rope_ext
from rope_ext.attention.program import Bias, Call, Wrapper, kernel_override
from rope_ext.attention.reference import program_reference
from rope_ext.installers import HookInstaller, PlanBuilder, Sites, own, program_setup, register_hook, unregister_hook
from rope_ext.methods import MethodConfig, register_method, unregister_method

L = ORIGINAL_CONTEXT


# --- a toy bias: -slope_h * (i - j), ALiBi-like, fixed or learnable ------------------------------------------


@dataclass(frozen=True)
class ToyBiasConfig(MethodConfig):
    method: ClassVar[str] = "toy_bias"
    hook: ClassVar[str] = "toy_bias"
    slope: float = 0.1
    learnable: bool = False


class Slopes(nn.Module):
    def __init__(self, heads: int, slope: float) -> None:
        super().__init__()
        self.slopes = nn.Parameter(slope * 0.5 ** torch.arange(heads, dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        return self.slopes


@dataclass(eq=False)
class ToyBias(Bias):
    name: ClassVar[str] = "toy_bias"
    slopes: torch.Tensor | None  # fixed slopes, or
    owned: object = None  # the handle of learnable ones

    def bias(self, q_pos, k_pos):
        slopes = self.slopes if self.owned is None else self.owned()
        distance = (q_pos[:, None] - k_pos[None]).clamp(min=0)  # [n, m]
        return -slopes[:, None, None] * distance


class ToyBiasInstaller(HookInstaller):
    kind = "toy_bias"
    site_kinds = frozenset({"attention"})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        setup = program_setup(builder, method.method)
        heads = setup.programs[0][0].module.config.num_attention_heads
        owned = own(builder, "toy_bias", Slopes(heads, method.slope)) if method.learnable else None
        fixed = None if owned else method.slope * 0.5 ** torch.arange(heads, dtype=torch.float32)
        for _, program in setup.programs:
            program.add(ToyBias(fixed, owned))


# --- a toy wrapper: attention within groups of `size` tokens (shifted sparse attention without the shift) ---------


@dataclass(frozen=True)
class ToyGroupsConfig(MethodConfig):
    method: ClassVar[str] = "toy_groups"
    hook: ClassVar[str] = "toy_groups"
    size: int = 16


@dataclass(eq=False)
class ToyGroups(Wrapper):
    name: ClassVar[str] = "toy_groups"
    size: int

    def wrap(self, call: Call, inner):
        b, h, n, d = call.q.shape
        if n != call.k.shape[2] or n % self.size or call.rows is not None:
            return inner(call)  # (decode, ragged lengths, padding: the whole call)
        g = n // self.size
        positions = call.position_ids
        if positions is None:
            positions = torch.arange(n, device=call.q.device)[None].expand(b, n)
        positions = positions.expand(b, n).reshape(b * g, self.size)

        def grouped(x):  # [b, heads, n, d] -> [b * g, heads, size, d]
            return x.unflatten(2, (g, self.size)).transpose(1, 2).flatten(0, 1)

        out = inner(call.replace(q=grouped(call.q), k=grouped(call.k), v=grouped(call.v), position_ids=positions, link=None))
        return out.unflatten(0, (b, g)).transpose(1, 2).flatten(2, 3)


class ToyGroupsInstaller(HookInstaller):
    kind = "toy_groups"
    site_kinds = frozenset({"attention"})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        for _, program in program_setup(builder, method.method).programs:
            program.add(ToyGroups(method.size))


@pytest.fixture(scope="module", autouse=True)
def toy_kinds():
    register_method(ToyBiasConfig)
    register_method(ToyGroupsConfig)
    register_hook(ToyBiasInstaller())
    register_hook(ToyGroupsInstaller())
    yield
    unregister_hook("toy_groups")
    unregister_hook("toy_bias")
    unregister_method("toy_groups")
    unregister_method("toy_bias")


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=4 * L, attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()


MODELS = {"llama": lambda: tiny_model("llama"), "gpt2": gpt2}
COMBINATIONS = [
    ("llama", ["toy_bias"]),
    ("llama", ["toy_bias", "yarn:factor=4"]),
    ("llama", ["toy_bias", "dca"]),
    ("llama", ["toy_bias", "self_extend:G=4", "logn"]),
    ("llama", ["toy_groups:size=32", "dca"]),
    ("llama", ["toy_groups:size=32", "toy_bias", "rerope"]),
    ("llama", ["toy_groups:size=32", "yarn:factor=4"]),
    ("gpt2", ["toy_bias"]),
    ("gpt2", ["toy_groups:size=32", "toy_bias"]),
]


@pytest.mark.parametrize(("family", "methods"), COMBINATIONS, ids=["+".join([f, *m]) for f, m in COMBINATIONS])
def test_toy_terms_fast_path_matches_the_plain_reference(family, methods, monkeypatch):
    from rope_ext.attention import kernels

    monkeypatch.setattr(kernels, "TILE", 16)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 41)
    model = MODELS[family]()
    ids = input_ids(3 * L, batch=2)
    base = logits(model, ids)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    with rope_ext.patched(model, methods):
        fast = logits(model, ids)
        padded = logits(model, ids, attention_mask=mask)
        with kernel_override(program_reference):
            reference = logits(model, ids)
            reference_padded = logits(model, ids, attention_mask=mask)
    torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)
    torch.testing.assert_close(padded, reference_padded, rtol=0, atol=2e-5)
    assert (fast - base).abs().max() > 1e-3  # the terms changed something
    assert torch.equal(logits(model, ids), base)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_identity_terms_give_the_unpatched_logits(family):
    model = MODELS[family]()
    ids = input_ids(2 * L, batch=2)
    base = logits(model, ids)
    with rope_ext.patched(model, ["toy_bias:slope=0", "toy_groups:size=1024"]):
        torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=1e-5)
        assert "toy_bias" in rope_ext.summary(model) and "toy_groups" in rope_ext.summary(model)
    assert torch.equal(logits(model, ids), base)


def test_the_toy_wrapper_confines_attention_to_groups():
    """Changing the first group's tokens leaves the second group's logits as they were (and without the wrapper
    it does not)."""
    model = tiny_model("llama")
    ids = input_ids(64)
    other = ids.clone()
    other[:, :8] = (other[:, :8] + 1) % 100 + 3
    with rope_ext.patched(model, ["toy_groups:size=32", "dca"]):
        torch.testing.assert_close(logits(model, ids)[:, 32:], logits(model, other)[:, 32:], rtol=0, atol=1e-6)
    with rope_ext.patched(model, "dca"):
        assert (logits(model, ids)[:, 32:] - logits(model, other)[:, 32:]).abs().max() > 1e-4


def test_a_learnable_term_trains_saves_reloads_and_unpatches_as_documented(tmp_path):
    model = tiny_model("llama")
    ids = input_ids(2 * L)
    base = logits(model, ids)
    rope_ext.patch(model, ["toy_bias:learnable=true", "dca"])
    assert [name for name, _ in model.named_parameters() if name.startswith("rope_ext.")] == ["rope_ext.toy_bias.slopes"]
    initial = model.rope_ext.toy_bias.slopes.detach().clone()
    optimizer = torch.optim.SGD([model.rope_ext.toy_bias.slopes], lr=0.5)
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = model.rope_ext.toy_bias.slopes.detach().clone()
    assert not torch.equal(trained, initial)
    expected = logits(model, ids)
    assert "parameters owned: 4 (4 trainable) under 'rope_ext.'" in rope_ext.summary(model)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert torch.equal(restored.rope_ext.toy_bias.slopes, trained)
    assert torch.equal(logits(restored, ids), expected)
    with pytest.raises(RuntimeError, match=r"trained since patching \(toy_bias.slopes\).*discard_trained=True"):
        rope_ext.unpatch(model)
    assert rope_ext.get_patch(model) is not None  # refused: nothing changed
    rope_ext.unpatch(model, discard_trained=True)
    assert not hasattr(model, "rope_ext") and torch.equal(logits(model, ids), base)
    fresh = rope_ext.patch(tiny_model("llama"), ["toy_bias:learnable=true", "dca"])
    rope_ext.unpatch(fresh)  # untrained: nothing to refuse


def test_a_learnable_term_trains_under_peft_modules_to_save_and_reloads(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = tiny_model("llama")
    ids = input_ids(2 * L)
    rope_ext.patch(model, "toy_bias:learnable=true")
    model.save_pretrained(tmp_path / "base")
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["rope_ext"]))
    trainable = [name for name, p in wrapped.named_parameters() if p.requires_grad]
    assert any("rope_ext.modules_to_save" in name for name in trainable)
    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        wrapped(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = wrapped(input_ids=ids).logits.detach()
    copy = wrapped.base_model.model.rope_ext.modules_to_save["default"].toy_bias.slopes
    assert not torch.equal(copy, wrapped.base_model.model.rope_ext.original_module.toy_bias.slopes)
    wrapped.save_pretrained(tmp_path / "adapter")
    restored = PeftModel.from_pretrained(rope_ext.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(restored(input_ids=ids).logits.detach(), expected, rtol=0, atol=1e-6)


def test_a_program_refuses_a_second_position_rule_and_two_implementation_owners():
    from rope_ext.attention.program import AttentionProgram, PositionRule

    program = AttentionProgram()
    program.add(PositionRule(None, None, None, 64))
    with pytest.raises(ValueError, match="one position rule"):
        program.add(PositionRule(None, None, None, 64))
    model = tiny_model("llama")
    builder = PlanBuilder(Sites(model.config, {}, model), {}, frozenset())
    builder.set_attn_implementation(model, "rope_ext", [model.config])
    with pytest.raises(ValueError, match="one attention program runs every kind's terms"):
        builder.set_attn_implementation(model, "other", [model.config])


def test_options_of_toy_configs_round_trip():
    config = ToyBiasConfig(slope=0.2, learnable=True)
    assert MethodConfig.from_dict(config.to_dict()) == config
    assert dataclasses.replace(config, slope=0.3).slope == 0.3
