"""Rotary position embedding itself (pure math): ``(cos, sin)`` tables and the rotation of queries and keys.

HF's ``rotate_half`` convention: rotary pair ``i`` is dims ``i`` and ``i + r/2`` (``r`` the rotary dimension;
dims past ``r`` pass unchanged), ``cos = cat(freqs, freqs).cos() * attention_factor``. Every function here is
bit for bit what transformers' ``apply_rotary_pos_emb`` computes with the tables ``rope_cos_sin`` gives.
"""

from __future__ import annotations

import torch

#: the layouts of cos/sin tables a rotary module may return: transformers' shared ``cat(freqs, freqs)``, adjacent
#: pairs ``repeat_interleave(freqs, 2)`` (Cohere's), one entry a pair ``freqs`` (gpt-oss's); ``complex``: one entry
#: a pair as one complex table ``cos + i sin`` (Llama 4's and DeepSeek-V2's ``freqs_cis``; here its two parts)
LAYOUTS = ("cat", "interleave", "half")
COMPLEX = "complex"


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float | torch.Tensor, layout: str = "cat"
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary contract in float32: ``cat(freqs, freqs).cos() * attention_factor`` and ``sin`` (another
    ``layout`` of ``LAYOUTS``: the same values laid out as that module's attention reads them)."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)  # [b, q, d/2]
    if layout == "cat":
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, q, d]
    elif layout == "interleave":
        emb = torch.repeat_interleave(freqs, 2, dim=-1)  # [b, q, d]: f0 f0 f1 f1 ...
    elif layout in ("half", COMPLEX):
        emb = freqs  # [b, q, d/2]
    else:
        raise ValueError(f"unknown rotary table layout {layout!r}; valid layouts: {', '.join((*LAYOUTS, COMPLEX))}")
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def rotation_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate``'s ``(cos, sin)`` at ``positions`` (``[n]``, or ``[b, n]`` per row) in ``dtype``, shaped to
    broadcast over the heads and both halves: ``[n, 1, r/2]`` (``[b, 1, n, 1, r/2]``)."""
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)  # [(b,) n, r/2]
    cos, sin = freqs.cos(), freqs.sin()
    if not (isinstance(attention_factor, float | int) and attention_factor == 1):  # (times 1 is exact: no launch)
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.to(dtype), sin.to(dtype)
    if positions.dim() == 2:  # per row: [b, 1, n, r/2], broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    return cos.unsqueeze(-2), sin  # (cos [..., n, 1, r/2]: broadcast over both halves)


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor | None,
    inv_freq: torch.Tensor,
    attention_factor,
    out: torch.Tensor | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x [b, h, n, d]`` rotated at ``positions`` (``[n]``, or ``[b, n]`` per row), bit for bit as transformers'
    ``apply_rotary_pos_emb`` computes ``x * cos + rotate_half(x) * sin`` (cos/sin in float32, cast to ``x``'s
    dtype; dims past the rotary dimension pass unchanged), written into ``out`` (a new tensor when ``None``)
    without full-size temporaries: both halves of transformers' cos/sin are the same values, ``(-a) * s == -(a *
    s)`` and ``c + (-p) == c - p`` in IEEE arithmetic, so ``out = x * cos``, then ``out_lo -= x_hi * sin``,
    ``out_hi += x_lo * sin``. ``tables``: ``rotation_tables(positions, inv_freq, attention_factor, x.dtype)``
    made already (``positions`` is then not read)."""
    cos, sin = tables if tables is not None else rotation_tables(positions, inv_freq, attention_factor, x.dtype)
    half = sin.shape[-1]
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
