"""Learned absolute position tables (GPT-2's ``wpe``) read past their last row.

A table ``p_0 .. p_{N-1}`` (``N`` rows, the trained context) is read at any position ``k`` by:

* ``abs_interp`` -- linear interpolation: ``k`` reads the table at ``x = k / factor``, between rows ``floor(x)``
  and ``floor(x) + 1``; positions ``0 .. factor (N - 1)`` (``factor = 1``: the table itself).
* ``abs_hierarchical`` -- Su's hierarchical decomposition (kexue.fm/archives/7947; bert4keras
  ``PositionEmbedding(hierarchical=True)``): ``u_i = (p_i - a p_0) / (1 - a)`` and
  ``q_k = a u_{k // N} + (1 - a) u_{k mod N}``, ``a = 0.4`` by default; ``q_k = p_k`` for ``k < N`` (the first
  ``N`` rows stay exact); positions ``0 .. N^2 - 1``.
* ``sinusoidal`` -- Vaswani et al.'s table instead of the learned one: ``PE(k, 2i) = sin(k / 10000^(2i/d))``,
  ``PE(k, 2i+1) = cos(k / 10000^(2i/d))``, scaled to the learned table's root mean square (``scale=None``); any
  position.

Each reads the table's own parameter at call time (``embed(table, positions)``), so the model's state dict keeps
the table's key and shape, and a trained table is read as trained.

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import HOOK_ABSOLUTE, MethodConfig, register_method
from rope_ext.methods.options import factor_range, interval, option, positive


class AbsoluteConfig(MethodConfig):
    """Base of the absolute-table methods: ``embed(table [N, d], positions [...]) -> [..., d]`` and
    ``covers(N)``, the number of positions it reaches (``None``: any)."""

    hook: ClassVar[str] = HOOK_ABSOLUTE

    def covers(self, rows: int) -> int | None:
        raise NotImplementedError

    def embed(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check_positions(self, rows: int, positions: torch.Tensor) -> None:
        """Raise ``ValueError`` when ``positions`` go past what the method reaches from ``rows`` rows."""
        limit = self.covers(rows)
        if positions.numel() and limit is not None:
            largest = int(positions.max())
            if largest >= limit:
                raise ValueError(
                    f"{self.method}: position {largest} is past the {limit} positions this method reaches from a "
                    f"{rows}-row table ({_what_reaches(self, rows)})"
                )
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"{self.method}: positions must be >= 0, got {int(positions.min())}")


def _what_reaches(config: AbsoluteConfig, rows: int) -> str:
    if isinstance(config, AbsInterpConfig):
        return f"factor {config.factor:g} reaches factor x (rows - 1) + 1; use a larger factor"
    return "rows^2 positions; abs_interp with a larger factor or sinusoidal reach further"


@register_method
@dataclass(frozen=True)
class AbsInterpConfig(AbsoluteConfig):
    """Linear interpolation of the table to ``factor`` times its positions (position ``k`` reads ``k / factor``)."""

    method: ClassVar[str] = "abs_interp"
    summary: ClassVar[str] = (
        "A learned absolute position table (GPT-2's ``wpe``) read by linear interpolation: position ``k`` reads the "
        "table at ``k / factor``, between two rows, reaching ``factor (N - 1) + 1`` positions from ``N`` rows."
    )

    factor: float = option(
        2.0, factor_range("the table is stretched factor times", "shrink the table", required=False),
        meaning="how many times the table is stretched: position ``k`` reads it at ``k / factor`` (1: the table "
                "itself)")

    def covers(self, rows: int) -> int:
        return int(math.floor(self.factor * (rows - 1) + 1e-9)) + 1

    def embed(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.check_positions(table.shape[0], positions)
        x = positions.to(torch.float64) / self.factor
        low = torch.floor(x).long().clamp(max=table.shape[0] - 1)
        high = (low + 1).clamp(max=table.shape[0] - 1)
        weight = (x - low).to(table.dtype)[..., None]  # [..., 1]
        return table[low] * (1 - weight) + table[high] * weight  # [..., d]


@register_method
@dataclass(frozen=True)
class AbsHierarchicalConfig(AbsoluteConfig):
    """Su's hierarchical decomposition: ``a u_{k // N} + (1 - a) u_{k mod N}``, ``u_i = (p_i - a p_0) / (1 - a)``."""

    method: ClassVar[str] = "abs_hierarchical"
    summary: ClassVar[str] = (
        "Su's hierarchical decomposition of a learned absolute table (kexue.fm/archives/7947): position ``k`` of a "
        "table of ``N`` rows is ``a u_{k // N} + (1 - a) u_{k mod N}``, ``u_i = (p_i - a p_0) / (1 - a)``; the first "
        "``N`` rows stay exact, ``N^2`` positions are reached."
    )

    alpha: float = option(
        0.4, interval(0, 1, high_open=True),
        meaning="``a``, the weight of the coarse row ``u_{k // N}`` against the fine row ``u_{k mod N}`` (Su's 0.4)")

    def covers(self, rows: int) -> int:
        return rows * rows

    def embed(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = table.shape[0]
        self.check_positions(rows, positions)
        u = (table - self.alpha * table[:1]) / (1 - self.alpha)  # [N, d]
        composed = self.alpha * u[positions // rows] + (1 - self.alpha) * u[positions % rows]  # [..., d]
        # (the first N positions are the table's rows; read them as they are, not through rounding)
        return torch.where((positions < rows)[..., None], table[positions.clamp(max=rows - 1)], composed)


def sinusoids(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al.'s table at ``positions``: ``sin`` on even dims, ``cos`` on odd ones -> ``[..., dim]`` (float32)."""
    pairs = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
    angles = positions.to(torch.float64)[..., None] / base ** (pairs / dim)  # [..., ceil(d/2)]
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[..., :dim]
    return table.float()


@register_method
@dataclass(frozen=True)
class SinusoidalConfig(AbsoluteConfig):
    """The sinusoidal table in place of the learned one, times ``scale`` (``None``: the learned table's root mean
    square over the sinusoids', so the embeddings keep their magnitude)."""

    method: ClassVar[str] = "sinusoidal"
    summary: ClassVar[str] = (
        "Vaswani et al.'s sinusoidal table (2017, arXiv:1706.03762) in place of a learned absolute one, scaled to the "
        "learned table's magnitude; it reaches any position."
    )

    scale: float | None = option(
        None, positive(optional=True),
        meaning="the sinusoidal table's multiplier; None: the learned table's root mean square over the sinusoids' "
                "(``sqrt(1/2)``), so the embeddings keep their magnitude")
    base: float = option(
        10000.0, positive(),
        meaning="the sinusoids' base: ``PE(k, 2i) = sin(k / base^(2i/d))``, ``PE(k, 2i+1) = cos(k / base^(2i/d))`` "
                "(Vaswani et al.'s 10000)")

    def covers(self, rows: int) -> None:
        return None

    def embed(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.check_positions(table.shape[0], positions)
        scale = self.scale
        if scale is None:  # the root mean square of a sinusoid is sqrt(1/2)
            scale = float(table.detach().double().pow(2).mean().sqrt()) / math.sqrt(0.5)
        return (scale * sinusoids(positions, table.shape[1], self.base)).to(table.dtype)
