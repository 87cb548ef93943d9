"""Every family built on transformers' shared ``rotary_emb`` design, as rows of one table.

Such a model owns one rotary module (``model.model.rotary_emb``) holding ``inv_freq`` and
``attention_scaling`` and returning ``(cos, sin)`` that each attention layer applies with HF's
``rotate_half`` convention (pair ``i`` = dims ``i`` and ``i + d/2``). These families differ only by the
rotary class, plus two table fields: the layer types patched by default on models with per-layer-type
RoPE (Gemma 3: ``full_attention``; its sliding layers use a base of 10k and never see long distances)
and the rope types a family's config class accepts natively (Phi-3 rewrites any but ``longrope``, so
other methods are saved in the ``rope_ext`` block alone). A family with behaviour of its own gets its
own module beside this one.
"""

from __future__ import annotations

import importlib
import inspect

from torch import nn

from rope_ext.hooks.attention import AttentionSite, attention_modules, dispatches_through_interface
from rope_ext.hooks.base import Sites
from rope_ext.hooks.rotary import RotarySite
from rope_ext.patches.base import FamilyAdapter, modules_outside_rope_ext, register_family


class RotaryFamily(FamilyAdapter):
    site_kinds = frozenset({RotarySite.kind, AttentionSite.kind})

    def __init__(
        self,
        name: str,
        rotary_classes: tuple[type[nn.Module], ...],
        default_layer_types: tuple[str, ...] | None = None,
        native_rope_types: frozenset[str] | None = None,
        attention: bool = True,
    ) -> None:
        if not attention:  # its attention never runs the registered function: frequency methods only
            self.site_kinds = frozenset({RotarySite.kind})
        self.name = name
        self.rotary_classes = rotary_classes
        self.default_layer_types = default_layer_types
        self.native_rope_types = native_rope_types

    def rotary_sites(self, model: nn.Module) -> list[RotarySite]:
        return [
            RotarySite(self.name, parent, name, child, self.default_layer_types, self.native_rope_types)
            for parent, name, child in modules_outside_rope_ext(model)
            if isinstance(child, self.rotary_classes)
        ]

    def matches(self, model: nn.Module) -> bool:
        return bool(self.rotary_sites(model))

    def locate(self, model: nn.Module) -> Sites:
        rotary = self.rotary_sites(model)
        config = getattr(model, "config", None) or rotary[0].config
        sites = {RotarySite.kind: rotary}
        modules = attention_modules(model, rotary[0].config)
        if modules and len(rotary) == 1:
            sites[AttentionSite.kind] = [AttentionSite(self.name, modules, rotary[0])]
        return Sites(config, sites)


# family -> (module under transformers.models, rotary class[, table fields])
ROTARY_FAMILIES: dict[str, tuple] = {
    "apertus": ("apertus.modeling_apertus", "ApertusRotaryEmbedding"),
    "arcee": ("arcee.modeling_arcee", "ArceeRotaryEmbedding"),
    "bitnet": ("bitnet.modeling_bitnet", "BitNetRotaryEmbedding"),
    "ernie4_5": ("ernie4_5.modeling_ernie4_5", "Ernie4_5RotaryEmbedding"),
    "exaone4": ("exaone4.modeling_exaone4", "Exaone4RotaryEmbedding"),
    "falcon": ("falcon.modeling_falcon", "FalconRotaryEmbedding"),
    "gemma": ("gemma.modeling_gemma", "GemmaRotaryEmbedding"),
    "gemma2": ("gemma2.modeling_gemma2", "Gemma2RotaryEmbedding"),
    "gemma3": ("gemma3.modeling_gemma3", "Gemma3RotaryEmbedding", {"default_layer_types": ("full_attention",)}),
    "glm4": ("glm4.modeling_glm4", "Glm4RotaryEmbedding"),
    "gpt_neox": ("gpt_neox.modeling_gpt_neox", "GPTNeoXRotaryEmbedding"),
    "granite": ("granite.modeling_granite", "GraniteRotaryEmbedding"),
    "granitemoe": ("granitemoe.modeling_granitemoe", "GraniteMoeRotaryEmbedding"),
    "llama": ("llama.modeling_llama", "LlamaRotaryEmbedding"),
    "mistral": ("mistral.modeling_mistral", "MistralRotaryEmbedding"),
    "mixtral": ("mixtral.modeling_mixtral", "MixtralRotaryEmbedding"),
    "nemotron": ("nemotron.modeling_nemotron", "NemotronRotaryEmbedding"),
    "olmo": ("olmo.modeling_olmo", "OlmoRotaryEmbedding"),
    "olmo2": ("olmo2.modeling_olmo2", "Olmo2RotaryEmbedding"),
    "olmoe": ("olmoe.modeling_olmoe", "OlmoeRotaryEmbedding"),
    "persimmon": ("persimmon.modeling_persimmon", "PersimmonRotaryEmbedding"),
    "phi": ("phi.modeling_phi", "PhiRotaryEmbedding"),
    "phi3": ("phi3.modeling_phi3", "Phi3RotaryEmbedding", {"native_rope_types": frozenset({"longrope"})}),
    "qwen2": ("qwen2.modeling_qwen2", "Qwen2RotaryEmbedding"),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeRotaryEmbedding"),
    "qwen3": ("qwen3.modeling_qwen3", "Qwen3RotaryEmbedding"),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeRotaryEmbedding"),
    "seed_oss": ("seed_oss.modeling_seed_oss", "SeedOssRotaryEmbedding"),
    "smollm3": ("smollm3.modeling_smollm3", "SmolLM3RotaryEmbedding"),
    "stablelm": ("stablelm.modeling_stablelm", "StableLmRotaryEmbedding"),
    "starcoder2": ("starcoder2.modeling_starcoder2", "Starcoder2RotaryEmbedding"),
}


def _attention_dispatches(module) -> bool:
    """Whether every attention class of a modeling module runs ``AttentionInterface``'s function."""
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if c.__module__ == module.__name__ and c.__name__.endswith("Attention") and issubclass(c, nn.Module)]
    return bool(classes) and all(dispatches_through_interface(c) for c in classes)


for _name, (_module, _class, *_fields) in ROTARY_FAMILIES.items():
    _modeling = importlib.import_module(f"transformers.models.{_module}")
    _options = dict(_fields[0]) if _fields else {}
    register_family(RotaryFamily(_name, (getattr(_modeling, _class),), attention=_attention_dispatches(_modeling), **_options))
