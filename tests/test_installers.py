"""The hook installers: the combinations they declare they cannot take (checked in one place, the plan builder),
and bugs of the installers' sites: biases on sliding-window layers while generating, OPT's table in padded batches."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, VOCAB, input_ids, logits, tiny_config, tiny_model
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext.installers import HookInstaller, PlanBuilder, get_hook, register_hook, unregister_hook
from rope_ext.installers.combination import ROTATES_IN_ATTENTION
from rope_ext.methods import (
    HOOK_FREQUENCY,
    MethodConfig,
    get_method_class,
    list_methods,
    register_method,
    unregister_method,
)

L = ORIGINAL_CONTEXT
WINDOW = 8
#: FIRE with a threshold below the prompt, so its bias depends on the query's position (the default 512 does not)
BIASES = ["alibi", "kerple", "sandwich", "fire:threshold=4"]


# --- the combination rules: declared by each installer, checked in one place -------------------------------------


@dataclass(frozen=True)
class ToyConfig(MethodConfig):
    method: ClassVar[str] = "toy_combination"
    hook: ClassVar[str] = "toy_combination"


class ToyInstaller(HookInstaller):
    """A hook kind on the rotary site that declares it cannot be combined with frequency methods, nor with methods
    that rotate in attention; ``planned`` counts its plans (none may run for a refused combination)."""

    kind = "toy_combination"
    site_kinds = frozenset({"rotary"})
    conflicts = {
        HOOK_FREQUENCY: "{method} reads the checkpoint's frequencies, which {other} replaces",
        ROTATES_IN_ATTENTION: "{method} reads the rotary module's output, which {other} makes the identity",
    }
    planned = 0

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        type(self).planned += 1


@pytest.fixture
def toy_kind():
    register_method(ToyConfig)
    register_hook(ToyInstaller())
    ToyInstaller.planned = 0
    yield
    unregister_hook("toy_combination")
    unregister_method("toy_combination")


def untouched(model) -> tuple:
    return repr(model), tuple(model.state_dict()), rope_ext.get_patch(model)


def test_a_toy_installers_declared_conflicts_are_refused_by_the_central_check(toy_kind):
    model = tiny_model("llama")
    before = untouched(model)
    with pytest.raises(ValueError, match=(
        r"^toy_combination cannot be combined with yarn \('frequency' methods: .*yarn\): toy_combination reads the "
        r"checkpoint's frequencies, which yarn replaces; toy_combination combines with 'bias' methods \(.*\) and "
        r"'query_scale' methods \(logn, temperature\) and 'wrapper' methods \(s2_attn\)$")):
        rope_ext.patch(model, ["yarn:factor=2", ToyConfig()])
    with pytest.raises(ValueError, match=(
        r"^toy_combination cannot be combined with xpos \(it rotates queries and keys inside attention\): "
        r"toy_combination reads the rotary module's output, which xpos makes the identity")):
        rope_ext.patch(model, [ToyConfig(), "xpos"])
    assert ToyInstaller.planned == 0 and untouched(model) == before  # (refused before any installer planned)
    with rope_ext.patched(model, [ToyConfig(), "logn"]):  # (what it declares nothing against)
        assert ToyInstaller.planned == 1
    with pytest.raises(ValueError, match=r"^toy_combination cannot be combined with dca \(it rotates queries"):
        rope_ext.patch(model, ["dca", ToyConfig()])  # (an attention method: the trait, whatever its kind)
    with pytest.raises(ValueError, match=r"^alibi cannot be combined with xpos"):
        rope_ext.patch(model, ["alibi", "xpos", ToyConfig()])  # (the first pair in the combination's order)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=L)
    return GPT2LMHeadModel(config).eval()


def tiny_t5():
    from transformers import AutoModelForSeq2SeqLM, T5Config

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, decoder_start_token_id=0)
    return AutoModelForSeq2SeqLM.from_config(config).eval()


#: (installer's kind, declared key) -> (a model, a combination, the pair the refusal names)
DECLARED = {
    ("bias", "frequency"): ("llama", "alibi+yarn:factor=2", "alibi", "yarn"),
    ("bias", "position_rule"): ("llama", "alibi+dca", "alibi", "dca"),
    ("bias", "absolute"): ("gpt2", "alibi+abs_interp", "alibi", "abs_interp"),
    ("bias", "pair_scale"): ("llama", "xpos+alibi", "alibi", "xpos"),
    ("bias", "bucket"): ("t5", "alibi+t5_bucket_scale:factor=2", "alibi", "t5_bucket_scale"),
    ("pair_scale", "position_rule"): ("llama", "xpos+dca", "xpos", "dca"),
    ("wrapper", "position_rule"): ("llama", "s2_attn+dca", "s2_attn", "dca"),
    ("wrapper", "query_scale"): ("llama", "s2_attn+logn", "s2_attn", "logn"),
    ("wrapper", "pair_scale"): ("llama", "s2_attn+xpos", "s2_attn", "xpos"),
    ("wrapper", "bias"): ("llama", "s2_attn+alibi", "s2_attn", "alibi"),
    ("wrapper", ROTATES_IN_ATTENTION): ("llama", "dynamic_ntk:factor=2:cache_consistent=true+s2_attn", "s2_attn",
                                        "dynamic_ntk"),
}
MODELS = {"llama": lambda: tiny_model("llama"), "gpt2": tiny_gpt2, "t5": tiny_t5}


def test_every_declared_conflict_has_a_case_below():
    kinds = {get_method_class(name).hook for name in list_methods()}
    declared = {(kind, key) for kind in kinds for key in get_hook(kind).conflicts}
    assert declared == set(DECLARED)


@pytest.mark.parametrize(("kind", "key"), list(DECLARED))
def test_each_declared_conflict_is_refused_naming_the_pair_and_why(kind, key):
    family, spec, method, other = DECLARED[(kind, key)]
    model = MODELS[family]()
    before = untouched(model)
    reason = get_hook(kind).conflicts[key].format(method=method, other=other)
    with pytest.raises(ValueError, match=rf"^{method} cannot be combined with {other} \(.*\): {re.escape(reason)}; "
                                         rf"{method} combines with "):
        rope_ext.patch(model, spec)
    assert untouched(model) == before


# --- biases on sliding-window layers ------------------------------------------------------------------------


def sliding_model(family: str, seed: int = 0):
    """A tiny model whose sliding layers keep ``WINDOW`` keys: Gemma 3 (sliding and full layers), Qwen2 with mixed
    layer types, Mistral with ``sliding_window`` set (every layer slides)."""
    config = tiny_config(family)
    config.sliding_window = WINDOW
    if family == "qwen2":
        config.use_sliding_window = True
        config.layer_types = ["sliding_attention", "full_attention"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


SLIDING = ["gemma3", "qwen2", "mistral"]
GENERATE = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True)


@pytest.mark.parametrize("method", BIASES)
@pytest.mark.parametrize("family", SLIDING)
def test_a_bias_on_sliding_layers_generates_past_the_window_as_the_full_forward(family, method):
    model = sliding_model(family)
    prompt = input_ids(3 * WINDOW)
    with rope_ext.patched(model, method):
        out = model.generate(prompt, **GENERATE)
        full = logits(model, out.sequences)
    steps = torch.stack(out.logits, 1)
    torch.testing.assert_close(steps, full[:, prompt.shape[1] - 1 : -1], rtol=0, atol=5e-5)


@pytest.mark.parametrize("method", ["alibi", "fire:threshold=4"])
@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_a_left_padded_row_on_sliding_layers_generates_as_the_row_alone(family, method):
    model = sliding_model(family)
    long, short = input_ids(4 * WINDOW, seed=8), input_ids(2 * WINDOW + 3, seed=9)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with rope_ext.patched(model, method):
        out = model.generate(ids, attention_mask=mask, **GENERATE)
        alone = [logits(model, row[None]) for row in (out.sequences[0], out.sequences[1, pad:])]  # (no cache)
    steps, start = torch.stack(out.logits, 1), ids.shape[1] - 1
    torch.testing.assert_close(steps[0], alone[0][0, start:-1], rtol=0, atol=5e-5)
    torch.testing.assert_close(steps[1], alone[1][0, start - pad : -1], rtol=0, atol=5e-5)


# --- OPT's table in padded batches ------------------------------------------------------------------------------


def opt(seed: int = 0):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    config = OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64, vocab_size=128,
                       word_embed_proj_dim=32, max_position_embeddings=L, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    return OPTForCausalLM(config).eval()


@pytest.mark.parametrize("method", ["abs_interp:factor=4", "abs_hierarchical", "sinusoidal"])
def test_a_padded_opt_batch_past_the_table_reads_the_patched_positions(method):
    model = opt()
    long, short = input_ids(2 * L + 10, seed=8), input_ids(L + 20, seed=9)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with rope_ext.patched(model, method):
        batch = logits(model, ids, attention_mask=mask)  # (OPT numbers the positions from the mask: pads at -1)
        alone = [logits(model, row) for row in (long, short)]
    torch.testing.assert_close(batch[0], alone[0][0], rtol=0, atol=5e-5)
    torch.testing.assert_close(batch[1, pad:], alone[1][0], rtol=0, atol=5e-5)


def test_the_position_rules_kind_answers_to_its_old_name():
    """The hook kind of ReRoPE, Self-Extend, DCA and STRING is ``position_rule`` (``attention`` before 0.2, a name
    the attention *site* also has) and their base ``PositionRuleConfig`` (``AttentionConfig``): code written against
    the old names still finds the installer and the class."""
    from rope_ext.installers.base import get_hook
    from rope_ext.methods import HOOK_ATTENTION, HOOK_POSITION_RULE

    assert HOOK_POSITION_RULE == HOOK_ATTENTION == "position_rule"
    assert get_method_class("dca").hook == "position_rule"
    assert get_hook("attention") is get_hook("position_rule")
    from rope_ext.methods import AttentionConfig, PositionRuleConfig

    assert AttentionConfig is PositionRuleConfig and issubclass(get_method_class("dca"), PositionRuleConfig)
