"""The paper's formula, pair by pair: RoPE attention scores at any relative position ``rel'[i, j]``.

With HF's ``rotate_half`` layout, rotary pair ``m`` is dims ``m`` and ``m + r/2`` (``r`` the rotary
dimension; dims past ``r`` are not rotated). Rotating ``q`` by ``a theta_m`` and ``k`` by ``b theta_m``
gives, per pair, ``(q1 k1 + q2 k2) cos((a - b) theta_m) - (q2 k1 - q1 k2) sin((a - b) theta_m)``: the
score depends on the positions only through ``a - b``, so it can be evaluated at a remapped ``rel'``
directly. This builds ``[b, h, q, k, r/2]`` tensors: for tests on tiny shapes, never for real lengths.
"""

from __future__ import annotations

import torch


def remapped_rope_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    rel: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """``q [b, h, n_q, d]`` and ``k [b, h, n_k, d]`` unrotated, ``rel [b, n_q, n_k]`` -> scores ``[b, h, n_q, n_k]``
    (unscaled dot products; the rotated dims carry ``attention_factor ** 2`` as cos and sin do in HF)."""
    half = inv_freq.shape[-1]
    rotary = 2 * half
    q, k = q.to(torch.float64), k.to(torch.float64)
    q1, q2, q_pass = q[..., :half], q[..., half:rotary], q[..., rotary:]
    k1, k2, k_pass = k[..., :half], k[..., half:rotary], k[..., rotary:]
    real = q1[:, :, :, None] * k1[:, :, None] + q2[:, :, :, None] * k2[:, :, None]  # [b, h, q, k, r/2]
    imag = q2[:, :, :, None] * k1[:, :, None] - q1[:, :, :, None] * k2[:, :, None]  # [b, h, q, k, r/2]
    angle = rel.to(torch.float64)[:, None, :, :, None] * inv_freq.to(torch.float64)  # [b, 1, q, k, r/2]
    rotated = (real * angle.cos() - imag * angle.sin()).sum(-1) * attention_factor**2  # [b, h, q, k]
    return rotated + q_pass @ k_pass.transpose(-1, -2)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    allowed: torch.Tensor,
    scaling: float,
    attention_factor: float = 1.0,
    query_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention over ``remapped_rope_scores``; ``allowed [b, n_q, n_k]`` is the causal and padding
    mask, ``query_scale [b, n_q]`` multiplies each query (log-n). GQA: ``k``/``v`` with fewer heads repeat."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = remapped_rope_scores(q, k, rel, inv_freq, attention_factor) * scaling  # [b, h, q, k]
    if query_scale is not None:
        scores = scores * query_scale.to(torch.float64)[:, None, :, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row attends to nothing
    return (weights @ v.to(torch.float64)).to(q.dtype)  # [b, h, q, d]


def method_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method,
    query_scale,
    original: int,
    inv_freq: torch.Tensor,
    attention_factor,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """A method's attention straight from its formula, for unpadded rows (keys at ``0..m-1``, queries the last
    ``n``): ``rel'`` from ``method.relative`` (plain ``i - j`` for ``None``), the causal (and sliding-window)
    mask, and the query multipliers (``query_scale``'s log-n, Dual Chunk Attention's mscale)."""
    n, m = q.shape[2], k.shape[2]
    i = torch.arange(m - n, m, device=q.device)[:, None]
    j = torch.arange(m, device=q.device)[None]
    rel = i - j if method is None else method.relative(i, j)
    allowed = i - j >= 0
    if sliding_window is not None:
        allowed &= i - j < sliding_window
    multiplier = torch.ones(n, dtype=torch.float64, device=q.device)
    if query_scale is not None:
        multiplier = multiplier * query_scale.scale(i[:, 0], original)
    dca_scale = getattr(method, "query_scale", None)
    if dca_scale is not None and dca_scale(i[:, 0], original) is not None:
        multiplier = multiplier * dca_scale(i[:, 0], original)
    return reference_attention(
        q, k, v, rel[None], inv_freq, allowed=allowed[None], scaling=scaling,
        attention_factor=attention_factor, query_scale=multiplier[None],
    )


def two_matrix_attention(q, k, v, *, method, inv_freq, attention_factor, scaling) -> torch.Tensor:
    """The reference repositories' strategy for a window method (ReRoPE's ``rerope_patch.py``): two full
    ``n x n`` score matrices, one with plain RoPE and one with the far rotation, joined by
    ``where(rel < w)``; unpadded rows, queries the last ``n`` keys. Kept to measure the fast path against."""
    from rope_ext.hooks.attention import rotate

    n, m = q.shape[2], k.shape[2]
    q_pos = torch.arange(m - n, m, device=q.device, dtype=torch.float32)
    k_pos = torch.arange(m, device=q.device, dtype=torch.float32)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    near = rotate(q, q_pos, inv_freq, attention_factor) @ rotate(k, k_pos, inv_freq, attention_factor).transpose(-1, -2)
    far_q = rotate(q, method.far_query(q_pos), inv_freq, attention_factor)
    far = far_q @ rotate(k, method.far_key(k_pos), inv_freq, attention_factor).transpose(-1, -2)
    rel = q_pos[:, None] - k_pos[None]
    scores = torch.where(rel < method.window, near, far) * scaling
    scores = scores.masked_fill(rel < 0, float("-inf"))
    return (torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v)
