"""Attention with a bias that depends on the distance alone (T5's relative-position buckets), block by block.

transformers' T5 computes its bias once per stack as a ``[1, heads, q, k]`` tensor and every layer adds it to its
scores (under SDPA as a ``(batch, heads, q, k)`` float mask): memory quadratic in the length. Patched, the layer
that holds the table returns a ``RelativeBias`` instead: the bias as a function of the distance
``rel = key - query``, evaluated here per call on the distances the call needs, one vector per head.

Because the bias is constant along every diagonal (a Toeplitz matrix), a block of queries needs no bias block of
its own: with the keys in reverse order, the bias of queries ``a..b-1`` over the keys is a strided view
``u.as_strided((heads, b - a, keys), (stride, 1, 1))`` of one vector ``u [heads, n + m - 1]`` (``u[:, x]`` the bias
at distance ``rel_max - x``), which the CPU flash op reads as it is (no copy). Softmax does not depend on the keys'
order, so the call's output is unchanged. So an encoder call holds ``O(heads (n + m))`` of bias and reversed copies
of its keys and values; a causal (decoder) call takes the keys before each block of queries the same way and each
block's causal square with its ``[heads, t, t]`` bias written out.

A module without positions (T5's cross-attention) runs plain attention over the unpadded keys. Positions are by
slot, as transformers' T5 counts them (pads included), so a padded row keeps its keys where they are: a row whose
kept keys are one contiguous span (right or left padding) takes the strided path over that span, any other row
writes its bias out block by block.

What is linear is inference on the CPU. Elsewhere the same calls run, but: CUDA's memory-efficient op takes each
block's bias written out (``[heads, 1024, keys]``, in the call's dtype); training records the calls and its
backward writes out each view's gradient (``rope_ext.attention.recorder``: ``[heads, t, keys]`` per call, all of
them held until autograd reduces them onto the table, so ``heads x n x m`` per layer, as transformers' own bias
gradient is), and dropout runs the matmul path, which keeps every tile's scores for autograd.

Pure torch: nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rope_ext.attention.dispatch import accumulation_dtype, flushed_denormals
from rope_ext.attention.merge import Accumulator
from rope_ext.attention.program import Call, Kernel, Term, register_kernel
from rope_ext.attention.recorder import Recorder

#: queries per call over the keys every one of them sees (the CPU flash op works in 256-query splits from 768 on)
RELATIVE_BLOCK = 1024
#: queries per causal square (its bias written out: ``[heads, square, square]``)
RELATIVE_SQUARE = 256
#: a call whose whole bias ``[heads, n, m]`` has at most this many elements writes it out (decode, short calls)
DENSE_ELEMENTS = 1 << 20
#: elements of one written-out bias block (rows with holes in their padding)
DENSE_BLOCK_ELEMENTS = 1 << 23


@dataclass(eq=False)
class RelativeBias:
    """A bias that depends on ``rel = key position - query position`` only, as a patched T5 ``compute_bias`` returns
    it: ``values(rel) -> [heads, len]`` (``rel`` a 1D long tensor), the queries at ``past..past+query_length-1``,
    the keys at ``0..key_length-1``. ``dense()`` is the ``[1, heads, q, k]`` tensor transformers would make."""

    values: Callable[[torch.Tensor], torch.Tensor]
    query_length: int
    key_length: int
    past: int = 0
    device: Any = None

    def at(self, rel: torch.Tensor) -> torch.Tensor:
        """``rel`` of any shape (long) -> ``[heads, *rel.shape]``."""
        return self.values(rel.reshape(-1)).unflatten(-1, rel.shape)

    def dense(self) -> torch.Tensor:
        """``[1, heads, query_length, key_length]``: the bias written out (tests, references)."""
        q = torch.arange(self.query_length, device=self.device)[:, None] + self.past
        k = torch.arange(self.key_length, device=self.device)[None]
        return self.at(k - q)[None]

    def __repr__(self) -> str:
        return f"RelativeBias(queries {self.past}..{self.past + self.query_length - 1}, keys 0..{self.key_length - 1})"


class NoPositions:
    """What a module without positions receives instead of transformers' zeros (T5's cross-attention)."""

    def __repr__(self) -> str:
        return "NoPositions()"


NO_POSITIONS = NoPositions()


@dataclass(eq=False)
class RelativeAttention(Term):
    """A T5 attention module: its scores plus the ``RelativeBias`` the model passes (``Call.position_bias``) over
    ``causal`` or bidirectional pairs, or, without ``positions`` (cross-attention), plain attention."""

    causal: bool
    positions: bool = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return "relative bias" if self.positions else "no positions"

    def describe(self) -> str:
        if not self.positions:
            return "plain (no positions)"
        return f"{'causal' if self.causal else 'bidirectional'} relative bias, block by block"


def run_relative(call: Call) -> torch.Tensor:
    """The output ``[b, h, n, dv]`` of one T5 attention call (see the module's docstring)."""
    (term,) = call.program.of_type(RelativeAttention)
    q, k, v = call.q, call.k, call.v
    n, m = q.shape[2], k.shape[2]
    if not term.positions:
        return _unbiased(call)
    bias = call.position_bias
    if not isinstance(bias, RelativeBias):
        raise ValueError(
            f"rope_ext's T5 attention takes the bias its patched compute_bias returns (a RelativeBias); got "
            f"{type(bias).__name__}: a position_bias made outside the patch is not supported"
        )
    if (bias.query_length, bias.key_length) != (n, m):
        raise ValueError(f"the relative bias is for {bias.query_length} queries over {bias.key_length} keys; the call "
                         f"has {n} over {m}")
    q_pos = torch.arange(bias.past, bias.past + n, device=q.device)
    with flushed_denormals(q.device):
        if call.rows is None:
            return _attend(call, q, k, v, bias, q_pos, 0, m, None, term.causal)
        rows = []
        for r in range(q.shape[0]):
            kept = call.rows[r].nonzero().squeeze(-1)
            if kept.numel() == 0:  # (every key padded: no key to attend to)
                rows.append(torch.zeros(q.shape[1], n, v.shape[-1], dtype=q.dtype, device=q.device))
                continue
            first, last = int(kept[0]), int(kept[-1]) + 1
            one = slice(r, r + 1)
            if last - first == kept.numel():  # one span: its keys in place
                rows.append(_attend(call, q[one], k[one, :, first:last], v[one, :, first:last], bias, q_pos,
                                    first, last, None, term.causal)[0])
            else:
                rows.append(_attend(call, q[one], k[one][:, :, kept], v[one][:, :, kept], bias, q_pos, first, last,
                                    kept, term.causal)[0])
        return torch.stack(rows)


def _unbiased(call: Call) -> torch.Tensor:
    """Plain bidirectional attention over the unpadded keys (a module without positions): torch's SDPA with the
    padding as a ``[b, 1, 1, m]`` mask; a row with every key padded gets zeros."""
    mask = None if call.rows is None else call.rows[:, None, None, :]
    out = F.scaled_dot_product_attention(
        call.q, call.k, call.v, attn_mask=mask, dropout_p=call.dropout, scale=call.scale, enable_gqa=True
    )
    if call.rows is not None and not bool(call.rows.any(-1).all()):
        out = out.masked_fill(~call.rows.any(-1)[:, None, None, None], 0.0)
    return out


def _accumulator(call: Call, q, k, v, values: torch.Tensor):
    """Dropout in training (weights dropped as autograd runs them), the recorded calls of a training step (one
    backward: queries, keys, values or the bias table needing gradients), or the merging accumulator."""
    if call.dropout:
        return Accumulator(q, v.shape[-1], call.dropout)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, values)):
        return Recorder(q, v.shape[-1])
    return Accumulator(q, v.shape[-1])


