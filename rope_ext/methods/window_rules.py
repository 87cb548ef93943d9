"""The window rules: plain RoPE for the nearest keys, remapped positions beyond (``rope_ext.methods.windows`` holds
their mappings, ``rope_ext.methods.position_rules`` their bases).

* ReRoPE (Su 2023, bojone/rerope ``rerope_patch.py``): ``rel' = min(rel, w)``.
* Leaky ReRoPE (same repository, ``leaky_rerope_patch.py``): ``rel`` below ``w``, else ``w + (rel - w) / k``.
* Self-Extend (Jin et al. 2024, arXiv:2401.01325; datamllab/LongLM): ``rel`` below ``W``, else
  ``(i // G + W - W // G) - j // G``.
* STRING (An et al. 2024, arXiv:2410.18745; HKUNLP/STRING): ``rel`` below the shift ``S``, else ``rel - S + W``.

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import register_method
from rope_ext.methods.options import at_least, integer, option
from rope_ext.methods.position_rules import ORIGINAL, WindowConfig, WindowRule, check_below, check_within
from rope_ext.methods.windows import leaky_rerope_positions, rerope_positions, self_extend_positions, string_positions


@register_method
@dataclass(frozen=True)
class ReRopeConfig(WindowRule):
    """ReRoPE (Su 2023, bojone/rerope ``rerope_patch.py``): ``rel' = min(rel, w)``; default ``w = L / 4``."""

    method: ClassVar[str] = "rerope"
    summary: ClassVar[str] = (
        "ReRoPE (Su 2023, bojone/rerope): relative positions capped at the window, ``rel' = min(rel, w)``, so no "
        "distance passes those the model was trained on."
    )
    far_key_is_zero: ClassVar[bool] = True

    def far_query(self, i):
        return torch.full_like(i, float(self.w))

    def far_key(self, j):
        return torch.zeros_like(j)

    def relative(self, i, j):
        return rerope_positions(i, j, self.w)


@register_method
@dataclass(frozen=True)
class LeakyReRopeConfig(WindowRule):
    """Leaky ReRoPE (bojone/rerope ``leaky_rerope_patch.py``): ``rel`` below ``w``, then ``w + (rel - w) / k``.

    Defaults ``w = L / 4``, ``k = 16`` (the reference's slope).
    """

    method: ClassVar[str] = "leaky_rerope"
    summary: ClassVar[str] = (
        "Leaky ReRoPE (Su 2023, bojone/rerope): relative positions exact below the window ``w`` and ``k`` times "
        "slower beyond it, ``rel' = w + (rel - w) / k``."
    )

    k: float = option(
        16.0, at_least(1, label="the slope beyond the window"),
        meaning="the slope beyond the window: positions there advance ``1/k`` per token (the reference's 16; at most "
                "``L``)")

    def with_defaults(self, original: int) -> LeakyReRopeConfig:
        config = super().with_defaults(original)
        check_within(self.method, "k", self.k, original)  # (beyond L the far positions move less than one per window)
        return config

    def far_query(self, i):
        return self.w * (1 - 1 / self.k) + i / self.k

    def far_key(self, j):
        return j / self.k

    def relative(self, i, j):
        return leaky_rerope_positions(i, j, self.w, self.k)

    def intended_length(self, within):
        return int(self.w + self.k * (within - 1 - self.w)) + 1  # w + (n - 1 - w) / k <= within - 1


@register_method
@dataclass(frozen=True)
class SelfExtendConfig(WindowConfig):
    """Self-Extend (Jin et al. 2024, arXiv:2401.01325; datamllab/LongLM): neighbour attention below ``W``,
    grouped attention ``(i // G + W - W // G) - j // G`` beyond.

    Defaults ``W = L / 8``, ``G = 8``: grouped positions reach ``W + (n - W) / G``, which stays under the
    paper's rule of about ``2L/3`` up to ``n`` of about ``4.5 L``.
    """

    method: ClassVar[str] = "self_extend"
    summary: ClassVar[str] = (
        "Self-Extend (Jin et al. 2024, arXiv:2401.01325; datamllab/LongLM): neighbour attention at the exact "
        "positions below ``W``, grouped attention beyond, ``(i // G + W - W // G) - j // G``."
    )

    W: int | None = option(
        None, integer(1, optional=True),
        meaning="the neighbour window: keys closer than W keep their exact distance; None: ``L/8`` (below ``L``)")
    G: int = option(
        8, integer(1),
        meaning="the group size: beyond W, positions are floor-divided by G (at most ``L``)")

    def with_defaults(self, original: int) -> SelfExtendConfig:
        W = self.W if self.W is not None else max(1, original // 8)
        check_below(self.method, "W", W, original, ORIGINAL)
        check_within(self.method, "G", self.G, original)  # (groups longer than L put every far key at one position)
        return dataclasses.replace(self, W=W)

    @property
    def window(self) -> int:
        return self.W

    def far_query(self, i):
        return torch.div(i, self.G, rounding_mode="floor") + (self.W - self.W // self.G)

    def far_key(self, j):
        return torch.div(j, self.G, rounding_mode="floor")

    def relative(self, i, j):
        return self_extend_positions(i, j, self.W, self.G)

    def intended_length(self, within):
        return self.G * (within - self.W + self.W // self.G)  # (n - 1) // G + W - W // G <= within - 1


@register_method
@dataclass(frozen=True)
class StringConfig(WindowConfig):
    """STRING (An et al. 2024, arXiv:2410.18745; HKUNLP/STRING): ``rel`` below the shift ``S``, then
    ``rel - S + W`` (the rarely trained largest distances replaced by well-trained ones).

    Defaults ``S = L / 3`` (the paper: 0.25-0.4 L), ``W = min(128, L / 16)`` (the paper: 128). ``rel'`` stays
    below ``L`` while the sequence is shorter than ``L + S - W``: STRING is meant for the trained window,
    or on top of a frequency method beyond it. The reference's extra ``cos/sin`` scaling is not applied.
    """

    method: ClassVar[str] = "string"
    summary: ClassVar[str] = (
        "STRING (An et al. 2024, arXiv:2410.18745; HKUNLP/STRING): relative positions exact below the shift ``S``, "
        "``rel - S + W`` from it on, so the rarely trained largest distances are replaced by well-trained ones."
    )
    far_key_is_position: ClassVar[bool] = True

    S: int | None = option(  # (above W >= 1)
        None, integer(2, optional=True),
        meaning="the shift: relative positions from S on become ``rel - S + W``; None: ``L/3`` (the paper: "
                "0.25-0.4 L)")
    W: int | None = option(
        None, integer(1, optional=True),
        meaning="the local window the shifted positions restart from (below S); None: ``min(128, L/16)`` (the "
                "paper: 128)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.S is not None and self.W is not None and self.W >= self.S:
            raise ValueError(f"{self.method}: W={self.W} must be below S={self.S}; valid: 1..{self.S - 1}")

    def with_defaults(self, original: int) -> StringConfig:
        S = self.S if self.S is not None else max(2, original // 3)
        check_below(self.method, "S", S, original, ORIGINAL, low=2)
        W = self.W if self.W is not None else max(1, min(128, original // 16, S - 1))
        check_below(self.method, "W", W, S, "the shift S")
        return dataclasses.replace(self, S=S, W=W)

    @property
    def window(self) -> int:
        return self.S

    def far_query(self, i):
        return i - (self.S - self.W)

    def far_key(self, j):
        return j

    def relative(self, i, j):
        return string_positions(i, j, self.S, self.W)

    def intended_length(self, within):
        return within + self.S - self.W  # n - 1 - S + W <= within - 1
