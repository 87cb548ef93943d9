"""Wrappers around the whole attention call (hook kind ``wrapper``): shifted sparse attention, S2-Attn.

Pure math: never imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rope_ext.methods.base import HOOK_WRAPPER, MethodConfig, register_method
from rope_ext.methods.options import flag, interval, option


@register_method
@dataclass(frozen=True)
class S2AttnConfig(MethodConfig):
    """Shifted sparse attention, S2-Attn (Chen et al. 2023, LongLoRA, arXiv:2309.12307): while training, attention
    within groups of tokens, half of the heads' groups shifted by half a group. Training time only: in eval mode
    attention is full. Checked against dvlab-research/LongLoRA ``llama_attn_replace.py`` (``forward_flashattn``,
    ``forward_noflashattn``).

    On a training forward of ``n`` tokens, with ``g = int(n * group_size_ratio)`` (``n`` a multiple of ``g``:
    ``s2_group_size``) and ``s = g // 2``: heads ``0..h//2-1`` attend causally within the groups
    ``[0, g), [g, 2g), ...`` and heads ``h//2..h-1`` within ``[0, s), [s, s + g), ..., [n - g + s, n)``, query ``i``
    over key ``j`` when ``j <= i`` and both are in one group. That is the reference's flash-attention path (its
    ``cu_seqlens``). Its path without flash attention rolls the shifted heads by ``-s`` instead, so that tokens
    ``0..s-1`` share a group with the last ``g - s`` tokens and see them: a leak from the future (LongLoRA issue
    #90); elsewhere the two agree. ``shift=False`` keeps every head in the unshifted groups (the paper's ablation).
    A group as long as the sequence (``g >= n``, e.g. ``group_size_ratio=1``) is full attention: the shift is
    skipped. Keys and values follow their query heads as in GQA (query head ``i`` reads key head
    ``i // (h / h_kv)``).

    Its own hook kind (``wrapper``): it combines with the frequency methods (the rotation is applied before the
    grouping, at the true positions) and with nothing, not with methods that need positions inside attention
    (attention rewrites, ``logn``, ``cache_consistent`` dynamic methods). Training batches must be unpadded
    (packed to one length) and of a length the groups divide.
    """

    method: ClassVar[str] = "s2_attn"
    hook: ClassVar[str] = HOOK_WRAPPER
    summary: ClassVar[str] = (
        "Shifted sparse attention, S2-Attn (Chen et al. 2023, LongLoRA, arXiv:2309.12307): in training, attention "
        "within groups of tokens, half of the heads' groups shifted by half a group; full attention in eval mode."
    )

    group_size_ratio: float = option(
        0.25, interval(0, 1, hint="the fraction of a training sequence one group holds; LongLoRA: 0.25"),
        meaning="the fraction of a training sequence one group holds: groups of ``int(n * group_size_ratio)`` tokens "
                "(LongLoRA: 1/4)")
    shift: bool = option(
        True, flag(),
        meaning="shift the groups of half of the heads by half a group; False: plain groups (the paper's ablation)")

    def group_size(self, n: int) -> int:
        """The group size for a training sequence of ``n`` tokens (``s2_group_size``)."""
        return s2_group_size(n, self.group_size_ratio)


def _group_size(n: int, ratio: float) -> int:
    return int(n * ratio + 1e-9)  # LongLoRA's int(n * ratio), forgiving float rounding (49 * (1 / 49) = 0.99...)


def _divides(n: int, ratio: float) -> bool:
    g = _group_size(n, ratio)
    return g >= 1 and n % g == 0


def s2_group_size(n: int, ratio: float) -> int:
    """S2-Attn's group size ``g = int(n * ratio)`` for a training sequence of ``n`` tokens; raises ``ValueError``
    naming the lengths that work when ``g`` does not divide ``n`` (or is 0). With ``ratio = 1/G`` every multiple of
    ``G`` works (``G`` groups)."""
    g = _group_size(n, ratio)
    if g >= 1 and n % g == 0:
        return g
    below = next((length for length in range(n - 1, 0, -1) if _divides(length, ratio)), None)
    above = next((length for length in range(n + 1, 4 * n + 8) if _divides(length, ratio)), None)
    near = " and ".join(str(length) for length in (below, above) if length is not None) or "none near it"
    groups = 1 / ratio
    rule = (
        f"every multiple of {round(groups)} works"
        if abs(groups - round(groups)) < 1e-9
        else "a ratio 1/G (0.25, 0.125...) makes every multiple of G work"
    )
    problem = f"is too short for groups (int({n} * {ratio}) = 0 tokens)" if g < 1 else (
        f"does not split into groups of int({n} * {ratio}) = {g} tokens"
    )
    raise ValueError(
        f"s2_attn: a training sequence of {n} tokens {problem}; the length must be a multiple of its group size "
        f"int(n * group_size_ratio) (with group_size_ratio={ratio}, {rule}; the nearest lengths that work: {near}). "
        "Cut or pack training sequences to such a length"
    )