def _attend(call: Call, q, k, v, bias: RelativeBias, q_pos, first: int, last: int, kept, causal: bool) -> torch.Tensor:
    """Queries at ``q_pos`` (consecutive) over keys at ``first..last-1`` (``kept``: only those positions, the keys
    given compacted; ``None``: all of them)."""
    n, keys, heads = q.shape[2], k.shape[2], q.shape[1]
    if kept is not None or heads * n * keys <= DENSE_ELEMENTS:
        k_pos = torch.arange(first, last, device=q.device) if kept is None else kept
        acc = _accumulator(call, q, k, v, bias.at(k_pos[:1] - q_pos[:1]))
        _dense_blocks(acc, q, k, v, call.scale, bias, q_pos, k_pos, causal)
    else:
        q0 = int(q_pos[0])
        rel_max = last - 1 - q0  # the largest distance: the last key from the first query
        # [h, n + keys - 1], in the scores' dtype (a bf16 view converted per call would be written out block-sized)
        u = bias.values(rel_max - torch.arange(n + keys - 1, device=q.device))
        u = u.to(accumulation_dtype(q.dtype)).contiguous()
        acc = _accumulator(call, q, k, v, u)
        _toeplitz_blocks(acc, q, k, v, call.scale, u, q0, first, causal)
    return acc.out.to(q.dtype)


