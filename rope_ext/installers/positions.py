"""The hook kinds that rewrite attention on positions: ``attention`` (position rules: ReRoPE, Leaky ReRoPE,
Self-Extend, STRING, Dual Chunk Attention) and ``query_scale`` (log-n).

A position rule needs queries and keys unrotated: ``rotate_in_attention`` moves the rotation of the chosen layer
types from the rotary module into the attention programs, with the frequencies the rotary replacement gives (a
frequency method's, or the checkpoint's own); this installer then sets each full-attention layer's rule,
resolved against its ``L`` (the rotation's, unless the method states its own), plus DCA's query scaling as a query
scale. log-n is a query scale alone: it needs no rotation of its own and runs on whatever reaches attention.
"""

from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from rope_ext.attention.program import PositionRule, QueryScale
from rope_ext.installers.attention import AttentionSite, installed_programs, program_setup
from rope_ext.installers.base import HookInstaller, PlanBuilder, register_hook
from rope_ext.installers.frequency import TEMPERATURE_KEYS
from rope_ext.installers.rotary import RotarySite
from rope_ext.installers.rotation import check_chosen_layers, no_layer_to_rewrite, rotate_in_attention
from rope_ext.methods import (
    HOOK_FREQUENCY,
    HOOK_POSITION_RULE,
    HOOK_QUERY_SCALE,
    LogNConfig,
    MethodConfig,
    PositionRuleConfig,
    TemperatureConfig,
)
from rope_ext.methods.base import check_length_within


class PositionRuleInstaller(HookInstaller):
    """Attention-rewrite methods: a remapped relative position in every full-attention layer."""

    kind = HOOK_POSITION_RULE
    site_kinds = frozenset({RotarySite.kind, "attention"})
    rotates_in_attention = True

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, PositionRuleConfig)
        rotation = rotate_in_attention(builder, method.method)
        limits = set()
        frequency = rotation.rotary.method
        static = frequency is not None and not frequency.dynamic
        for _layer, program, term in rotation.full:
            within = term.original
            if static:  # distances the extended rotation handles
                spec = rotation.rotary.specs[term.layer_type]
                within = round(frequency.factor * spec.original_max_position_embeddings)
            # a stated L may reach what the rotation handles: DCA with 16k chunks on yarn:factor=2 of an 8k model
            check_length_within(method.method, method.original_max_position_embeddings,
                                within if static else term.native, frequency if static else None)
            term.config = method.resolved(term.original)
            if getattr(term.config, "scale_queries", False):  # (DCA's)
                program.add(QueryScale(term.config, term.config.original))
            limits.add(term.config.intended_length(within))
        limit = None if None in limits else min(limits)
        builder.memo.setdefault("ranges", {})[self.kind] = (method.method, limit)

    def in_use(self, model: nn.Module, method: MethodConfig) -> MethodConfig:
        used = {term.config for _, program in installed_programs(model) for term in program.of_type(PositionRule)
                if type(term.config) is type(method)}
        return used.pop() if len(used) == 1 else method  # (layers resolved differently: no one value to state)


