"""The fast path: exact attention over position regions, merged through the log-sum-exp, never ``n x n``.

A region is a set of (query, key) pairs whose scores use one rotation of the queries and one of the keys.
Queries are taken in tiles; for each tile a region covers a contiguous range of keys, split into a core
that every query of the tile sees (one unmasked call) and edges where a small ``tile x tile`` mask
decides. Each call returns its output and log-sum-exp; ``Accumulator`` merges them:
``out = sum_r exp(lse_r - lse) out_r`` with ``lse = logsumexp_r lse_r``, exactly the softmax over the union.

Calls go to ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` on CPU (it returns the LSE,
takes GQA key/value heads as they are and a float mask), and to a plain matmul-softmax on other devices
or when gradients are needed (the flash op has no derivative for its LSE); both are exact.

Positions here are per row and contiguous: keys at ``0..m-1``, queries at ``q0..q0+n-1`` (the last ``n``
keys). The attention hook compacts padded rows to this form first.
"""

from __future__ import annotations

import torch

#: queries per tile: a tile's edge mask is ``TILE x TILE``
TILE = 512


def _use_flash(q: torch.Tensor, k: torch.Tensor) -> bool:
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and not needs_grad


def lse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [b, h, n, d]`` over ``k, v [b, hk, m, d]`` (``h`` a multiple of ``hk``) with an
    optional ``allowed [n, m]`` bool mask -> ``(out [b, h, n, d] float32, lse [b, h, n] float32)``; a query
    with no allowed key gets ``out = 0``, ``lse = -inf``."""
    if _use_flash(q, k):
        mask = None
        if allowed is not None:
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=False, attn_mask=mask, scale=scale
        )
        out = out.float()
    else:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [b, h, n, m]: one tile's keys only
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        out = weights @ v.float()
    if allowed is not None:
        empty = ~allowed.any(-1)  # [n]
        if bool(empty.any()):
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty[:, None], 0.0)
    return out, lse


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Square causal attention (``n == m``) in one call."""
    if _use_flash(q, k):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=True, scale=scale
        )
        return out.float(), lse
    n = q.shape[2]
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for a in range(0, n, TILE):
        b = min(n, a + TILE)
        out[:, :, a:b], lse[:, :, a:b] = lse_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], scale, allowed[a:b, :b])
    return out, lse


class Accumulator:
    """Running ``(out, lse)`` of the queries; ``add`` merges one call's result into a slice of queries."""

    def __init__(self, q: torch.Tensor, value_dim: int) -> None:
        self.out = torch.zeros(*q.shape[:-1], value_dim, dtype=torch.float32, device=q.device)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)

    def add(self, start: int, stop: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        old_out, old_lse = self.out[:, :, start:stop], self.lse[:, :, start:stop]
        new_lse = torch.logaddexp(old_lse, lse)
        finite = torch.isfinite(new_lse)
        safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
        keep = torch.where(finite, torch.exp(old_lse - safe), torch.zeros_like(safe))
        take = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(safe))
        merged = old_out * keep[..., None] + out * take[..., None]
        if torch.is_grad_enabled() and (merged.requires_grad or self.out.requires_grad):
            self.out, self.lse = self.out.clone(), self.lse.clone()  # autograd keeps the old tensors it saved
        self.out[:, :, start:stop] = merged
        self.lse[:, :, start:stop] = new_lse


def region(
    acc: Accumulator,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q0: int,
    near: int,
    far: int | None,
    key_offset: int = 0,
    tile: int = TILE,
) -> None:
    """Add the pairs ``i - far <= j <= i - near`` (``far=None``: no lower bound) to ``acc``.

    ``q [b, h, n, d]`` holds queries at positions ``q0..q0+n-1``; ``k, v [b, hk, *, d]`` hold keys at
    positions ``key_offset..`` (a region that never reaches early keys gets only the keys it needs).
    """
    n = q.shape[2]
    last_key = key_offset + k.shape[2] - 1
    for a in range(0, n, tile):
        b = min(n, a + tile)
        p0, p1 = q0 + a, q0 + b - 1  # first and last query position of the tile
        lo = key_offset if far is None else max(key_offset, p0 - far)
        hi = min(last_key, p1 - near)
        if hi < lo:
            continue
        lo_core = key_offset if far is None else max(key_offset, p1 - far)
        hi_core = min(last_key, p0 - near)
        if hi_core - lo_core + 1 >= tile:  # a core worth an unmasked call, then the two edges
            pieces = [(lo_core, hi_core, False), (lo, lo_core - 1, True), (hi_core + 1, hi, True)]
        else:
            pieces = [(lo, hi, True)]
        qt = q[:, :, a:b]
        positions = torch.arange(p0, p1 + 1, device=q.device)[:, None]
        for start, stop, masked in pieces:
            if stop < start:
                continue
            allowed = None
            if masked:
                j = torch.arange(start, stop + 1, device=q.device)[None]
                allowed = j <= positions - near
                if far is not None:
                    allowed &= j >= positions - far
            ks, vs = k[:, :, start - key_offset : stop + 1 - key_offset], v[:, :, start - key_offset : stop + 1 - key_offset]
            acc.add(a, b, *lse_attention(qt, ks, vs, scale, allowed))


def chunk_tiles(q0: int, n: int, chunk: int, tile: int = TILE):
    """Query tiles ``(a, b)`` (indices into ``n`` queries at positions ``q0..``) that never cross a chunk."""
    a = 0
    while a < n:
        p = q0 + a
        end_of_chunk = (p // chunk + 1) * chunk
        b = min(n, a + tile, end_of_chunk - q0)
        yield a, b
        a = b
