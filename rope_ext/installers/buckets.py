"""The bucket sites (T5's relative-position bias tables, DeBERTa's relative positions) and the hook kinds
``bucket`` and ``log_bucket``.

T5 keeps one bias table per stack, in the first self-attention layer of the encoder and of the decoder
(``relative_attention_bias``, ``num_buckets x heads``); that layer's ``compute_bias(query_length, key_length,
device, past_seen_tokens)`` makes the ``[1, heads, q, k]`` bias every layer of the stack adds (transformers passes
it down). The installer sets ``compute_bias`` on each of those modules to a ``BucketBias``: the same values
with the method's buckets (``rope_ext.methods.buckets``), reading the module's own table, or the grown table the
patch owns (``model.rope_ext.<method>.tables.<i>``, which trains, saves and reloads with the model). The tables'
parameters keep their keys and shapes.

The bias is not written out: ``compute_bias`` returns a ``RelativeBias`` (the values as a function of the
distance) and every attention module of the model runs rope_ext's attention program with a ``RelativeAttention``
term (``rope_ext.attention.relative``), which adds it block by block; in inference on the CPU the memory a call
holds grows linearly with the length, where transformers' ``(batch, heads, q, k)`` mask grows with its square. The cross-attention has
no positions: it runs plain attention, and T5's zeros (``[1, heads, q, k]``, made by its first cross-attention
layer and passed down) are not made (a forward pre-hook passes a ``NO_POSITIONS`` marker where the module would
make them; UMT5's cross-attention makes its zeros itself, and they are not read).

DeBERTa-v2/v3 computes its relative positions once per forward in the encoder (``get_rel_pos(hidden_states,
query_states=None, relative_pos=None) -> [1, q, k]``, already bucketed) and every layer's disentangled attention
reads them, content-to-position and position-to-content. The ``log_bucket`` installer sets ``get_rel_pos`` on the
encoder to a ``RelativePositions``: the same positions through the method. Positions a caller passes in
(``relative_pos``) are used as given, as transformers does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from rope_ext.attention.relative import NO_POSITIONS, RelativeAttention, RelativeBias
from rope_ext.installers.attention import AttentionLayer, AttentionSite
from rope_ext.installers.base import HookInstaller, PlanBuilder, RopeExtCallable, Site, register_hook
from rope_ext.installers.params import OwnedModule, own
from rope_ext.methods import HOOK_BUCKET, HOOK_LOG_BUCKET, BucketConfig, LogBucketConfig, MethodConfig


@dataclass(eq=False)
class BucketSite(Site):
    """The attention modules that hold a bucket table (``relative_attention_bias``), each with ``is_decoder``,
    ``relative_attention_num_buckets`` and ``relative_attention_max_distance`` as T5's have them; ``owner``, the
    model, and ``attention``, every attention module of it (self-attention and cross-attention, each with
    ``is_causal`` as T5's have it) with whether it is a cross-attention."""

    kind: ClassVar[str] = "bucket"

    family: str
    modules: list[nn.Module]
    owner: nn.Module | None = None
    attention: list[tuple[nn.Module, bool]] = field(default_factory=list)


class BucketTables(nn.Module):
    """The grown tables of a patch, one per bucket module: ``forward(index, buckets)`` reads table ``index``."""

    def __init__(self, tables: list[torch.Tensor]) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding.from_pretrained(t, freeze=False) for t in tables)

    def forward(self, index: int, buckets: torch.Tensor) -> torch.Tensor:
        return self.tables[index](buckets)


def bucketing(module: nn.Module) -> tuple[bool, int, int]:
    """A table module's ``(bidirectional, num_buckets, max_distance)``, as a bucket method takes them."""
    return not module.is_decoder, module.relative_attention_num_buckets, module.relative_attention_max_distance


