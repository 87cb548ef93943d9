"""The attention site and the hook kinds that rewrite attention (``attention``, ``query_scale``).

How it is wired into transformers, without copying a forward function:

* the rotary replacement returns ``(ones, zeros)`` for the patched layer types, so queries and keys reach
  attention -- and the KV cache -- unrotated (bit-exact: ``q * 1 + rotate_half(q) * 0``);
* one attention function, registered process-wide as ``"rope_ext"`` with ``AttentionInterface`` *and*
  ``AttentionMaskInterface`` (with transformers' ``flash_attention_mask``, so it receives the 2D padding
  mask; a key without a mask function gets ``attention_mask=None`` and padding would be dropped);
* each attention module gets an ``AttentionHook`` (a plain object, not a submodule, so state dicts are
  unchanged) holding its own settings; the registered function reads it from ``module`` at call time, so
  models patched differently in one process do not interfere;
* the config's attention implementation is set to ``"rope_ext"`` and put back by ``unpatch``.

The hook rotates queries and keys itself, with the frequencies the rotary replacement gives for the
current length (a frequency method's, or the checkpoint's own), region by region (``rope_ext.attention``).
Keys are rotated at attention time, so a dynamic frequency method is consistent with the cache. Layers
left alone (sliding-window layers) run plain attention with their window.

Decoding: a method that rotates every cached key at a position of its own (Self-Extend's ``j // G``, DCA's
``j mod s``, STRING's ``j``) would re-rotate the whole cache in every layer at every step. Instead the rotated
keys are kept on the cache layer (``RotatedKeys``: a second, rotated copy of the key cache, gone with the
cache) and each step rotates only the keys it adds. A forward pre-hook on each patched attention module
notes its ``DynamicLayer`` before the module appends to it; the copy is reused only when that layer still
holds, unmodified, the key tensor the copy was made from, so a cache that was reordered, cropped, narrowed,
reset or written in place is rotated afresh. Other caches (and calls without one) rotate every time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.utils import logging

from rope_ext.attention import kernels
from rope_ext.attention.reference import method_reference, two_matrix_attention
from rope_ext.hooks.base import HookInstaller, PlanBuilder, Site, register_hook
from rope_ext.hooks.rotary import RopeExtRotaryEmbedding, RotarySite
from rope_ext.methods import (
    HOOK_ATTENTION,
    HOOK_FREQUENCY,
    HOOK_QUERY_SCALE,
    AttentionConfig,
    DualChunkConfig,
    LogNConfig,
    MethodConfig,
    WindowConfig,
)
from rope_ext.methods.base import check_length_within

logger = logging.get_logger(__name__)

#: the key under which the attention function and its mask function are registered
ATTENTION_KEY = "rope_ext"
#: the attribute of a patched attention module that holds its ``AttentionHook``
HOOK_ATTR = "_rope_ext_attention"


def rotate(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [b, h, n, d]`` rotated at ``positions [n]``, bit for bit as transformers' ``apply_rotary_pos_emb``
    computes ``x * cos + rotate_half(x) * sin`` (cos/sin in float32, cast to ``x``'s dtype; dims past the rotary
    dimension pass unchanged), written into ``out`` (a new tensor when ``None``) without full-size temporaries:
    both halves of transformers' cos/sin are the same values, ``(-a) * s == -(a * s)`` and ``c + (-p) == c - p``
    in IEEE arithmetic, so ``out = x * cos``, then ``out_lo -= x_hi * sin``, ``out_hi += x_lo * sin``."""
    freqs = positions[:, None].float() * inv_freq.to(device=positions.device, dtype=torch.float)  # [n, r/2]
    cos, sin = freqs.cos(), freqs.sin()
    if not (isinstance(attention_factor, float | int) and attention_factor == 1):  # (times 1 is exact: no launch)
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)  # cos [n, 1, r/2]: broadcast over both halves
    half = freqs.shape[-1]
    rotary = 2 * half
    if torch.is_grad_enabled() and x.requires_grad:  # (autograd takes no out=): the same values out of place
        scaled = x[..., :rotary].unflatten(-1, (2, half)) * cos
        low, high = scaled[..., 0, :] - x[..., half:rotary] * sin, scaled[..., 1, :] + x[..., :half] * sin
        rotated = torch.cat((low, high, x[..., rotary:]), dim=-1)
        return rotated if out is None else out.copy_(rotated)
    if out is None:
        out = x.new_empty(x.shape)
    torch.mul(x[..., :rotary].unflatten(-1, (2, half)), cos, out=out[..., :rotary].unflatten(-1, (2, half)))
    out[..., :half].sub_(x[..., half:rotary] * sin)
    out[..., half:rotary].add_(x[..., :half] * sin)
    if x.shape[-1] > rotary:
        out[..., rotary:] = x[..., rotary:]
    return out