class QueryScaleInstaller(HookInstaller):
    """Query scaling (log-n): a per-position multiplier on the queries of every full-attention layer that has
    positions, with ``L`` the rotation's (a frequency method's stated one, else the checkpoint's window) unless
    the method states its own."""

    kind = HOOK_QUERY_SCALE
    site_kinds = frozenset({RotarySite.kind, "attention"})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, (LogNConfig, TemperatureConfig))
        if isinstance(method, TemperatureConfig) and _native_temperature(builder, method):
            return
        setup = program_setup(builder, method.method)
        rotary_site = builder.sites.get(RotarySite.kind)[0]
        if builder.option("layer_types") is not None and method.layers != "rope":  # (refused, not ignored)
            raise ValueError(f"{method.method}: layer_types chooses the rotary layers of layers=rope; layers="
                             f"{method.layers} takes its layers itself: leave layer_types out, or give layers=rope")
        chosen = rotary_site.layer_types(builder.option("layer_types"))
        layers = [layer for layer, _ in setup.programs]
        if method.layers == "rope":
            check_chosen_layers(setup.site.family, layers, chosen)
        rotary = rotary_site.replacement(builder) if HOOK_FREQUENCY in builder.kinds else None
        scaled = 0
        for layer, program in setup.programs:
            if layer.sliding_window is not None:  # (full-attention layers only: a sliding cache drops its keys)
                continue
            if method.layers == "rope" and not layer.rotary:
                continue
            if method.layers == "nope" and layer.rotary:
                continue
            if method.layers == "rope" and layer.layer_type not in chosen and None not in chosen:
                continue
            key = layer.layer_type if layer.layer_type in chosen else None
            rule = program.position_rule
            if rule is not None:
                original, native = rule.original, rule.native
            elif rotary is not None and key in rotary.specs:
                original, native = rotary.specs[key].original_max_position_embeddings, rotary_site.native_length(key)
            else:  # (the temperature's steps count the pre-training context, not a scaled checkpoint's window)
                native = rotary_site.native_length(key)
                original = rotary_site.original_length(key) if isinstance(method, TemperatureConfig) else native
            stated = getattr(method, "original_max_position_embeddings", None)
            check_length_within(method.method, stated, native)
            program.add(QueryScale(method, stated or original))
            scaled += 1
        if not scaled and method.layers == "nope":
            raise ValueError(f"{method.method}: {setup.site.family}: every attention layer of this model has positions "
                             "(no NoPE layer to take layers=nope); give layers=all or layers=rope")
        if not scaled:
            raise ValueError(no_layer_to_rewrite(setup.site.family, layers))

    def in_use(self, model: nn.Module, method: MethodConfig) -> MethodConfig:
        if isinstance(method, TemperatureConfig):  # (its F as installed: floor_scale, else each layer's L)
            floors = {term.original for _, program in installed_programs(model) for term in program.of_type(QueryScale)
                      if term.method is method}
            params = getattr(model.config.get_text_config(), "rope_parameters", None) or {}
            if not floors and TEMPERATURE_KEYS[0] in params:  # (written natively: the rope parameters' L)
                floors = {params.get("original_max_position_embeddings")} - {None}
            return method if method.floor_scale is not None or len(floors) != 1 else dataclasses.replace(
                method, floor_scale=floors.pop())
        assert isinstance(method, LogNConfig)
        originals = {term.original for _, program in installed_programs(model) for term in program.of_type(QueryScale)
                     if term.method is method}
        if method.original_max_position_embeddings is not None or len(originals) != 1:
            return method
        return dataclasses.replace(method, original_max_position_embeddings=originals.pop())


def _native_temperature(builder: PlanBuilder, method: TemperatureConfig) -> bool:
    """Write the temperature where the model's own attention reads it, and install nothing else (``True``): Ministral 3
    and Mistral 4 scale queries by ``1 + beta ln(1 + floor(i / L))`` with ``llama_4_scaling_beta`` and the ``L`` of
    their rope parameters, on every layer. That is ``temperature`` with position_offset=0, layers=all and
    ``floor_scale`` that ``L``, where no layer has a sliding window and no frequency method changes the rope parameters
    in the same patch; a checkpoint's own nonzero beta is replaced only with ``replace_scaling`` (else the method
    multiplies it, as a query scale in rope_ext's attention)."""
    config = builder.sites.get(RotarySite.kind)[0].config
    params = builder.pending(config, "rope_parameters")
    if not isinstance(params, dict) or TEMPERATURE_KEYS[0] not in params:
        return False
    if HOOK_FREQUENCY in builder.kinds:  # (its replace_scaling is the frequency method's)
        if builder.option("replace_scaling") and params[TEMPERATURE_KEYS[0]]:
            warnings.warn(f"rope_ext: replace_scaling replaces the checkpoint's RoPE scaling with the frequency "
                          f"method; the model's own temperature (llama_4_scaling_beta={params[TEMPERATURE_KEYS[0]]}) "
                          "stays, and temperature multiplies it", UserWarning, stacklevel=4)
        return False
    floor = params.get("original_max_position_embeddings")
    layers = [layer for site in builder.sites.get(AttentionSite.kind) for layer in site.layers]
    native = (method.position_offset, method.layers) == (0, "all") and (method.floor_scale or floor) == floor
    native = native and not any(layer.sliding_window is not None for layer in layers)
    replace = builder.option("replace_scaling")
    if replace and not native:
        raise ValueError(
            "temperature: replace_scaling replaces this model's own llama_4_scaling_beta only with its form, "
            f"temperature:position_offset=0 (layers=all, floor_scale {floor}, no sliding-window layer); leave "
            "replace_scaling out to multiply the model's own temperature instead")
    if not native or (params[TEMPERATURE_KEYS[0]] and not replace):
        return False
    builder.edit_config(config, "rope_parameters", {**params, TEMPERATURE_KEYS[0]: method.attn_scale})
    return True


register_hook(PositionRuleInstaller())
register_hook(QueryScaleInstaller())
