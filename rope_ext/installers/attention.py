"""The attention site: a model's attention modules, each given an ``AttentionProgram`` that hook kinds fill.

How it is wired into transformers, without copying a forward function:

* one attention function, registered process-wide as ``"rope_ext"`` with ``AttentionInterface`` *and*
  ``AttentionMaskInterface`` (with transformers' ``flash_attention_mask``, so it receives the 2D padding mask;
  a key without a mask function gets ``attention_mask=None`` and padding would be dropped; and that mask
  function never reads jumps in ``position_ids`` as packed sequences);
* each patched attention module holds its ``AttentionProgram`` (a plain attribute, so state dicts are
  unchanged); the registered function reads it from ``module`` at call time, so models patched differently in
  one process do not interfere;
* the model's attention implementation is set to ``"rope_ext"`` once per patch, through transformers'
  ``set_attn_implementation`` (``PlanBuilder.set_attn_implementation``: one owner), and put back by
  ``unpatch``; a forward pre-hook refuses a model whose implementation was changed since (it would run
  without the patch's terms, on queries and keys the patch left unrotated).

The site itself is attention modules only (``AttentionLayer``: module, layer type, window, whether positions
reach it): a family's locator fills in what is particular to it. Kinds that need rotary frequencies (position
rules) also use the rotary site; this module does not.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.utils import logging

from rope_ext.attention import rules  # noqa: F401  (registers the kernels; hooks.buckets imports the T5 one)
from rope_ext.attention.key_cache import CacheLink
from rope_ext.attention.memory import release_freed_memory
from rope_ext.attention.program import AttentionProgram, Bias, Call
from rope_ext.installers.base import PlanBuilder, Site

logger = logging.get_logger(__name__)

#: the key under which the attention function and its mask function are registered
ATTENTION_KEY = "rope_ext"
#: the attribute of a patched attention module that holds its ``AttentionProgram``
PROGRAM_ATTR = "_rope_ext_program"


@dataclass(eq=False)
class AttentionLayer:
    """One attention module as its family's locator describes it."""

    module: nn.Module
    layer_type: str | None = None
    #: the window its attention is limited to (``None``: full attention)
    sliding_window: int | None = None
    #: whether its forward applies rotary positions (``False``: a NoPE layer)
    rotary: bool = True


@dataclass(eq=False)
class AttentionSite(Site):
    """A model's attention modules (``layers``), the transformers model whose attention implementation they
    follow (``owner``), and what the family says of them: ``refused`` (a reason no attention program can run
    there, e.g. logit softcapping) and ``rotation_refused`` (a reason position rules cannot run there)."""

    kind: ClassVar[str] = "attention"

    family: str
    layers: list[AttentionLayer]
    owner: nn.Module
    refused: str | None = None
    #: why queries and keys cannot be rotated at attention time instead of by the module (``None``: they can)
    rotation_refused: str | None = None
    #: the modeling code's rule for a layer's softmax scale from the rope parameters, ``rule(rope_parameters,
    #: scaling) -> scaling`` (DeepSeek's ``yarn_apply_mscale``: YaRN's ``mscale_all_dim`` squared), ``None``: none
    softmax_scale: Callable[[dict, float], float] | None = None

    def replacement(self, builder: PlanBuilder) -> ProgramSetup:
        return builder.replacement(self, lambda: (None, None, ProgramSetup.build(self, builder)))