@dataclass(eq=False)
class DistanceFunction(RopeExtCallable):
    """``compute_bias`` of a T5 table module under a method: ``(query_length, key_length, device=None,
    past_seen_tokens=0) -> RelativeBias``, the bias of queries ``past..past+q-1`` over keys ``0..k-1`` as the
    function of the distance ``values(rel) -> [heads, L]`` (``.dense()``: the ``[1, heads, q, k]`` tensor
    transformers' ``compute_bias`` makes)."""

    module: nn.Module

    def values(self, relative_position: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(
        self, query_length: int, key_length: int, device: Any = None, past_seen_tokens: Any = 0
    ) -> RelativeBias:
        if device is None:
            device = self.module.relative_attention_bias.weight.device
        return RelativeBias(self.values, int(query_length), int(key_length), int(past_seen_tokens), device)


@dataclass(eq=False)
class BucketBias(DistanceFunction):
    """A bucket method's bias: the table (the module's own, or the patch's grown one) at the method's buckets."""

    method: BucketConfig
    owned: OwnedModule | None = None
    index: int = 0

    def values(self, relative_position: torch.Tensor) -> torch.Tensor:
        """``rel [L]`` (key minus query position, long) -> ``[heads, L]``, on ``rel``'s device (the layer calling
        it; the table stays on its own, the first layer's when a model is split across devices)."""
        if self.owned is None:
            table = self.module.relative_attention_bias
        else:
            table = self.owned.module().tables[self.index]
        buckets = self.method.bucket(relative_position.to(table.weight.device), *bucketing(self.module))
        values = table(buckets) if self.owned is None else self.owned(self.index, buckets)
        return values.transpose(0, 1).to(relative_position.device)

    def __repr__(self) -> str:
        rows = self.method.per_direction(*bucketing(self.module))
        table = "its own table" if self.owned is None else f"a grown table of {rows} buckets per direction"
        return f"{self.method.method}(factor={self.method.factor:g}) buckets, {table}"


def _no_positions(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """Forward pre-hook of a cross-attention whose forward takes ``position_bias``: the ``NO_POSITIONS`` marker
    where it would make zeros."""
    if kwargs.get("position_bias") is None and len(args) < 4:
        return args, {**kwargs, "position_bias": NO_POSITIONS}
    return None


class BucketInstaller(HookInstaller):
    """Bucket methods: every table module's ``compute_bias`` replaced; a method that grows the table gets its own
    copies, grown, in the patch's parameter container."""

    kind = HOOK_BUCKET
    site_kinds = frozenset({BucketSite.kind})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, BucketConfig)
        modules = [module for site in builder.sites.get(BucketSite.kind) for module in site.modules]
        owned = None
        if method.grows_table:
            tables = [method.table(m.relative_attention_bias.weight, *bucketing(m)) for m in modules]
            owned = own(builder, method.method, BucketTables(tables))
        for index, module in enumerate(modules):
            builder.edit(module, "compute_bias", BucketBias(module, method, owned, index))
        for site in builder.sites.get(BucketSite.kind):
            relative_programs(builder, site)


def _kind(module: nn.Module, cross: bool) -> str:
    return "cross-attention" if cross else ("decoder" if module.is_decoder else "encoder") + " self-attention"


def relative_programs(builder: PlanBuilder, site: BucketSite) -> None:
    """Every attention module of the site's model on rope_ext's attention, with a ``RelativeAttention`` term."""
    layers = [AttentionLayer(module, _kind(module, cross), rotary=False) for module, cross in site.attention]
    attention = AttentionSite(site.family, layers, site.owner, rotation_refused=f"{site.family} has no rotary positions")
    setup = attention.replacement(builder)
    for (module, cross), (_, program) in zip(site.attention, setup.programs):
        program.add(RelativeAttention(causal=bool(getattr(module, "is_causal", False)) and not cross,
                                      positions=not cross))
        if cross and "position_bias" in inspect.signature(type(module).forward).parameters:
            builder.hook_forward(module, _no_positions)


register_hook(BucketInstaller())


@dataclass(eq=False)
class LogBucketSite(Site):
    """An encoder that computes DeBERTa's relative positions (``get_rel_pos``, with ``position_buckets`` and
    ``max_relative_positions`` as DeBERTa-v2's encoder has them)."""

    kind: ClassVar[str] = "log_bucket"

    family: str
    encoder: nn.Module


@dataclass(eq=False)
class RelativePositions(RopeExtCallable):
    """``get_rel_pos`` of a DeBERTa encoder under a method: ``[1, q, k]`` long, ``i - j`` remapped and bucketed."""

    encoder: nn.Module
    method: LogBucketConfig

    def __call__(self, hidden_states: torch.Tensor, query_states: torch.Tensor | None = None,
                 relative_pos: torch.Tensor | None = None) -> torch.Tensor | None:
        encoder = self.encoder
        if not encoder.relative_attention or relative_pos is not None:
            return relative_pos
        queries = (query_states if query_states is not None else hidden_states).size(-2)
        keys = hidden_states.size(-2)
        device = hidden_states.device
        rel = torch.arange(queries, dtype=torch.long, device=device)[:, None] - torch.arange(keys, device=device)[None]
        return self.method.positions(rel, encoder.position_buckets, encoder.max_relative_positions)[None]

    def __repr__(self) -> str:
        return f"{self.method.method}(factor={self.method.factor:g}) relative positions"


class LogBucketInstaller(HookInstaller):
    """DeBERTa's relative positions through the method: the encoder's ``get_rel_pos`` replaced."""

    kind = HOOK_LOG_BUCKET
    site_kinds = frozenset({LogBucketSite.kind})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, LogBucketConfig)
        for site in builder.sites.get(LogBucketSite.kind):
            encoder = site.encoder
            if method.needs_buckets and not encoder.position_buckets > 0:
                raise ValueError(
                    f"{method.method}: this {site.family} model has no log buckets (position_buckets="
                    f"{encoder.position_buckets}): its relative positions are distances clamped at "
                    f"{encoder.max_relative_positions}; use deberta_bucket_scale"
                )
            builder.edit(encoder, "get_rel_pos", RelativePositions(encoder, method))


register_hook(LogBucketInstaller())
