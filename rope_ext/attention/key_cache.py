"""Rotated keys kept with the KV cache, so that decoding rotates only the keys each step adds.

A position rule that rotates every cached key at a position of its own (Self-Extend's ``j // G``, DCA's
``j mod s``, a window's band) would re-rotate the whole cache in every layer at every step. Instead the rotated
keys are kept on the cache layer (``RotatedKeys``: a second, rotated copy of the key cache, gone with the cache)
and each step rotates only the keys it adds. The attention site notes each module's cache layer before the
module appends to it (``CacheLink``); the copy is reused only when that layer still holds, unmodified, the key
tensor the copy was made from, so a cache that was reordered, cropped, narrowed, reset or written in place is
rotated afresh. Other caches (and calls without one) rotate every time.

Pure torch: the cache layer is any object with a ``keys`` tensor attribute (transformers' ``DynamicLayer``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rope_ext.methods.rope import rotate, rotation_tables

#: positions a ``RotatedKeys`` buffer grows by (at least) when it runs full
GROWTH = 256
#: the attribute of a cache layer that holds the ``RotatedKeys`` of its sequence
ROTATED_ATTR = "_rope_ext_rotated_keys"
#: position sets of at most this many positions share their ``(cos, sin)`` tables across the layers of a forward
#: (decode: every layer rotates the same one or few positions, where each table costs five launches); longer ones
#: are made per call (a table held through the forward would add to its peak memory)
SHARED_POSITIONS = 64
#: a forward's tables: its ``position_ids`` tensor (every layer gets the same one) -> the frequency tensor -> the
#: tables by name (weak keys: nothing outlives the forward, and no new tensor at a dead one's address is mistaken)
_SHARED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shared_tables(scope: torch.Tensor | None, inv_freq: torch.Tensor, attention_factor) -> dict | None:
    """The tables shared by the calls of one forward (``scope``: its ``position_ids``) with these frequencies, by
    name; ``None`` (every call makes its own) without a scope or with a factor that is a tensor (a dynamic method's,
    made per call)."""
    if scope is None or isinstance(attention_factor, torch.Tensor) or inv_freq.requires_grad:
        return None
    by_frequencies = _SHARED.setdefault(scope, WeakIdKeyDictionary())
    per_version = by_frequencies.setdefault(inv_freq, {})
    return per_version.setdefault((version(inv_freq), float(attention_factor)), {})


def version(tensor: torch.Tensor) -> int | None:
    """``tensor``'s in-place version counter; ``None`` for an inference tensor (which keeps none: an in-place
    write to cached keys made under ``torch.inference_mode`` is not seen)."""
    return None if tensor.is_inference() else tensor._version


@dataclass(eq=False)
class CacheLink:
    """The cache layer a call's keys come from, as it was before this forward appended to it."""

    layer: Any
    #: ``layer.keys`` before the append
    before: torch.Tensor | None

    def drop_stale(self) -> None:
        """Forget the copies of keys the layer no longer holds (reset, crop, reorder...)."""
        held = vars(self.layer).get(ROTATED_ATTR)
        if held:
            for stale in [k for k, memo in held.items() if memo.seen is not self.before or version(self.before) != memo.version]:
                del held[stale]


@dataclass(eq=False)
class RotatedKeys:
    """Keys of a cached sequence rotated by one position rule: a second, rotated copy of the key cache from
    position ``start`` on (a window's band keeps only its last ``w`` keys).

    Reused only when the layer still holds, unmodified, the key tensor this copy was extended from (the cache
    layer then only appended to it: a reorder, crop, reset or offload replaces the tensor, an in-place write
    bumps its version), with the same frequencies, the same padding, the same owner and the same rule.
    """

    owner: Any
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

    def extends(self, link: CacheLink, owner, rule, inv_freq, attention_factor, k, first, mask) -> bool:
        b = self.buffer
        return (
            link.before is self.seen
            and version(self.seen) == self.version
            and self.owner is owner
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
        if self.source is not None and self.source() is inv_freq and version(inv_freq) == self.source_version:
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
class Keep:
    """Where one row group of a call may keep its rotated keys: the cache link of the call (``None``: nowhere),
    the padded row (its index and padding mask) or ``None`` for an unpadded batch."""

    link: CacheLink | None
    row: int | None
    mask: torch.Tensor | None


NOWHERE = Keep(None, None, None)


@dataclass(eq=False)
class KeyRotation:
    """The keys of one call rotated by a position rule: through the cache layer's ``RotatedKeys`` when the keys
    come from a tracked cache layer and no gradients are wanted (``kept.link``), else afresh."""

    owner: Any
    kept: Keep
    inv_freq: torch.Tensor
    attention_factor: float | torch.Tensor
    #: the forward's shared tables (``shared_tables``), or ``None``
    shared: dict | None = None

    def rotate(self, x: torch.Tensor, positions, name: Any) -> torch.Tensor:
        """``x [b, h, n, d]`` rotated at ``positions`` (``[n]``, or a function making them, called only when they are
        needed), which ``name`` stands for in this forward (the same name, the same positions: a rule and the range
        of indices it maps); the tables of a short set are made once per forward."""
        tables = None
        if self.shared is not None and x.shape[2] <= SHARED_POSITIONS:
            key = (name, x.dtype, x.device)
            tables = self.shared.get(key)
            if tables is None:
                made = positions() if callable(positions) else positions
                tables = self.shared[key] = rotation_tables(made, self.inv_freq, self.attention_factor, x.dtype)
        if tables is None and callable(positions):
            positions = positions()
        return rotate(x, positions, self.inv_freq, self.attention_factor, tables=tables)

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
        if memo is not None and memo.extends(link, self.owner, rule, self.inv_freq, self.attention_factor, k, first, mask):
            new = self.rotate(k[:, :, memo.length :], positions(j[memo.length - first :]), (rule, memo.length, m))
            rotated = memo.extend(new, first)
        else:  # (stale copies were dropped when the link was made; this slot's old one goes before the new one)
            held.pop(slot, None)
            buffer = k.new_empty(*k.shape[:2], m - first + GROWTH, k.shape[3])
            rotate(k[:, :, first:], positions(j), self.inv_freq, self.attention_factor, out=buffer[:, :, : m - first])
            factor = self.attention_factor
            memo = RotatedKeys(
                self.owner, rule, self.inv_freq.detach().clone(),
                factor.detach().clone() if isinstance(factor, torch.Tensor) else factor,
                None, link.layer.keys, -1, buffer, first, m, weakref.ref(self.inv_freq), version(self.inv_freq),
            )
            held[slot] = memo
            rotated = buffer[:, :, : m - first]
        memo.seen, memo.version = link.layer.keys, version(link.layer.keys)
        memo.mask = None if mask is None else mask.clone()
        return rotated