@dataclass(eq=False)
class ProgramSetup:
    """The programs of one plan, one per attention module (built once; each hook kind adds its terms)."""

    site: AttentionSite
    programs: list[tuple[AttentionLayer, AttentionProgram]] = field(default_factory=list)

    @classmethod
    def build(cls, site: AttentionSite, builder: PlanBuilder) -> ProgramSetup:
        if site.refused is not None:
            raise ValueError(f"{site.family}: {site.refused}")
        generation = getattr(builder.sites.model, "generation_config", None)
        cache = getattr(generation, "cache_implementation", None)
        if cache in ALL_STATIC_CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"{site.family}: this model's generation_config asks for a {cache!r} cache, a static (preallocated) "
                "cache that rope_ext attention does not support; set model.generation_config.cache_implementation = "
                "None (the default dynamic cache) before patching"
            )
        setup = cls(site)
        configs: dict[int, Any] = {}
        patch_id = uuid.uuid4().hex
        for layer in site.layers:
            program = AttentionProgram(layer.layer_type, layer.sliding_window, patch_id=patch_id)
            builder.edit(layer.module, PROGRAM_ATTR, program)
            builder.edit(layer.module, "extra_repr", functools.partial(_program_repr, program))
            builder.hook_forward(layer.module, _before_forward)
            setup.programs.append((layer, program))
            configs[id(layer.module.config)] = layer.module.config
        builder.set_attn_implementation(site.owner, ATTENTION_KEY, list(configs.values()))
        return setup


def attention_site(builder: PlanBuilder, method_name: str) -> AttentionSite:
    sites = builder.sites.get(AttentionSite.kind)
    if not sites:
        raise ValueError(
            f"{method_name}: this model's attention does not run the function transformers' AttentionInterface holds "
            "(it picks its implementation itself), so rope_ext cannot rewrite it; methods that only change the rotary "
            "frequencies work (without cache_consistent)"
        )
    if len(sites) != 1:
        raise ValueError(f"{method_name}: this model has {len(sites)} attention sites; rope_ext handles one")
    return sites[0]


def program_setup(builder: PlanBuilder, method_name: str) -> ProgramSetup:
    """The plan's programs (made on first use)."""
    return attention_site(builder, method_name).replacement(builder)


def installed_programs(model: nn.Module) -> Iterator[tuple[nn.Module, AttentionProgram]]:
    """``(attention module, program)`` for every patched attention module of ``model``."""
    for module in model.modules():
        program = module.__dict__.get(PROGRAM_ATTR)
        if isinstance(program, AttentionProgram):
            yield module, program


def _program_repr(program: AttentionProgram) -> str:
    return f"rope_ext: {program.describe()}"


# --- the registered function -------------------------------------------------------------------------


def rope_ext_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"rope_ext"``: runs the module's ``AttentionProgram``."""
    if kwargs.get("output_attentions"):
        logger.warning_once(
            "rope_ext attention does not return attention weights (output_attentions=True gives none); unpatch, or "
            "patch a model loaded with attn_implementation='eager' and read the weights before patching"
        )
    program = module.__dict__.get(PROGRAM_ATTR)
    if program is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation='rope_ext' but was not patched by rope_ext; use "
            "rope_ext.patch(model, ...) (or rope_ext.from_pretrained) rather than setting the implementation by hand"
        )
    link, program.pending = program.pending, None  # (taken first: a refused call keeps no reference to the cache)
    dropped = dropped_keys(link, key.shape[2])
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"rope_ext attention takes a 2D padding mask (batch, keys); got a {attention_mask.dim()}D mask. "
            "Pass attention_mask as transformers' tokenizers make it"
        )
    sliding_window = kwargs.get("sliding_window") or None
    rule = program.position_rule
    if sliding_window is not None and rule is not None and rule.config is not None:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: a sliding-window layer cannot take {rule.name}")
    n, m = query.shape[2], key.shape[2]
    # a sliding layer's plain attention depends on distances alone and a sliding cache keeps just its last keys:
    # its keys count from the first it kept
    relative = sliding_window is not None and all(t is rule for t in program.terms)
    if (relative or dropped) and attention_mask is not None and attention_mask.shape[-1] > m:
        attention_mask = attention_mask[:, -m:]
    if attention_mask is not None and attention_mask.shape[-1] != m:
        raise ValueError(
            f"rope_ext attention got {m} cached keys but a padding mask over {attention_mask.shape[-1]}: a static "
            "(preallocated) cache is not supported; use the default dynamic cache"
        )
    if link is not None and (key is not link.layer.keys or n == m):
        link = None  # not the cache's own tensor, or no cached prefix yet (a one-shot forward keeps nothing)
    if link is not None and torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
        link = None  # autograd keeps the rotated keys it multiplied; a kept copy is later extended in place
    rows = None if attention_mask is None else attention_mask.to(torch.bool)
    if rows is not None and rule is not None and n < m and not bool(rows[:, -1].all()):
        raise ValueError(
            "rope_ext attention got a padding mask whose last key is masked: a static (preallocated) cache is "
            "not supported; use the default dynamic cache"
        )
    if rows is not None and bool(rows.all()):
        rows = None
    positions = None if relative or not program.terms else kwargs.get("position_ids")
    call = Call(
        program, query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5, rows, positions,
        float(dropout or 0.0), sliding_window, link, module, kwargs.get("position_bias"),
    )
    out = (run_over_kept_keys(call, dropped) if dropped and not relative else program.run(call)).transpose(1, 2)
    out = out.contiguous()
    release_freed_memory(n, m, query.device.type)
    return out, None


