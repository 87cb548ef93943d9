"""The hook kind ``frequency``: new rotary frequencies ``(inv_freq, attention_factor)`` from a frequency method.

The rotary replacement (``RopeExtRotaryEmbedding``, ``installers/rotary.py``) computes them: once for a static
method, on every call for a dynamic one. Where transformers has the same method natively, the config is edited
too, so ``save_pretrained`` reloads without rope_ext. A ``cache_consistent`` dynamic method also moves the rotation
into attention (keys rotated with the current length's frequencies): that trait is what it brings to the
combination rules (``traits``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn

from rope_ext.installers.attention import AttentionSite
from rope_ext.installers.base import HookInstaller, PlanBuilder, register_hook
from rope_ext.installers.combination import ROTATES_IN_ATTENTION
from rope_ext.installers.rotary import BASE_KEYS, RopeExtRotaryEmbedding, RotarySite
from rope_ext.installers.rotation import rotate_in_attention
from rope_ext.methods import HOOK_FREQUENCY, FrequencyConfig, MethodConfig, RotarySpec

#: keys of a checkpoint's rope parameters kept beside a method's own (a method's own value wins): the base rotation,
#: and, where the attention reads them beside the rotary (Ministral 3's attention temperature), ``llama_4_scaling_beta``
#: and the original context it is taken over
TEMPERATURE_KEYS = ("llama_4_scaling_beta", "original_max_position_embeddings")
#: keys of a multimodal rotary's sections (M-RoPE: Qwen3.5's), kept beside a method's own where present
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _native(method: FrequencyConfig, spec, max_position_embeddings: int) -> dict | None:
    """transformers' own rope parameters for ``method`` on ``spec`` (``None``: it has none). On proportional RoPE
    (``spec.rotated``) only ``linear``'s division has one, transformers' ``proportional`` with that factor."""
    native = method.native_rope_parameters(spec, max_position_embeddings)
    if spec.rotated is None or native is None:
        return native
    return {"rope_type": "proportional", "factor": native["factor"]} if native["rope_type"] == "linear" else None


def _config_takes(config: Any, rope_parameters: Any, max_position_embeddings: int | None) -> bool:
    """Whether ``config``'s class accepts these rope parameters (Phi-MoE's validates LongRoPE's fields whatever the
    rope type) beside the new ``max_position_embeddings``: tried on a copy."""
    trial = copy.deepcopy(config)
    try:
        if max_position_embeddings is not None:
            trial.max_position_embeddings = max_position_embeddings
        trial.rope_parameters = rope_parameters
        validate = getattr(trial, "validate_rope", None)
        if callable(validate):
            validate()
    except Exception:  # noqa: BLE001  (a config class's own validation errors: huggingface_hub's strict dataclasses)
        return False
    return True


class FrequencyInstaller(HookInstaller):
    """Frequency methods: new ``(inv_freq, attention_factor)`` in the rotary replacement, plus the config values
    that let ``save_pretrained`` reload without rope_ext where transformers has the same method natively."""

    kind = HOOK_FREQUENCY
    site_kinds = frozenset({RotarySite.kind})

    def traits(self, method: MethodConfig) -> frozenset[str]:
        moves = getattr(method, "cache_consistent", False)  # (keys rotated in attention, with the current length's)
        return super().traits(method) | ({ROTATES_IN_ATTENTION} if moves else set())

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, FrequencyConfig)
        replace = builder.option("replace_scaling")
        for site in builder.sites.get(RotarySite.kind):
            chosen = site.layer_types(builder.option("layer_types"))
            specs = {lt: site.spec(lt, method, replace) for lt in chosen}
            site.replacement(builder).set_frequency(method, specs)
            # transformers' own version of the method per layer type (None: it has none)
            # (a config without max_position_embeddings, Recurrent Gemma's: the method's stated L is its own)
            stated = getattr(site.config, "max_position_embeddings", None)
            native = {lt: _native(method, spec, stated or spec.original_max_position_embeddings)
                      for lt, spec in specs.items()}
            self._softmax_scale_edits(builder, site, native)
            self._config_edits(builder, site, method, specs, native)
            # (dynamic methods follow any length: no range to warn about, and transformers' reminder at L is wrong)
            limit = None
            if not method.dynamic:
                limit = max(round(method.factor * spec.original_max_position_embeddings) for spec in specs.values())
            builder.memo.setdefault("ranges", {})[self.kind] = (method.method, limit)
        if getattr(method, "cache_consistent", False):  # keys rotated in attention, with the current length's
            rotate_in_attention(builder, method.method)

    def in_use(self, model: nn.Module, method: MethodConfig) -> MethodConfig:
        assert isinstance(method, FrequencyConfig)
        if method.original_max_position_embeddings is not None or (
            "original_max_position_embeddings" in method.unused_shared_options
        ):
            return method
        originals = {
            spec.original_max_position_embeddings
            for module in model.modules()
            if isinstance(module, RopeExtRotaryEmbedding) and module.method is method
            for spec in module.specs.values()
        }
        if len(originals) != 1:  # layer types with different L (Gemma 3's): no one value to state
            return method
        return dataclasses.replace(method, original_max_position_embeddings=originals.pop())

    def _softmax_scale_edits(
        self, builder: PlanBuilder, site: RotarySite, native: dict[str | None, dict | None]
    ) -> None:
        """Where the modeling code derives each layer's softmax scale from the rope parameters (``AttentionSite.
        softmax_scale``: DeepSeek's ``yarn_apply_mscale``), the scale the method's own parameters give, as
        transformers would compute it for a checkpoint that states them (the checkpoint's own rule undone first)."""
        for attention in builder.sites.get(AttentionSite.kind) or []:
            rule = attention.softmax_scale
            if rule is None:
                continue
            for layer in attention.layers:
                # (one rotation for every layer where the rope parameters are not per layer type: DeepSeek-V3.2's
                # layers are typed by their indexer, not by their rotation)
                key = layer.layer_type if layer.layer_type in native else None
                if key not in native or not isinstance(getattr(layer.module, "scaling", None), float):
                    continue
                new = native[key] or {}
                before, after = rule(site.params(key), 1.0), rule({"rope_type": "default", **new}, 1.0)
                if after != before:
                    builder.edit(layer.module, "scaling", layer.module.scaling / before * after)

    def _config_edits(
        self, builder: PlanBuilder, site: RotarySite, method: FrequencyConfig, specs: dict[str | None, RotarySpec],
        native: dict[str | None, dict | None],
    ) -> None:
        config = site.config
        if any(params is None or not site.accepts(params["rope_type"]) for params in native.values()):
            # No native equivalent: the rope_ext block alone records the patch, and the config keeps claiming only
            # what plain transformers gives when it loads it (the unpatched rotation and its length).
            return
        # What plain transformers can honour (without rope_ext, a combination reloads as its frequency method alone):
        # transformers' own version of the method, and the extended context (HF's convention for scaled checkpoints:
        # max_position_embeddings is the new length, rope_parameters keep the original). Dynamic methods have no
        # fixed length, and transformers' native "dynamic" reads L from max_position_embeddings, so it stays.
        longer = None
        if not method.dynamic:
            extended = max(round(method.factor * spec.original_max_position_embeddings) for spec in specs.values())
            longer = extended if extended > (getattr(config, "max_position_embeddings", None) or 0) else None
        rope_parameters = copy.deepcopy(builder.pending(config, "rope_parameters"))
        for layer_type, params in native.items():
            current = site.params(layer_type)
            moved = params.get("original_max_position_embeddings") not in (None, current.get(TEMPERATURE_KEYS[1]))
            if TEMPERATURE_KEYS[0] in current and moved:  # (Ministral 3's temperature counts the same L: kept apart)
                return
            kept = (*BASE_KEYS, *MROPE_KEYS, *(TEMPERATURE_KEYS if TEMPERATURE_KEYS[0] in current else ()))
            merged = {key: current[key] for key in kept if key in current} | params
            if layer_type is None:
                rope_parameters = merged
            else:
                rope_parameters[layer_type] = merged
        if not _config_takes(config, rope_parameters, longer):  # (a config class that validates its rope fields)
            return
        if longer is not None:  # (before the rope parameters: transformers checks L against it)
            builder.edit_config(config, "max_position_embeddings", longer)
        builder.edit_config(config, "rope_parameters", rope_parameters)
        originals = {p.get("original_max_position_embeddings") for p in native.values()} - {None}
        if originals and hasattr(config, "original_max_position_embeddings"):
            # Phi-3 keeps L at the top level and transformers gives that copy priority.
            builder.edit_config(config, "original_max_position_embeddings", originals.pop())


register_hook(FrequencyInstaller())
