"""Support is one predicate: what ``rope-ext families`` lists for a family is what ``patch`` takes (every method it
lists patches a tiny model of the family; every other registered method is refused with the listing's reason), and
the families tables of README.md and docs/methods.md are the generator's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_biases import gpt2, opt
from test_deberta import tiny_deberta
from test_t5 import tiny_t5
from test_xlnet import tiny_xlnet
from tiny import FAMILY_MODEL_TYPES, input_ids, rotary_dim, tiny_config, tiny_model
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext.families import (
    FamilyAdapter,
    Refusals,
    find_family,
    get_family,
    list_families,
    support_summary,
    support_table,
    with_support_table,
)
from rope_ext.families.listing import table_in
from rope_ext.installers import Sites
from rope_ext.methods import list_methods, make_config

ROOT = Path(__file__).resolve().parent.parent


def full_attention_exaone4():
    """EXAONE 4 as its 1.2B checkpoint has it (no sliding window): the tiny config's default slides on every layer,
    a checkpoint's refusal of attention methods (``locate``), not the family's."""
    config = tiny_config("exaone4")
    config.sliding_window, config.layer_types = None, ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


#: (family, model type) -> a tiny model of it
BUILDERS = {(family, model_type): (lambda family=family: tiny_model(family))
            for family, model_type in FAMILY_MODEL_TYPES.items()}
BUILDERS[("exaone4", "exaone4")] = full_attention_exaone4
BUILDERS |= {("gpt2", "gpt2"): gpt2, ("opt", "opt"): opt, ("deberta_v2", "deberta-v2"): tiny_deberta,
             ("xlnet", "xlnet"): tiny_xlnet}
BUILDERS |= {(family, family): (lambda family=family: tiny_t5(family)) for family in ("t5", "mt5", "umt5")}


def minimal_options(method: str, family: str) -> dict:
    """The options ``method`` cannot do without (a factor, LongRoPE's long factors, XLNet's clamp), else none."""
    half = rotary_dim(family) // 2 if family in FAMILY_MODEL_TYPES else 4  # (elsewhere refused before it is read)
    values = {"factor": 2.0, "clamp_len": 32, "long_factor": [2.0] * half}
    options: dict = {}
    while True:
        try:
            make_config(method, **options)
            return options
        except ValueError as error:
            missing = next((name for name in values if name not in options and re.search(rf"\b{name}\b", str(error))),
                           None)
            if missing is None:
                raise
            options[missing] = values[missing]


def forward(model) -> None:
    ids = input_ids(12)
    extra = {"decoder_input_ids": ids[:, :4]} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        model(input_ids=ids, **extra)


def test_every_registered_family_has_a_tiny_model_here():
    kept = {name for name in list_families() if not get_family(name).discovered}  # (found rows: test_conformance.py)
    assert {family for family, _ in BUILDERS} == kept
    for family, model_type in BUILDERS:
        assert model_type in get_family(family).model_types


@pytest.mark.parametrize(("family", "model_type"), sorted(BUILDERS))
def test_patch_takes_every_method_the_listing_gives_and_refuses_the_others_with_its_reason(family, model_type):
    adapter = get_family(family)
    listed = next(s for s in adapter.supports() if model_type in s.model_types)
    model = BUILDERS[(family, model_type)]()
    assert find_family(model) is adapter and adapter.support(model) == listed
    assert set(adapter.methods) <= set(listed.methods)  # (the family's own listing: what each of its types takes)
    for method in list_methods():
        options = minimal_options(method, family)
        if listed.fits(method):
            rope_ext.patch(model, method, **options)
            forward(model)
            rope_ext.unpatch(model)
            continue
        with pytest.raises(ValueError) as refused:
            rope_ext.patch(model, method, **options)
        assert str(refused.value) == listed.reason(method) and "\n" not in str(refused.value)
        assert rope_ext.get_patch(model) is None


@pytest.mark.parametrize(
    ("family", "method", "message"),
    [
        ("gemma2", "dca", ("method 'dca' does not fit gemma2: its attention caps logits (attn_logit_softcapping=50.0), "
                          "which rope_ext's attention does not implement; methods that rewrite attention are refused "
                          "for it; methods for gemma2: dynamic_ntk, dynamic_yarn, llama3, longrope, ntk, ntk_by_parts, "
                          "pi, yarn")),
        ("glm4", "xpos", ("method 'xpos' does not fit glm4: its attention applies rotary positions in a pair layout of "
                         "its own (not HF's rotate_half), which rope_ext's attention-time rotation does not reproduce; "
                         "methods for glm4: alibi, dynamic_ntk, dynamic_yarn, fire, kerple, llama3, logn, longrope, "
                         "ntk, ntk_by_parts, pi, s2_attn, sandwich, temperature, yarn")),
        ("falcon", "logn", ("method 'logn' needs a 'query_scale' hook, which family 'falcon' does not support; methods "
                           "for falcon: dynamic_ntk, dynamic_yarn, llama3, longrope, ntk, ntk_by_parts, pi, yarn")),
    ],
)
def test_the_families_the_listing_overstated_are_refused_naming_why_and_what_fits(family, method, message):
    """Issue #34: ``rope-ext families`` listed attention methods for Gemma 2 (softcapping), GLM-4, ERNIE 4.5 and
    HunYuan (their rotation cannot move into attention), which ``patch`` refused."""
    assert method not in get_family(family).methods
    with pytest.raises(ValueError) as refused:
        rope_ext.patch(tiny_model(family), method)
    assert str(refused.value) == message
    assert "dca" not in get_family("ernie4_5").methods and "rerope" not in get_family("hunyuan_v1_dense").methods
    assert "dca" in get_family("gemma3").methods and "xpos" in get_family("llama").methods


class TwoTypes(FamilyAdapter):
    """A family whose model type ``b`` refuses the attention site (as a config class that caps logits would)."""

    name = "two_types"
    site_kinds = frozenset({"rotary", "attention"})
    model_types = ("a", "b")  # type: ignore[assignment]

    def refusals(self, model_type: str) -> Refusals:
        return Refusals({"attention": "b caps its logits"} if model_type == "b" else {})

    def matches(self, model) -> bool:
        return False

    def locate(self, model) -> Sites:
        raise AssertionError


def test_a_family_whose_model_types_differ_is_listed_per_model_type():
    family = TwoTypes()
    a, b = family.supports()
    assert (a.label, a.model_types, b.label, b.model_types) == ("two_types (a)", ("a",), "two_types (b)", ("b",))
    assert "dca" in a.methods and "dca" not in b.methods and "yarn" in b.methods
    assert family.support("b") == b and family.methods == list(b.methods)  # (the family as a whole: what both take)
    assert b.reason("dca") == ("method 'dca' does not fit two_types (b): b caps its logits; methods for two_types (b): "
                               + ", ".join(b.methods))
    with pytest.raises(ValueError, match=r"two_types: unknown model type 'c'; its model types: a, b"):
        family.support("c")


@pytest.mark.parametrize(("document", "kind"), [("README.md", "summary"), ("docs/methods.md", "table")])
def test_the_docs_families_table_is_the_generators(document, kind):
    text = (ROOT / document).read_text(encoding="utf-8")
    drifted = f"{document}'s families {kind} drifted: run python scripts/families_table.py --write"
    assert table_in(text, kind) == (support_table() if kind == "table" else support_summary()), drifted
    assert with_support_table(text, kind=kind) == text