def _toeplitz_blocks(acc, q, k, v, scale: float, u: torch.Tensor, q0: int, k0: int, causal: bool) -> None:
    """Queries at ``q0..q0+n-1`` over keys at ``k0..k0+keys-1`` with the bias ``u[:, x]`` at distance
    ``rel_max - x`` (``rel_max = k0 + keys - 1 - q0``): calls of ``RELATIVE_BLOCK`` queries over the keys every one
    of them sees, on the keys reversed with the bias a strided view of ``u``; causal, each block's rows then in
    squares of ``RELATIVE_SQUARE``: a call over the block's keys before the square, and the square with its bias
    written out and the causal mask."""
    n, keys, heads = q.shape[2], k.shape[2], q.shape[1]
    end = k0 + keys
    rel_max = end - 1 - q0
    k_rev, v_rev = k.flip(2), v.flip(2)  # (key j at index end - 1 - j)

    def seen(a: int, b: int, lo: int, hi: int) -> None:  # queries a..b-1 over the keys at lo..hi-1, every pair
        lo, hi = max(lo, k0), min(hi, end)
        if hi <= lo:
            return
        c0, c1 = end - hi, end - lo  # their indices reversed; query r, index c: distance rel_max - (r + c)
        view = u.as_strided((heads, b - a, c1 - c0), (u.stride(0), 1, 1), u.storage_offset() + a + c0)
        acc.attend(a, b, q[:, :, a:b], k_rev[:, :, c0:c1], v_rev[:, :, c0:c1], scale, 0, bias=view)

    for a in range(0, n, RELATIVE_BLOCK):
        b = min(n, a + RELATIVE_BLOCK)
        if not causal:
            seen(a, b, k0, end)
            continue
        seen(a, b, k0, q0 + a)
        for s in range(a, b, RELATIVE_SQUARE):
            e = min(b, s + RELATIVE_SQUARE)
            seen(s, e, q0 + a, q0 + s)
            lo, hi = max(k0, q0 + s), min(end, q0 + e)
            if hi <= lo:
                continue
            rel = torch.arange(lo, hi, device=q.device)[None] - torch.arange(q0 + s, q0 + e, device=q.device)[:, None]
            acc.attend(s, e, q[:, :, s:e], k[:, :, lo - k0 : hi - k0], v[:, :, lo - k0 : hi - k0], scale, 0,
                       rel <= 0, bias=u[:, rel_max - rel])


def _dense_blocks(acc, q, k, v, scale: float, bias: RelativeBias, q_pos, k_pos, causal: bool) -> None:
    """The bias written out per block of queries (``[heads, t, keys]`` within ``DENSE_BLOCK_ELEMENTS``), with the
    causal mask by position."""
    n, keys = q.shape[2], k.shape[2]
    block = max(1, min(n, DENSE_BLOCK_ELEMENTS // max(1, q.shape[1] * keys)))
    for a in range(0, n, block):
        b = min(n, a + block)
        rel = k_pos[None] - q_pos[a:b, None]  # [t, keys]
        allowed = rel <= 0 if causal else None
        if allowed is not None and not bool(allowed.any()):
            continue
        acc.attend(a, b, q[:, :, a:b], k, v, scale, 0, allowed, bias=bias.at(rel))


RELATIVE_KERNEL = register_kernel(
    Kernel("relative bias (T5)", RelativeAttention, run_relative, rank=40, handles=(RelativeAttention,))
)