def rotate_at_zero(x: torch.Tensor, inv_freq: torch.Tensor, attention_factor) -> torch.Tensor:
    """``rotate(x, zeros, ...)`` without the rotation (``cos = attention_factor``, ``sin = 0``): ``x`` itself when
    the factor is 1, else its rotary dims times the factor (as ``rotate`` rounds it)."""
    factor = torch.ones((), dtype=torch.float32) * attention_factor  # cos(0) * factor in float32, as rope_cos_sin
    if bool((factor == 1).all()):
        return x
    rotary = 2 * inv_freq.shape[-1]
    rotated = x[..., :rotary] * factor.to(device=x.device, dtype=x.dtype)
    return torch.cat((rotated, x[..., rotary:]), dim=-1) if x.shape[-1] > rotary else rotated


#: positions a ``RotatedKeys`` buffer grows by (at least) when it runs full
GROWTH = 256
#: the attribute of a cache layer that holds the ``RotatedKeys`` of its sequence
ROTATED_ATTR = "_rope_ext_rotated_keys"


def _version(tensor: torch.Tensor) -> int | None:
    """``tensor``'s in-place version counter; ``None`` for an inference tensor (which keeps none: an in-place
    write to cached keys made under ``torch.inference_mode`` is not seen)."""
    return None if tensor.is_inference() else tensor._version


@dataclass(eq=False)
class CacheLink:
    """The cache layer a call's keys come from, as it was before this forward appended to it."""

    layer: DynamicLayer
    #: ``layer.keys`` before the append
    before: torch.Tensor | None


