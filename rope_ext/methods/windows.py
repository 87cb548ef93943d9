"""Relative-position remappings of the attention-rewrite methods (pure math; their configs are in
``rope_ext.methods.window_rules`` and ``dual_chunk``, the hook that installs them comes with the attention kind).

Notation: ``i`` query position, ``j`` key position, ``rel = i - j`` (causal: ``rel >= 0``), ``L`` the
original context. Each method keeps RoPE's scores but evaluates them at a remapped relative position
``rel'``; every mapping below is piecewise ``(query position) - (key position)``, so a fast path can
rotate q and k once per region and merge the regions (see ``rope_ext.attention``).

* ReRoPE (Su 2023, bojone/rerope ``rerope_patch.py``): ``rel' = min(rel, w)``.
* Leaky ReRoPE (same repository, ``leaky_rerope_patch.py``): ``rel`` below ``w``, else
  ``w + (rel - w) / k``.
* Self-Extend (Jin et al. 2024, arXiv:2401.01325; datamllab/LongLM): ``rel`` below the neighbour window
  ``W``, else ``(i // G + W - W // G) - j // G`` (grouped positions, shifted to join the window).
* STRING (An et al. 2024, arXiv:2410.18745; HKUNLP/STRING): ``rel`` below the shift ``S``, else
  ``rel - S + W`` (distant positions replaced by well-trained small ones).

log-n scaling (Su 2021; in ReRoPE's patch), queries times ``max(1, ln(i + 1) / ln L)``, is a query scale, not a
mapping: ``LogNConfig.scale`` in ``rope_ext.methods.query_scales``.

Checked against the formulas collected in the project's REFERENCES.md (from the repositories named).
Positions broadcast: ``i`` shaped ``[..., q, 1]`` and ``j`` ``[..., 1, k]`` give ``[..., q, k]``.
"""

from __future__ import annotations

import math

import torch


def _check_window(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def rerope_positions(i: torch.Tensor, j: torch.Tensor, window: int) -> torch.Tensor:
    """``min(i - j, w)``."""
    _check_window("window", window)
    rel = i - j
    return torch.where(rel < window, rel, torch.full_like(rel, window))


def leaky_rerope_positions(i: torch.Tensor, j: torch.Tensor, window: int, slope: float) -> torch.Tensor:
    """``rel`` below ``w``, then ``w + (rel - w) / k`` (``k = slope``; ``k = 1`` is plain RoPE)."""
    _check_window("window", window)
    _check_window("slope", slope)
    rel = (i - j).to(torch.float64)
    return torch.where(rel < window, rel, window + (rel - window) / slope)


def self_extend_positions(i: torch.Tensor, j: torch.Tensor, neighbor_window: int, group: int) -> torch.Tensor:
    """``rel`` below ``W``, then ``(i // G + W - W // G) - j // G`` (``G = 1`` is plain RoPE)."""
    _check_window("neighbor_window", neighbor_window)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be an int >= 1, got {group!r}")
    rel = i - j
    grouped = (i // group + neighbor_window - neighbor_window // group) - j // group
    return torch.where(rel < neighbor_window, rel, grouped)


def string_positions(i: torch.Tensor, j: torch.Tensor, shift: int, local: int) -> torch.Tensor:
    """``rel`` below ``S``, then ``rel - S + W`` (``S`` beyond every distance is plain RoPE)."""
    _check_window("shift", shift)
    _check_window("local", local)
    rel = i - j
    return torch.where(rel < shift, rel, rel - shift + local)


def dca_positions(i: torch.Tensor, j: torch.Tensor, chunk_size: int, local_window: int) -> torch.Tensor:
    """Dual Chunk Attention's ``rel'`` with chunks of ``s = chunk_size - local_window`` positions; keys sit at
    ``j mod s``. Same chunk: the query at ``i mod s``; the previous chunk: at ``min(i mod s + s, chunk_size)``;
    older chunks: at ``chunk_size``. Every ``rel'`` stays at most ``chunk_size``."""
    _check_window("chunk_size", chunk_size)
    _check_window("local_window", local_window)
    s = chunk_size - local_window
    if s <= 0:
        raise ValueError(f"local_window must be below chunk_size, got {local_window!r} >= {chunk_size!r}")
    chunk_i, chunk_j = i // s, j // s
    intra = i % s
    successive = torch.clamp(i % s + s, max=chunk_size)
    older = torch.full_like(i, chunk_size)
    query = torch.where(chunk_i == chunk_j, intra, torch.where(chunk_i == chunk_j + 1, successive, older))
    return query - j % s