AttentionInterface.register(ATTENTION_KEY, rope_ext_attention)
AttentionMaskInterface.register(ATTENTION_KEY, flash_attention_mask)


def _before_forward(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a patched attention module: refuses an implementation changed since patching and a
    static cache, and notes the module's cache layer before this forward appends to it (for kept rotated keys)."""
    program = module.__dict__.get(PROGRAM_ATTR)
    if program is None:
        return
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation != ATTENTION_KEY:
        raise RuntimeError(
            f"this model is patched by rope_ext ({program.describe()}), but its attention implementation was changed "
            f"to {implementation!r} afterwards, which runs without the patch (queries and keys reach attention as "
            f"the patch left them). Call model.set_attn_implementation({ATTENTION_KEY!r}), or rope_ext.unpatch(model) "
            "and set the implementation on the unpatched model"
        )
    program.pending = None
    cache = kwargs.get("past_key_values", kwargs.get("layer_past"))
    layers = getattr(cache, "layers", None) if isinstance(cache, Cache) else None
    index = getattr(module, "layer_idx", None)
    if layers is None or not isinstance(index, int) or index >= len(layers):
        return
    layer = layers[index]
    if not isinstance(layer, DynamicLayer):
        raise ValueError(
            f"rope_ext attention does not support a static (preallocated) cache ({type(layer).__name__} layers); use "
            "the default dynamic cache (generate(..., cache_implementation=None))"
        )
    if program.position_rule is not None:
        _check_cache_written_by(program, layer, index)
        program.pending = cache_link(layer)
    elif getattr(layer, "is_sliding", False) and program.of_type(Bias):  # (its length: where its kept keys start)
        program.pending = CacheLink(layer, None)


#: the attribute of a cache layer naming the patch whose position rule wrote its (unrotated) keys
WRITTEN_BY_ATTR = "_rope_ext_written_by"


def _check_cache_written_by(program: AttentionProgram, layer: Any, index: int) -> None:
    """A layer with a position rule caches its keys unrotated: keys another patch, or the unpatched model (rotated
    keys), wrote cannot be continued. Refused, and the layer marked as this patch's."""
    written_by = vars(layer).get(WRITTEN_BY_ATTR)
    if layer.get_seq_length() > 0 and written_by != program.patch_id:
        who = "the model without this patch (its keys are rotated)" if written_by is None else "another rope_ext patch"
        raise ValueError(
            f"the KV cache's layer {index} holds keys written by {who}; a patch with {program.position_rule.name} caches keys "
            "unrotated, so this cache cannot be continued under it. Start a new cache (and do not continue a cache "
            "filled while patched after unpatching)"
        )
    vars(layer)[WRITTEN_BY_ATTR] = program.patch_id


def cache_link(layer: Any) -> CacheLink | None:
    """The link through which a position rule keeps its rotated keys on ``layer`` (a plain ``DynamicLayer`` only;
    ``None``: rotate every time), with the copies of keys the layer no longer holds dropped."""
    if type(layer) is not DynamicLayer:
        return None
    link = CacheLink(layer, getattr(layer, "keys", None))
    link.drop_stale()
    return link


# --- biases over the keys a sliding cache kept ---------------------------------------------------------------


def dropped_keys(link: CacheLink | None, m: int) -> int:
    """How many of the sequence's first keys the sliding cache layer of ``link`` no longer returns (``m`` keys
    returned; 0: it returns them all, or the keys come from no sliding cache)."""
    if link is None or not getattr(link.layer, "is_sliding", False):
        return 0
    return max(0, int(getattr(link.layer, "cumulative_length", m)) - m)


@dataclass(eq=False)
class ShiftedBias(Bias):
    """``term``'s bias read at positions moved by ``offset``: a call that counts its keys from the first one a sliding
    cache kept, whose own position is ``offset``."""

    term: Bias
    offset: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.term.name

    @property
    def has_key_bias(self) -> bool:  # type: ignore[override]
        return self.term.has_key_bias

    @property
    def of_distance(self) -> bool:  # type: ignore[override]
        return self.term.of_distance

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return self.term.bias(q_pos + self.offset, k_pos + self.offset)

    def key_bias(self, c: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return self.term.key_bias(c + self.offset, k_pos + self.offset)

    def distance_form(self, device: torch.device):  # (a distance is the same moved)
        return self.term.distance_form(device)


def run_over_kept_keys(call: Call, dropped: int) -> torch.Tensor:
    """``call``'s output ``[b, h, n, dv]`` where a sliding cache dropped the sequence's first ``dropped`` keys, so keys
    no longer start at position 0. A row's kept keys are consecutive tokens (padding only precedes them) that end at
    its last query: the call runs with positions counted from its first kept key, each bias read at positions moved
    by that key's own position (``ShiftedBias``; one call where that is the same in every row or every bias depends on
    the distance alone). Queries at other positions (jumps, offsets) are left to the program, which refuses them."""
    b, n, m = call.q.shape[0], call.q.shape[2], call.k.shape[2]
    ids = call.position_ids
    if ids is None:  # (the keys' slots)
        ids = torch.arange(dropped + m - n, dropped + m, device=call.q.device)[None]
    ids = ids.expand(b, -1)
    rows = call.rows
    queries = torch.ones(b, n, dtype=torch.bool, device=ids.device) if rows is None else rows[:, m - n :]
    counts = torch.full((b,), m, device=ids.device) if rows is None else rows.sum(-1)
    first = ids[:, -1] - counts + 1  # [b]: each row's first kept key's own position
    own = first[:, None] + counts[:, None] - n + torch.arange(n, device=ids.device)  # [b, n]: the queries' own
    if not bool((first >= 0).all() & ((ids == own) | ~queries).all()):
        return call.program.run(call)
    call = call.replace(position_ids=None)
    program = call.program
    if all(term.of_distance for term in program.of_type(Bias)):
        return program.run(call)
    offsets = first.tolist()
    if len(set(offsets)) == 1:
        shifted = _shifted(program, offsets[0])
        return shifted.run(call.replace(program=shifted))
    outputs = []
    for r, offset in enumerate(offsets):
        shifted, one = _shifted(program, offset), slice(r, r + 1)
        row = call.replace(program=shifted, q=call.q[one], k=call.k[one], v=call.v[one], rows=None if rows is None else rows[one])
        outputs.append(shifted.run(row))
    return torch.cat(outputs)  # [b, h, n, dv]


def _shifted(program: AttentionProgram, offset: int) -> AttentionProgram:
    terms = [ShiftedBias(term, offset) if isinstance(term, Bias) else term for term in program.terms]
    return AttentionProgram(program.layer_type, program.sliding_window, terms, patch_id=program.patch_id)