@dataclass(eq=False)
class RotatedKeys:
    """Keys of a cached sequence rotated by one position rule, kept on the cache layer so that decoding
    rotates only the keys each step adds: a second, rotated copy of the key cache from position ``start``
    on (a window method's band keeps only its last ``w`` keys).

    Reused only when the layer still holds, unmodified, the key tensor this copy was extended from (the
    ``DynamicLayer`` then only appended to it: a reorder, crop, reset or offload replaces the tensor, an
    in-place write bumps its version), with the same frequencies, the same padding and the same rule.
    """

    hook: AttentionHook
    rule: Any
    inv_freq: torch.Tensor
    attention_factor: float | torch.Tensor
    #: the padding mask of a compacted row over the keys seen (``None``: an unpadded batch)
    mask: torch.Tensor | None
    #: the cache's key tensor when this copy was last extended, and its version
    seen: torch.Tensor
    version: int | None
    buffer: torch.Tensor  # [b, hk, capacity, d]: the keys at positions start..length-1, then room to grow
    start: int
    length: int
    #: the frequency tensor ``inv_freq`` was copied from and its version (the same unmodified tensor is the same
    #: frequencies without a comparison of values, which on an accelerator waits for it)
    source: weakref.ref | None = None
    source_version: int | None = None

    def extends(self, link: CacheLink, hook, rule, inv_freq, attention_factor, k, first, mask) -> bool:
        b = self.buffer
        return (
            link.before is self.seen
            and _version(self.seen) == self.version
            and self.hook is hook
            and self.rule == rule
            and self.start <= first <= self.length <= k.shape[2]
            and k.shape[:2] == b.shape[:2]
            and k.shape[3] == b.shape[3]
            and k.dtype == b.dtype
            and k.device == b.device
            and b.is_inference() == torch.is_inference_mode_enabled()  # (an inference tensor takes no writes outside)
            and self._same_frequencies(inv_freq)
            and torch.equal(torch.as_tensor(attention_factor), torch.as_tensor(self.attention_factor))
            and (mask is None) == (self.mask is None)
            and (mask is None or (mask.numel() >= self.mask.numel() and torch.equal(mask[: self.mask.numel()], self.mask)))
        )

    def _same_frequencies(self, inv_freq: torch.Tensor) -> bool:
        if self.source is not None and self.source() is inv_freq and _version(inv_freq) == self.source_version:
            return True
        return inv_freq.shape == self.inv_freq.shape and torch.equal(inv_freq, self.inv_freq)

    def extend(self, rotated: torch.Tensor, first: int) -> torch.Tensor:
        """Append ``rotated`` (the keys from ``length`` on); returns the keys from position ``first`` on (a view
        of the buffer). A full buffer is replaced by a larger one holding the keys from ``first`` on."""
        m = self.length + rotated.shape[2]
        if m - self.start > self.buffer.shape[2]:
            held = self.buffer[:, :, first - self.start : self.length - self.start]
            grown = held.new_empty(*held.shape[:2], m - first + max(GROWTH, (m - first) // 8), held.shape[3])
            grown[:, :, : held.shape[2]] = held
            self.buffer, self.start = grown, first
        self.buffer[:, :, self.length - self.start : m - self.start] = rotated
        self.length = m
        return self.buffer[:, :, first - self.start : m - self.start]


@dataclass(eq=False)
class AttentionHook:
    """One attention module's settings, read by the registered attention function on every call."""

    #: where this layer's frequencies come from; ``None``: queries and keys arrive rotated already
    rotary: RopeExtRotaryEmbedding | None
    layer_type: str | None
    #: ``L`` of this layer's rotary embedding
    original: int
    #: ``L`` as the model's config gives it (a method's stated ``L`` may not exceed it)
    native: int | None = None
    #: the attention method (resolved against ``L``); ``None``: plain attention (causal, or the layer's window)
    method: AttentionConfig | None = None
    query_scale: LogNConfig | None = None
    tile: int = kernels.TILE
    #: ``"fast"``; ``"reference"``: the plain formula (full score matrices in float64, for tests);
    #: ``"two_matrix"``: the reference repositories' two-matrix strategy (window methods, for benchmarks)
    path: str = "fast"
    #: the cache layer of the forward under way (set by ``remember_cache`` before the module runs)
    pending: CacheLink | None = field(default=None, repr=False)

    def remember_cache(self, module: nn.Module, cache: Any) -> None:
        """Note the module's cache layer as it is before this forward appends to it (a ``DynamicLayer`` only)."""
        self.pending = None
        layers = getattr(cache, "layers", None) if isinstance(cache, Cache) else None
        index = getattr(module, "layer_idx", None)
        if layers is None or not isinstance(index, int) or index >= len(layers) or type(layers[index]) is not DynamicLayer:
            return
        layer = layers[index]
        before = getattr(layer, "keys", None)
        held = vars(layer).get(ROTATED_ATTR)
        if held:  # copies of keys the layer no longer holds (reset, crop, reorder...) go now
            for stale in [key for key, memo in held.items() if memo.seen is not before or _version(before) != memo.version]:
                del held[stale]
        self.pending = CacheLink(layer, before)

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
        dropout: float,
        position_ids: torch.Tensor | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        link, self.pending = self.pending, None  # (taken first: a refused call keeps no reference to the cache)
        if dropout:
            raise ValueError(
                f"rope_ext attention does not implement attention dropout (got {dropout}); set the config's "
                "attention_dropout to 0 or call model.eval()"
            )
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"rope_ext attention takes a 2D padding mask (batch, keys); got a {attention_mask.dim()}D mask. "
                "Pass attention_mask as transformers' tokenizers make it"
            )
        if self.method is not None and sliding_window is not None:
            raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: a sliding-window layer cannot take {self.method.method}")
        batch, _, n, _ = query.shape
        m = key.shape[2]
        # a sliding layer rotated here (one rotary embedding serves every layer) may keep only its last keys (a
        # sliding cache); its plain attention depends on distances alone, so its keys count from the first it kept
        relative = sliding_window is not None and self.method is None and self.query_scale is None
        if relative and attention_mask is not None and attention_mask.shape[-1] > m:
            attention_mask = attention_mask[:, -m:]
        if attention_mask is not None and attention_mask.shape[-1] != m:
            raise ValueError(
                f"rope_ext attention got {m} cached keys but a padding mask over {attention_mask.shape[-1]}: a static "
                "(preallocated) cache is not supported; use the default dynamic cache"
            )
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if link is not None and (key is not link.layer.keys or n == m):
            link = None  # not the cache's own tensor, or no cached prefix yet (a one-shot forward keeps nothing)
        if link is not None and torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            link = None  # autograd keeps the rotated keys it multiplied; a kept copy is later extended in place
        frequencies = None
        if self.rotary is not None:
            # the current length, as the rotary module sees it (dynamic methods follow it)
            length_ids = position_ids if position_ids is not None else torch.full((1, 1), m - 1, device=query.device)
            frequencies = self.rotary.frequencies(length_ids, self.layer_type, query.device)
        rows = None if attention_mask is None else attention_mask.to(torch.bool)
        if rows is not None and self.rotary is not None and n < m and not bool(rows[:, -1].all()):
            raise ValueError(
                "rope_ext attention got a padding mask whose last key is masked: a static (preallocated) cache is "
                "not supported; use the default dynamic cache"
            )
        # (layers left alone see relative distances only, and a sliding cache keeps just the last keys)
        positional = self.rotary is not None and position_ids is not None and not relative
        if rows is None and positional and _POSITIONS_CHECKED.get(position_ids) != (m, _version(position_ids)):
            _check_positions(position_ids, m)
        if rows is not None and bool(rows.all()):
            rows = None
        if rows is None:
            out = self._attend(query, key, value, scale, frequencies, sliding_window, _Keep(link, None, None))
        else:  # padded rows, one by one, compacted to their own tokens
            out = torch.zeros(*query.shape[:-1], value.shape[-1], dtype=query.dtype, device=query.device)
            for r in range(batch):
                keep = rows[r]
                keys = keep.nonzero().squeeze(-1)
                queries = keep[m - n :].nonzero().squeeze(-1)
                if queries.numel() == 0:
                    continue
                q_r = query[r : r + 1, :, queries]
                kept = _Keep(link, r, keep)
                out[r, :, queries] = self._attend(
                    q_r, key[r : r + 1, :, keys], value[r : r + 1, :, keys], scale, frequencies, sliding_window, kept
                )[0]
        return out.transpose(1, 2).contiguous()

    def _attend(self, q, k, v, scale, frequencies, sliding_window, kept: _Keep) -> torch.Tensor:
        """Rows without padding: keys at positions ``0..m-1``, queries the last ``n`` of them."""
        n, m = q.shape[2], k.shape[2]
        q0 = m - n
        far_limit = None if sliding_window is None else sliding_window - 1
        acc = kernels.SingleQuery(q, v) if kernels.SingleQuery.applies(q, k) else kernels.Accumulator(q, v.shape[-1])
        if frequencies is None:  # rotated already: plain attention
            self._plain(acc, q, k, v, scale, q0, far_limit)
            return acc.out.to(q.dtype)
        inv_freq, attention_factor = frequencies
        if self.path == "two_matrix" and isinstance(self.method, WindowConfig) and self.query_scale is None:
            return two_matrix_attention(
                q, k, v, method=self.method, inv_freq=inv_freq, attention_factor=attention_factor, scaling=scale
            )
        if self.path != "fast":
            return method_reference(
                q, k, v, method=self.method, query_scale=self.query_scale, original=self.original, inv_freq=inv_freq,
                attention_factor=attention_factor, scaling=scale, sliding_window=sliding_window,
            )
        device = q.device
        q_pos = torch.arange(q0, m, device=device, dtype=torch.float32)
        multiplier = self._query_multiplier(q_pos)
        if multiplier is not None:
            q = q * multiplier.to(q.dtype)[:, None]
        method = self.method
        keys = _KeyRotation(self, kept, inv_freq, attention_factor)
        if method is None:
            q_std = rotate(q, q_pos, inv_freq, attention_factor)
            self._plain(acc, q_std, keys.at("position", k, _same), v, scale, q0, far_limit)
        elif isinstance(method, WindowConfig):
            self._window(acc, method, q, k, v, scale, q0, q_pos, keys)
        elif isinstance(method, DualChunkConfig):
            self._dual_chunk(acc, method, q, k, v, scale, q0, q_pos, keys)
        else:
            raise TypeError(f"no attention path for {type(method).__name__}")
        return acc.out.to(q.dtype)

    def _query_multiplier(self, q_pos: torch.Tensor) -> torch.Tensor | None:
        factors = []
        if self.query_scale is not None:
            factors.append(self.query_scale.scale(q_pos, self.original))
        if isinstance(self.method, DualChunkConfig):
            factor = self.method.query_scale(q_pos, self.original)
            if factor is not None:
                factors.append(factor)
        if not factors:
            return None
        product = factors[0]
        for factor in factors[1:]:
            product = product * factor
        return product.float()

    def _plain(self, acc, q, k, v, scale, q0, far_limit) -> None:
        start = 0 if far_limit is None else max(0, q0 - far_limit)
        kernels.region(acc, q, k[:, :, start:], v[:, :, start:], scale, q0, 0, far_limit, start, self.tile)

    def _window(self, acc, method: WindowConfig, q, k, v, scale, q0, q_pos, keys: _KeyRotation) -> None:
        m = k.shape[2]
        w = method.window
        inv_freq, attention_factor = keys.inv_freq, keys.attention_factor
        band_start = max(0, q0 - w + 1)  # the band needs only the last keys (decode rotates w of them)
        far_keys = m - w  # keys 0..m-w-1 can be w or more behind the last query
        if method.far_key_is_position and far_keys > 0:
            k_std = keys.at("position", k, _same)
            k_band = k_std[:, :, band_start:]
        else:
            k_std = None
            k_band = keys.at("position", k, _same, first=band_start)
        block = kernels.query_block(q)  # (in blocks: one block's rotated queries at a time)
        for a in range(0, q.shape[2], block):
            b = min(q.shape[2], a + block)
            q_std = rotate(q[:, :, a:b], q_pos[a:b], inv_freq, attention_factor)
            kernels.region(
                acc, q_std, k_band, v[:, :, band_start:], scale, q0 + a, 0, w - 1, band_start, self.tile, out_offset=a
            )
            del q_std
        del k_band
        if far_keys <= 0 or m - 1 < w:  # (the last query is at m - 1)
            return
        if k_std is not None:
            k_far = k_std[:, :, :far_keys]
        elif method.far_key_is_zero:
            k_far = rotate_at_zero(k[:, :, :far_keys], inv_freq, attention_factor)
        else:
            k_far = keys.at(("far", method), k[:, :, :far_keys], method.far_key)
        first = max(0, w - q0)  # queries before position w have no far keys
        for a in range(first, q.shape[2], block):  # (one block's rotated queries and output at a time)
            b = min(q.shape[2], a + block)
            q_far = rotate(q[:, :, a:b], method.far_query(q_pos[a:b]), inv_freq, attention_factor)
            kernels.region(acc, q_far, k_far, v[:, :, :far_keys], scale, q0 + a, w, None, out_offset=a)
            del q_far

    def _dual_chunk(self, acc, method: DualChunkConfig, q, k, v, scale, q0, q_pos, keys: _KeyRotation) -> None:
        s, size = method.chunk, method.chunk_size
        inv_freq, attention_factor = keys.inv_freq, keys.attention_factor
        k_rot = keys.at(("chunk", method), k, lambda j: torch.remainder(j, s))
        a = 0
        while a < q.shape[2]:  # the queries of one chunk at a time (rotated per chunk: one chunk's copies at a time)
            p0 = q0 + a
            start = (p0 // s) * s  # their chunk
            b = min(q.shape[2], start + s - q0)
            qc, within = q[:, :, a:b], torch.remainder(q_pos[a:b], s)
            span = slice(start, q0 + b)
            q_intra = rotate(qc, within, inv_freq, attention_factor)
            kernels.region(acc, q_intra, k_rot[:, :, span], v[:, :, span], scale, p0, 0, None, start, out_offset=a)
            del q_intra
            if start >= s:
                span = slice(start - s, start)
                q_successive = rotate(qc, torch.clamp(within + s, max=size), inv_freq, attention_factor)
                acc.attend(a, b, q_successive, k_rot[:, :, span], v[:, :, span], scale, span.start)
                del q_successive
            if start >= 2 * s:
                span = slice(0, start - s)
                q_older = rotate(qc, torch.full_like(within, float(size)), inv_freq, attention_factor)
                acc.attend(a, b, q_older, k_rot[:, :, span], v[:, :, span], scale, span.start)
            a = b


#: position_ids tensors found to end at the last key (their key count and version): every layer of a forward
#: gets the same tensor, and only the first compares it (a comparison on an accelerator waits for the device)
_POSITIONS_CHECKED = WeakIdKeyDictionary()


def _check_positions(position_ids: torch.Tensor, m: int) -> None:
    if bool((position_ids[:, -1] != m - 1).any()):
        raise ValueError(
            f"rope_ext attention takes positions from the keys ({m} of them, the last at {m - 1}), but position_ids "
            f"end at {position_ids[:, -1].tolist()}: a static (preallocated) cache and custom position_ids (packed "
            "sequences, offsets) are not supported; use the default dynamic cache and an attention mask"
        )
    if _version(position_ids) is not None:  # (an inference tensor keeps no version: checked every time)
        _POSITIONS_CHECKED[position_ids] = (m, _version(position_ids))


def _same(positions: torch.Tensor) -> torch.Tensor:
    return positions


@dataclass(eq=False)
class _Keep:
    """Where one ``_attend`` call may keep its rotated keys: the cache link of the call, the padded row (its
    index and padding mask) or ``None`` for an unpadded batch."""

    link: CacheLink | None
    row: int | None
    mask: torch.Tensor | None


@dataclass(eq=False)
class _KeyRotation:
    """The keys of one ``_attend`` call rotated by a position rule: through the cache layer's ``RotatedKeys``
    when the keys come from a ``DynamicLayer`` and no gradients are wanted (``kept.link``), else afresh."""

    hook: AttentionHook
    kept: _Keep
    inv_freq: torch.Tensor
    attention_factor: float | torch.Tensor

    def at(self, rule: Any, k: torch.Tensor, positions, first: int = 0) -> torch.Tensor:
        """The keys ``k[:, :, first:]`` (the first keys of the call's) rotated at ``positions(j)``, ``j = first..``."""
        m = k.shape[2]
        j = torch.arange(first, m, device=k.device, dtype=torch.float32)
        link, mask = self.kept.link, self.kept.mask
        if link is None:
            return rotate(k[:, :, first:], positions(j), self.inv_freq, self.attention_factor)
        held = vars(link.layer).setdefault(ROTATED_ATTR, {})
        slot = (self.kept.row, rule)
        memo = held.get(slot)
        if memo is not None and memo.extends(link, self.hook, rule, self.inv_freq, self.attention_factor, k, first, mask):
            new = rotate(k[:, :, memo.length :], positions(j[memo.length - first :]), self.inv_freq, self.attention_factor)
            rotated = memo.extend(new, first)
        else:  # (``remember_cache`` dropped the stale copies; this slot's old one goes before the new one is made)
            held.pop(slot, None)
            buffer = k.new_empty(*k.shape[:2], m - first + GROWTH, k.shape[3])
            rotate(k[:, :, first:], positions(j), self.inv_freq, self.attention_factor, out=buffer[:, :, : m - first])
            factor = self.attention_factor
            memo = RotatedKeys(
                self.hook, rule, self.inv_freq.detach().clone(),
                factor.detach().clone() if isinstance(factor, torch.Tensor) else factor,
                None, link.layer.keys, -1, buffer, first, m, weakref.ref(self.inv_freq), _version(self.inv_freq),
            )
            held[slot] = memo
            rotated = buffer[:, :, : m - first]
        memo.seen, memo.version = link.layer.keys, _version(link.layer.keys)
        memo.mask = None if mask is None else mask.clone()
        return rotated


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
    """The attention function registered as ``"rope_ext"``: dispatches to the module's ``AttentionHook``."""
    if kwargs.get("output_attentions"):
        logger.warning_once(
            "rope_ext attention does not return attention weights (output_attentions=True gives none); unpatch, or "
            "patch a model loaded with attn_implementation='eager' and read the weights before patching"
        )
    hook = getattr(module, HOOK_ATTR, None)
    if hook is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation='rope_ext' but was not patched by rope_ext; use "
            "rope_ext.patch(model, ...) (or rope_ext.from_pretrained) rather than setting the implementation by hand"
        )
    out = hook(
        module, query, key, value, attention_mask, scaling, dropout, kwargs.get("position_ids"), kwargs.get("sliding_window") or None
    )
    return out, None


AttentionInterface.register(ATTENTION_KEY, rope_ext_attention)
AttentionMaskInterface.register(ATTENTION_KEY, flash_attention_mask)


def _remember_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a patched attention module: its hook notes the cache layer before the append."""
    hook = getattr(module, HOOK_ATTR, None)
    if hook is not None:
        hook.remember_cache(module, kwargs.get("past_key_values", kwargs.get("layer_past")))


def _sliding_window(module: nn.Module) -> int | None:
    """The window a module's attention is limited to (what its forward passes as ``sliding_window``)."""
    if vars(module).get("is_sliding") is False:  # (EXAONE 4 keeps the config's window on its full layers too)
        return None
    if "sliding_window" in vars(module):
        return vars(module)["sliding_window"] or None
    return getattr(getattr(module, "config", None), "sliding_window", None) or None  # (0: none, as Qwen2-MoE says)


def _no_rope(module: nn.Module) -> bool:
    """Whether the module's forward applies no rotary embedding (NoPE): SmolLM3's layers whose ``use_rope`` is
    off, EXAONE 4's full-attention layers in a hybrid (sliding-window) model."""
    attrs = vars(module)
    if "use_rope" in attrs:
        return not attrs["use_rope"]
    return attrs.get("is_sliding") is False and attrs.get("sliding_window") is not None


@dataclass(eq=False)
class AttentionSite(Site):
    """A model's attention modules (with their layer types) and the configs that name their implementation."""

    kind: ClassVar[str] = "attention"

    family: str
    modules: list[tuple[nn.Module, str | None]]
    rotary: RotarySite

    def replacement(self, builder: PlanBuilder) -> AttentionSetup:
        return builder.replacement(self, lambda: (None, None, AttentionSetup.build(self, builder)))


@dataclass(eq=False)
class AttentionSetup:
    """What the attention hooks of one plan share: the hooks of the layers a method applies to."""

    hooks: list[AttentionHook] = field(default_factory=list)

    @classmethod
    def build(cls, site: AttentionSite, builder: PlanBuilder) -> AttentionSetup:
        rotary_site = site.rotary
        rotary = rotary_site.replacement(builder)
        chosen = rotary_site.layer_types(builder.option("layer_types"))
        with_frequency = HOOK_FREQUENCY in builder.kinds
        specs = {}
        for layer_type in chosen:
            params = rotary_site.params(layer_type)
            rope_type = params.get("rope_type", "default")
            if not with_frequency and rope_type in ("dynamic", "longrope"):
                raise ValueError(
                    f"{site.family}: this checkpoint's {rope_type!r} RoPE scaling depends on the sequence length; an "
                    "attention method needs fixed frequencies: combine it with a frequency method and "
                    "replace_scaling=True (e.g. ['yarn', 'dca'])"
                )
            specs[layer_type] = rotary_site.spec(layer_type, None, True)
        rotary.set_identity(specs)
        if not with_frequency:
            rotary.set_base(rotary_site, specs)
        setup = cls()
        configs: dict[int, Any] = {}
        sliding = sorted({t for module, t in site.modules if t in specs and _sliding_window(module) is not None}, key=str)
        if sliding and None not in specs:  # layer types the user (or the default) chose
            full = sorted({t for module, t in site.modules if _sliding_window(module) is None}, key=str)
            raise ValueError(
                f"{site.family}: layer types {sliding} use sliding-window attention, which attention methods do not "
                f"rewrite; choose layer_types among the full-attention ones: {full}"
            )
        no_rope = 0
        for module, layer_type in site.modules:
            if _no_rope(module):  # positions never reach it: plain attention on what it gets
                hook = AttentionHook(None, layer_type, 0)
                no_rope += 1
            elif layer_type in specs or None in specs:
                key = layer_type if layer_type in specs else None  # one rotary embedding serves every layer
                # (L of the rotation in effect: a frequency method's own, when it states one)
                hook = AttentionHook(
                    rotary, key, rotary.specs[key].original_max_position_embeddings, rotary_site.original_length(key)
                )
                if _sliding_window(module) is None:
                    setup.hooks.append(hook)
            else:
                hook = AttentionHook(None, layer_type, 0)  # rotated by the original module: plain attention
            softcap = getattr(module.config, "attn_logit_softcapping", None)
            if softcap is not None:
                raise ValueError(
                    f"{site.family}: this model caps attention logits (attn_logit_softcapping={softcap}), which rope_ext's "
                    "attention does not implement; attention methods are refused for it"
                )
            builder.edit(module, HOOK_ATTR, hook)
            if hook.rotary is not None:
                builder.hook_forward(module, _remember_cache)
            configs[id(module.config)] = module.config
        if not setup.hooks:
            raise ValueError(
                f"{site.family}: all {no_rope} of its layers use no positional encoding (NoPE): no layer to rewrite"
                if no_rope == len(site.modules) else
                f"{site.family}: {no_rope} of its {len(site.modules)} layers use no positional encoding (NoPE) and "
                "the others sliding-window attention, which attention methods leave alone: no layer to rewrite"
                if no_rope else
                f"{site.family}: every layer of this model uses sliding-window attention; attention methods apply "
                "to full-attention layers"
            )
        for config in configs.values():
            builder.edit(config, "_attn_implementation_internal", ATTENTION_KEY)
        return setup


def attention_setup(builder: PlanBuilder, method: MethodConfig) -> AttentionSetup:
    sites = builder.sites.get(AttentionSite.kind)
    if len(sites) != 1:
        raise ValueError(f"{method.method}: this model has {len(sites)} attention sites; rope_ext handles one")
    return sites[0].replacement(builder)


class AttentionInstaller(HookInstaller):
    """Attention-rewrite methods: a remapped relative position in every full-attention layer."""

    kind = HOOK_ATTENTION
    site_kinds = frozenset({RotarySite.kind, AttentionSite.kind})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        for hook in attention_setup(builder, method).hooks:
            self.configure(hook, method)

    def configure(self, hook: AttentionHook, method: MethodConfig) -> None:
        assert isinstance(method, AttentionConfig)
        check_length_within(method.method, method.original_max_position_embeddings, hook.native)
        hook.method = method.resolved(hook.original)

    def in_use(self, model: nn.Module, method: MethodConfig) -> MethodConfig:
        used = {hook.method for hook in installed_hooks(model) if type(hook.method) is type(method)}
        return used.pop() if len(used) == 1 else method  # (layers resolved differently: no one value to state)


class QueryScaleInstaller(AttentionInstaller):
    """Query scaling (log-n): a per-position multiplier on the queries of every full-attention layer."""

    kind = HOOK_QUERY_SCALE

    def configure(self, hook: AttentionHook, method: MethodConfig) -> None:
        assert isinstance(method, LogNConfig)
        check_length_within(method.method, method.original_max_position_embeddings, hook.native)
        hook.query_scale = method

    def in_use(self, model: nn.Module, method: MethodConfig) -> MethodConfig:
        assert isinstance(method, LogNConfig)
        originals = {hook.original for hook in installed_hooks(model) if hook.query_scale is method}
        if method.original_max_position_embeddings is not None or len(originals) != 1:
            return method
        return dataclasses.replace(method, original_max_position_embeddings=originals.pop())


def installed_hooks(model: nn.Module) -> Iterator[AttentionHook]:
    """The attention hooks installed in ``model``'s modules."""
    for module in model.modules():
        hook = module.__dict__.get(HOOK_ATTR)
        if isinstance(hook, AttentionHook):
            yield hook


register_hook(AttentionInstaller())
register_hook(QueryScaleInstaller())


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)


@functools.cache
def dispatches_through_interface(cls: type) -> bool:
    """Whether an attention class's forward calls the function ``AttentionInterface`` holds for the config's
    implementation (Falcon's picks SDPA or eager itself, so a registered function would never run)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def attention_modules(model: nn.Module, config: Any) -> list[tuple[nn.Module, str | None]]:
    """The attention modules of ``model`` with each one's layer type (``config.layer_types``, if any)."""
    found = []
    for module in model.modules():
        if _is_attention(module):
            layer_types = getattr(module.config, "layer_types", None) or getattr(config, "layer_types", None)
            layer_type = layer_types[module.layer_idx] if layer_types else None
            found.append((module, layer_type))
    return found


