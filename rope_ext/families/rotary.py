"""Every family built on transformers' shared ``rotary_emb`` design, as rows of one table (resolved lazily).

Such a model owns one rotary module (``model.model.rotary_emb``) holding ``inv_freq`` and
``attention_scaling`` and returning ``(cos, sin)`` that each attention layer applies with HF's
``rotate_half`` convention (pair ``i`` = dims ``i`` and ``i + d/2``). These families differ only by the
rotary class, plus two table fields: the layer types patched by default on models with per-layer-type
RoPE (Gemma 3, OLMo 3: ``full_attention``; their sliding layers never see long distances)
and the rope types a family's config class accepts natively (Phi-3 rewrites any but ``longrope``, so
other methods are saved in the ``rope_ext`` block alone). A family with behaviour of its own gets its
own module beside this one.

Rows are plain names: importing rope_ext imports no modeling module. A model is matched by the classes of its
own modules (their module path and name, through their base classes), so only the family of a model being
patched is ever imported, and only then is its attention code read (does it dispatch through transformers'
``AttentionInterface``?).
"""

from __future__ import annotations

import functools
import importlib
import inspect

from torch import nn

from rope_ext.families.attention import (
    attention_site,
    dispatches_through_interface,
    program_refused,
    rotation_refused,
    source_of,
)
from rope_ext.families.base import FamilyAdapter, derives_from, modules_outside_rope_ext, register_family
from rope_ext.families.support import Refusals
from rope_ext.installers.attention import AttentionSite
from rope_ext.installers.base import Sites
from rope_ext.installers.rotary import RotarySite

_PREFIX = "transformers.models."


#: the rotary module's measured conventions that no rope_ext method takes: words of the rotary site's refusal -> the
#: family-level reason (a refusal that depends on the checkpoint, a missing original length, is not among them)
#: M-RoPE's family-level reason: the attention kinds refused, the frequency kinds patch it through its own module
MROPE_REFUSAL = ("its rotary embedding is multimodal RoPE (M-RoPE: frequencies split among three position streams), "
                 "which rope_ext's attention methods and biases do not take (frequency methods patch it)")
NOT_STANDARD = (
    ("returned a Tensor", "its rotary module returns complex frequencies (freqs_cis), not (cos, sin): Llama 4's and "
                          "DeepSeek-V2's convention, which rope_ext's rotary does not take"),
    ("M-RoPE", MROPE_REFUSAL),
    ("not standard RoPE", "its rotary module is not standard RoPE (measured on one built from its default config: "
                          "its cos/sin are not cat(freqs, freqs) at the config's base, e.g. interleaved pairs or "
                          "half-size tables), which rope_ext's rotary does not take"),
)


#: words of the attention classes of a modeling module that serve another modality (Gemma 4's audio and vision
#: towers): a causal LM's text layers never run them, so they decide nothing of the family's support
OTHER_MODALITIES = ("Audio", "Vision", "Speech", "Image")


