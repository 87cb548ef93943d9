"""Position rules: the attention-rewrite methods' bases (hook kind ``attention``).

A position rule leaves the rotary frequencies alone (a frequency method may supply them: ``["yarn", "dca"]``) and
changes which relative position ``rel'`` each query-key pair sees. Every rule is, region by region,
``(query position) - (key position)``: within a window of recent keys plain RoPE, beyond it the query and the key
rotated at remapped positions. ``rope_ext.attention`` evaluates the regions as exact attention calls merged through
their log-sum-exp, so no ``n x n`` matrix is built; the mappings themselves are in ``rope_ext.methods.windows`` and
the plain reference in ``rope_ext.attention.reference``.

* ``PositionRuleConfig`` -- every rule: ``relative(i, j)`` (the reference's ``rel'``) and ``regions()`` (the fast
  path's form of it);
* ``WindowConfig`` -- a window rule: plain RoPE below ``window``, the far rotation (``far_query``, ``far_key``)
  beyond; it runs on the window fast runner (``rope_ext.attention.rules``);
* ``WindowRule`` -- a window rule whose window is its option ``w``: what a new window rule subclasses.

The rules are in ``window_rules`` (ReRoPE, Leaky ReRoPE, Self-Extend, STRING) and ``dual_chunk`` (DCA). Options left
at ``None`` are derived from the original context ``L`` when the method is installed (``resolved(L)``); the
defaults follow each paper's reference code, scaled to ``L``. ``L`` is the rotation's (a frequency method's stated
one, else the model config's) unless the method states its own ``original_max_position_embeddings``.

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import HOOK_POSITION_RULE, MethodConfig
from rope_ext.methods.options import context_length, integer, option

ORIGINAL = "the original context L"


def check_below(method: str, name: str, value: int, limit: int, what: str, low: int = 1) -> None:
    """A derived or given option ``low <= value < limit`` (``limit``: ``what``, e.g. ``L``), at resolution."""
    if limit <= low:
        raise ValueError(
            f"{method}: {name} must be {low}..{what} - 1, so {what} must be >= {low + 1}; got {limit}"
        )
    if value >= limit:
        raise ValueError(f"{method}: {name}={value} must be below {what} ({limit}); valid: {low}..{limit - 1}")


def check_within(method: str, name: str, value: float, original: int, low: int = 1) -> None:
    """An option at most ``L`` (``original``), at resolution."""
    if value > original:
        raise ValueError(f"{method}: {name}={value} exceeds the original context L={original}; valid: {low}..{original}")


@dataclass(frozen=True)
class Region:
    """A set of (query, key) pairs scored with one rotation of each: pairs where ``allowed(i, j)`` holds
    (broadcasting float positions; ``None``: every causal pair), the query rotated at ``query(i)`` and the key at
    ``key(j)``. A rule's regions partition the causal pairs ``j <= i``."""

    allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    query: Callable[[torch.Tensor], torch.Tensor]
    key: Callable[[torch.Tensor], torch.Tensor]


def same_position(positions: torch.Tensor) -> torch.Tensor:
    """A rotation at the positions themselves (plain RoPE's)."""
    return positions


def plain_regions() -> list[Region]:
    """Plain RoPE: every pair, the query and the key at their own positions."""
    return [Region(None, same_position, same_position)]


@dataclass(frozen=True)
class PositionRuleConfig(MethodConfig):
    """Base of the position rules, the methods that rewrite attention (hook kind ``position_rule``)."""

    hook: ClassVar[str] = HOOK_POSITION_RULE

    original_max_position_embeddings: int | None = option(
        None, context_length(), kw_only=True,
        meaning="``L``, the original context the defaults are derived from and checked against; None: the "
                "rotation's (a frequency method's stated one, else the model config's)")

    def resolved(self, original: int) -> PositionRuleConfig:
        """This config with the options left at ``None`` derived from ``L`` (its own
        ``original_max_position_embeddings``, else ``original``), checked against it; the result states its ``L``."""
        length = self.original_max_position_embeddings or original
        return dataclasses.replace(self.with_defaults(length), original_max_position_embeddings=length)

    def with_defaults(self, original: int) -> PositionRuleConfig:
        """This config with its ``None`` options derived from ``L`` = ``original`` and checked against it (a rule
        with such options overrides it)."""
        return self

    @property
    def original(self) -> int:
        """``L`` of a resolved config."""
        if self.original_max_position_embeddings is None:
            raise ValueError(f"{self.method}: not resolved against a model's original context yet (resolved(L))")
        return self.original_max_position_embeddings

    def relative(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """``rel'`` at query positions ``i`` and key positions ``j`` (broadcasting); the reference's input."""
        raise NotImplementedError

    def regions(self) -> list[Region]:
        """The regions of a resolved config (the fast path's form of ``relative``)."""
        raise NotImplementedError

    def intended_length(self, within: int) -> int | None:
        """The longest sequence whose remapped distances all stay below ``within`` (the distances the rotation
        was trained on: ``L``, or a frequency method's extended length), for a resolved config; ``None``: any."""
        return None


#: the name before 0.2
AttentionConfig = PositionRuleConfig


@dataclass(frozen=True)
class WindowConfig(PositionRuleConfig):
    """Plain RoPE for ``rel < window``; beyond it the query rotated at ``far_query(i)`` and the key at
    ``far_key(j)`` (positions as float tensors). Its subclasses run on the window fast runner
    (``rope_ext.attention.rules.register_fast_runner``)."""

    #: keys whose far position is their own (the band's rotation serves both regions)
    far_key_is_position: ClassVar[bool] = False
    #: keys whose far position is 0 (unrotated, times the attention factor)
    far_key_is_zero: ClassVar[bool] = False

    @property
    def window(self) -> int:
        raise NotImplementedError

    def far_query(self, i: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def far_key(self, j: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _near(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return i - j < self.window

    def _far(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return i - j >= self.window

    def regions(self) -> list[Region]:
        return [Region(self._near, same_position, same_position), Region(self._far, self.far_query, self.far_key)]


@dataclass(frozen=True)
class WindowRule(WindowConfig):
    """A window rule whose window is its option ``w`` (default ``L / 4``, the ReRoPE README's w=1024 at L=4096;
    ``1 <= w < L``): plain RoPE below it, the far rotation beyond.

    A new window rule subclasses it, registers it (``register_method``) and defines ``far_query(i)``,
    ``far_key(j)`` (the far region's rotations, on float positions) and ``relative(i, j)`` (``rel'``, for the plain
    reference); it runs on the window fast runner unless it registers one of its own."""

    w: int | None = option(
        None, integer(1, optional=True),
        meaning="the window: keys closer than w are plain RoPE, farther ones take the rule's far positions; None: "
                "``L/4`` (``1 <= w < L``)")

    def with_defaults(self, original: int) -> WindowRule:
        w = self.w if self.w is not None else max(1, original // 4)
        check_below(self.method, "w", w, original, ORIGINAL)
        return dataclasses.replace(self, w=w)

    @property
    def window(self) -> int:
        return self.w
