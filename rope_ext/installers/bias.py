"""The hook kind ``bias``: an additive attention bias (ALiBi, KERPLE, Sandwich, FIRE) that *replaces* the model's
position encoding.

Every attention layer that has positions gets a ``PositionBias`` term in its program, run by the blockwise
kernel (``rope_ext.attention.rules``: the bias of one block of queries at a time, never ``[heads, n, n]``). The
position encoding it replaces contributes nothing: a RoPE family's rotary module returns the identity for every
layer type (queries and keys reach attention unrotated), a learned absolute table (GPT-2's ``wpe``) returns zeros.
Layers without positions (NoPE) are left as they are. A learnable bias keeps one module per layer in the patch's
parameter container (``model.rope_ext.<method>.layers.<i>``), so it trains, saves and reloads with the model.

A bias combines with what leaves positions to it (``logn``, ``s2_attn`` refuses it), not with a frequency
method, an attention rewrite or an absolute-table method: those are other position encodings.

On T5 (and mT5, UMT5: the bucket sites) a bias replaces the bucket table: each table module's ``compute_bias``
returns the method's bias as a function of the distance (``DistanceBias``, one per table: per stack in T5, per
layer in UMT5, as the tables are), which rope_ext's T5 attention adds block by block
(``rope_ext.attention.relative``); the encoder sees it on both sides (``|i - j|``). Only biases of the distance
alone fit (``BiasConfig.of_distance``): FIRE's depends on the query's position too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rope_ext.attention.program import Bias, MethodTerm
from rope_ext.installers.absolute import AbsoluteSite
from rope_ext.installers.attention import AttentionSite, program_setup
from rope_ext.installers.base import HookInstaller, PlanBuilder, register_hook
from rope_ext.installers.buckets import BucketSite, DistanceFunction, relative_programs
from rope_ext.installers.params import OwnedModule, own
from rope_ext.installers.rotary import RotarySite, nope_layer_types
from rope_ext.methods import (
    HOOK_ABSOLUTE,
    HOOK_BIAS,
    HOOK_BUCKET,
    HOOK_FREQUENCY,
    HOOK_PAIR_SCALE,
    HOOK_POSITION_RULE,
    BiasConfig,
    KeyOnlyBias,
    MethodConfig,
    get_method_class,
    methods_with_hooks,
)

#: why a bias does not combine with the hook kinds that bring a position encoding of their own
_ANOTHER_ENCODING = "{method} replaces the model's position encoding, and {other} is a position encoding itself"


class PerLayer(nn.Module):
    """One bias module per attention layer: ``forward(index, q_pos, k_pos)`` runs layer ``index``'s."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(modules)

    def forward(self, index: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return self.layers[index](q_pos, k_pos)


@dataclass(eq=False)
class PositionBias(Bias, MethodTerm):
    """A bias method in one layer: a fixed module held here, or a learnable one reached through the model."""

    method: BiasConfig
    fixed: nn.Module | None = None
    owned: OwnedModule | None = None
    index: int = 0
    _on_device: dict[Any, nn.Module] = field(default_factory=dict, repr=False)

    def _module(self, device: torch.device) -> nn.Module:
        module = self._on_device.get(device)
        if module is None:  # (fixed buffers follow the calls' device, not the model's .to())
            module = self._on_device[device] = self.fixed.to(device)
        return module

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        if self.owned is not None:
            return self.owned(self.index, q_pos, k_pos)
        return self._module(q_pos.device)(q_pos, k_pos)

    @property
    def has_key_bias(self) -> bool:  # type: ignore[override]
        return self.owned is None and isinstance(self.fixed, KeyOnlyBias)

    @property
    def of_distance(self) -> bool:
        """Whether the bias depends on the distance ``i - j`` alone (the same at positions moved together)."""
        return self.method.of_distance

    def key_bias(self, c: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return self._module(k_pos.device).key_bias(c, k_pos)

    def distance_form(self, device: torch.device) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
        form = None if self.owned is not None else getattr(self._module(device), "distance_form", None)
        if form is None:
            return None
        name, a, b = form()
        return name, *(None if t is None else t.detach().to(device=device, dtype=torch.float32) for t in (a, b))


class BiasInstaller(HookInstaller):
    """Additive biases: the model's own positions switched off, a ``PositionBias`` in every layer that had them."""

    kind = HOOK_BIAS
    site_kinds = frozenset({AttentionSite.kind})
    alternative_site_kinds = (frozenset({BucketSite.kind}),)
    conflicts = dict.fromkeys((HOOK_FREQUENCY, HOOK_POSITION_RULE, HOOK_ABSOLUTE, HOOK_PAIR_SCALE, HOOK_BUCKET), _ANOTHER_ENCODING)

    def fits(self, method_class: type, site_kinds: frozenset[str]) -> bool:
        return self.refusal(method_class, site_kinds) is None

    def refusal(self, method_class: type, site_kinds: frozenset[str]) -> str | None:
        if AttentionSite.kind in site_kinds or method_class.of_distance:  # (T5's: biases of the distance)
            return None
        return (
            "its attention adds one bias of the distance j - i to every query (computed from positions by the layer "
            f"that holds the table and passed down), and {method_class.method}'s depends on the query's position too"
        )

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, BiasConfig)
        buckets = builder.sites.get(BucketSite.kind)
        if buckets:
            _plan_distance_bias(builder, method, buckets)
            return
        if builder.options.get("layer_types") is not None:  # (nothing here would read it: refused, not ignored)
            raise ValueError(
                f"{method.method}: layer_types chooses the rotary layers a frequency method or an attention rewrite "
                "patches; a bias replaces the positions of every layer that has them (leave layer_types out)"
            )
        setup = program_setup(builder, method.method)
        _switch_off_positions(builder, method.method, setup.site.family)
        config = setup.programs[0][0].module.config
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int) or heads < 1:
            raise ValueError(f"{method.method}: {setup.site.family}: the model config gives no num_attention_heads")
        def head_dim(module: nn.Module) -> int | None:  # (each layer's own: Gemma 4's full layers have larger heads)
            size = getattr(module, "head_dim", None) or getattr(module, "head_size", None)
            return size or (config.hidden_size // heads if getattr(config, "hidden_size", None) else None)

        layers = [(layer, program) for layer, program in setup.programs if layer.rotary]
        if method.learnable:
            modules = [method.module(heads, i, head_dim(layer.module)) for i, (layer, _) in enumerate(layers)]
            owned = own(builder, method.method, PerLayer(modules))
            terms = [PositionBias(method, owned=owned, index=i) for i in range(len(layers))]
        else:  # (one fixed module per head size)
            sizes = [head_dim(layer.module) for layer, _ in layers]
            fixed = {size: method.module(heads, 0, size) for size in dict.fromkeys(sizes)}
            terms = [PositionBias(method, fixed=fixed[size]) for size in sizes]
        for (_, program), term in zip(layers, terms):
            program.add(term)


@dataclass(eq=False)
class DistanceBias(DistanceFunction):
    """A bias method in place of a T5 table module's buckets: the method's bias at the distance ``|rel|`` (the
    module's table unused), from a fixed module or the patch's own (``owned``, entry ``index``)."""

    method: BiasConfig
    fixed: nn.Module | None = None
    owned: OwnedModule | None = None
    index: int = 0

    def values(self, relative_position: torch.Tensor) -> torch.Tensor:
        """``rel [L]`` (long) -> ``[heads, L]``: the bias of a query at 0 over keys at ``rel``."""
        k_pos = relative_position.to(torch.float32)
        if self.owned is not None:  # (on the device of its parameters: a model split across devices calls from others)
            device = next(self.owned.module().layers[self.index].parameters(), k_pos).device
            k_pos = k_pos.to(device)
            values = self.owned(self.index, torch.zeros(1, device=device), k_pos)[:, 0]
            return values.to(relative_position.device)
        q_pos = torch.zeros(1, dtype=torch.float32, device=k_pos.device)
        return self.fixed(q_pos, k_pos)[:, 0]  # (the fixed modules move their buffers to the call's device)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.method.to_dict().items() if k != "method")
        return f"{self.method.method}({options}) bias of the distance, in place of the bucket table"


def _plan_distance_bias(builder: PlanBuilder, method: BiasConfig, sites: list[BucketSite]) -> None:
    """T5's families: the bias in place of each table module's buckets, every attention module on rope_ext's T5
    attention."""
    family = sites[0].family
    if not method.of_distance:
        fitting = [name for name in methods_with_hooks(HOOK_BIAS) if get_method_class(name).of_distance]
        raise ValueError(
            f"{method.method}: {family}'s attention adds one bias of the distance j - i to every query (computed from "
            f"positions by the layer that holds the table and passed down), and {method.method}'s depends on the "
            f"query's position too; bias methods for {family}: {', '.join(fitting)}"
        )
    modules = [module for site in sites for module in site.modules]
    heads, head_dim = modules[0].n_heads, modules[0].key_value_proj_dim
    if method.learnable:
        owned = own(builder, method.method, PerLayer([method.module(heads, i, head_dim) for i in range(len(modules))]))
        terms = [DistanceBias(module, method, owned=owned, index=i) for i, module in enumerate(modules)]
    else:
        fixed = method.module(heads, 0, head_dim)
        terms = [DistanceBias(module, method, fixed=fixed) for module in modules]
    for module, term in zip(modules, terms):
        builder.edit(module, "compute_bias", term)
    for site in sites:
        relative_programs(builder, site)


def _switch_off_positions(builder: PlanBuilder, method: str, family: str) -> None:
    """Make the model's own position encoding contribute nothing: the rotary returns the identity for every layer
    type, or the absolute table returns zeros."""
    rotary_sites = builder.sites.get(RotarySite.kind)
    absolute_sites = builder.sites.get(AbsoluteSite.kind)
    if not rotary_sites and not absolute_sites:
        raise ValueError(f"{method}: {family}: found no position encoding (rotary module or position table) to replace")
    for site in rotary_sites:
        rotary = site.replacement(builder)
        layer_types = [lt for lt in getattr(site.module, "layer_types", None) or [None]
                       if lt not in nope_layer_types(site.config)]  # (a NoPE layer type: no rotary)
        rotary.set_identity({layer_type: site.spec(layer_type, None, True) for layer_type in layer_types})
    for site in absolute_sites:
        site.replacement(builder).switch_off()


register_hook(BiasInstaller())