class RotaryFamily(FamilyAdapter):
    """A family whose rotary module is the class ``class_name`` of ``transformers.models.<module>``."""

    def __init__(
        self,
        name: str,
        module: str,
        class_name: str,
        default_layer_types: tuple[str, ...] | None = None,
        native_rope_types: frozenset[str] | None = None,
    ) -> None:
        self.name = name
        self.module = _PREFIX + module
        self.class_name = class_name
        self.default_layer_types = default_layer_types
        self.native_rope_types = native_rope_types

    @functools.cached_property
    def attention_classes(self) -> list[type]:
        """The attention classes of the family's modeling module (importing it: on first use only)."""
        modeling = importlib.import_module(self.module)
        return [c for _, c in inspect.getmembers(modeling, inspect.isclass)
                if c.__module__ == modeling.__name__ and c.__name__.endswith("Attention") and issubclass(c, nn.Module)
                and not any(word in c.__name__ for word in OTHER_MODALITIES)]

    @functools.cached_property
    def site_kinds(self) -> frozenset[str]:  # type: ignore[override]
        """Rotary and attention sites; rotary alone where the family's attention never runs the registered
        function."""
        classes = self.attention_classes
        attention = bool(classes) and all(dispatches_through_interface(c) for c in classes)
        return frozenset({RotarySite.kind, AttentionSite.kind}) if attention else frozenset({RotarySite.kind})

    def refusals(self, model_type: str) -> Refusals:
        """A rotary module that is not standard RoPE; softcapping (``FamilyAdapter.refusals``), an attention whose call
        takes what rope_ext's does not (sinks, a
        mask of its own), and a rotation that cannot move into attention (read off the attention classes: their pair
        layout, a transform after rotating)."""
        found = super().refusals(model_type)
        rotary = self.rotary_refused(model_type)
        if rotary is not None:  # (nothing of the family runs: every kind needs its rotary; M-RoPE: frequency kinds do)
            rotary_site = {} if rotary == MROPE_REFUSAL else {RotarySite.kind: rotary}
            return Refusals({**found.sites, **rotary_site, AttentionSite.kind: rotary})
        if AttentionSite.kind not in self.site_kinds:
            return found
        rotation = next(filter(None, map(rotation_refused, self.attention_classes)), None)
        program = next(filter(None, map(program_refused, self.attention_classes)), self._several_rotaries())
        sites = found.sites if program is None else {**found.sites, AttentionSite.kind: program}
        return Refusals(sites, rotation)

    def _several_rotaries(self) -> str | None:
        """Why no attention program runs where several classes of the modeling module each build a rotary module
        (BLT's patcher, local encoder, global transformer and local decoder): ``locate`` finds no one rotation."""
        modeling = importlib.import_module(self.module)
        builds = f"{self.class_name}("
        builders = sorted(name for name, c in inspect.getmembers(modeling, inspect.isclass)
                          if c.__module__ == modeling.__name__ and builds in (source_of(c.__init__) or ""))
        if len(builders) < 2:
            return None
        return (f"its model holds several rotary modules (one in each of {', '.join(builders)}), where rope_ext's "
                "attention rewrites take the one module the model shares; methods that rewrite attention are refused "
                "for it")

    def rotary_refused(self, model_type: str) -> str | None:
        """Why the family's rotary module is not standard RoPE, measured on one built from the model type's default
        config, as ``patch`` measures a model's (``RotarySite``'s convention check: its cos/sin against
        ``cat(freqs, freqs)``); ``None``: it is, or no module could be built from the default config (then ``patch``
        measures the model's own)."""
        from transformers.utils import logging

        from rope_ext.families.support import config_class_of

        config_class = config_class_of(model_type)
        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # (a default config's own warnings: token ids outside a vocabulary, ...)
        try:
            config = config_class().get_text_config()
            module = getattr(importlib.import_module(self.module), self.class_name)(config=config)
        except Exception:  # noqa: BLE001  (a rotary class built otherwise: the model's own is measured when patching)
            # (one whose default config gives it no rope parameters, Cohere Compass's: its M-RoPE read off its code)
            rotary_class = getattr(importlib.import_module(self.module), self.class_name)
            return MROPE_REFUSAL if "mrope_section" in (source_of(rotary_class.__init__) or "") else None
        finally:
            logging.set_verbosity(verbosity)
        site = RotarySite(self.name, module, "", module, self.default_layer_types, self.native_rope_types)
        try:
            for layer_type in site.layer_types(None):
                site.spec(layer_type, None, True)
        except ValueError as error:
            return next((why for words, why in NOT_STANDARD if words in str(error)), None)
        except Exception:  # noqa: BLE001
            return None
        return None

    def _is_rotary(self, module: nn.Module) -> bool:
        return derives_from(module, self.module, self.class_name)

    def rotary_sites(self, model: nn.Module) -> list[RotarySite]:
        return [
            RotarySite(self.name, parent, name, child, self.default_layer_types, self.native_rope_types)
            for parent, name, child in modules_outside_rope_ext(model)
            if self._is_rotary(child)
        ]

    def matches(self, model: nn.Module) -> bool:
        return any(self._is_rotary(child) for _, _, child in modules_outside_rope_ext(model))

    def locate(self, model: nn.Module) -> Sites:
        rotary = self.rotary_sites(model)
        config = getattr(model, "config", None) or rotary[0].config
        sites = {RotarySite.kind: rotary}
        if AttentionSite.kind in self.site_kinds and len(rotary) == 1:
            site = attention_site(self.name, model, rotary[0].config)
            if site is not None:
                sites[AttentionSite.kind] = [site]
        return Sites(config, sites, model)


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
    "hunyuan_v1_dense": ("hunyuan_v1_dense.modeling_hunyuan_v1_dense", "HunYuanDenseV1RotaryEmbedding"),
    "llama": ("llama.modeling_llama", "LlamaRotaryEmbedding"),
    "ministral": ("ministral.modeling_ministral", "MinistralRotaryEmbedding"),
    "mistral": ("mistral.modeling_mistral", "MistralRotaryEmbedding"),
    "mixtral": ("mixtral.modeling_mixtral", "MixtralRotaryEmbedding"),
    "nemotron": ("nemotron.modeling_nemotron", "NemotronRotaryEmbedding"),
    "olmo": ("olmo.modeling_olmo", "OlmoRotaryEmbedding"),
    "olmo2": ("olmo2.modeling_olmo2", "Olmo2RotaryEmbedding"),
    "olmo3": ("olmo3.modeling_olmo3", "Olmo3RotaryEmbedding", {"default_layer_types": ("full_attention",)}),
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

for _name, (_module, _class, *_fields) in ROTARY_FAMILIES.items():
    register_family(RotaryFamily(_name, _module, _class, **(dict(_fields[0]) if _fields else {})))
