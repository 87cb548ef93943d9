"""The plain kernel: causal attention on queries and keys as the model rotated them, with the program's query
scales and additive biases, block by block (never a ``[heads, n, n]`` bias).

A bias with a key-only form (``KeyOnlyBias``: ALiBi's ``m (j - c)``) adds one ``[heads, 1, keys]`` row per query
block instead of a block of its own; for inference the calls are arranged so that no value grows with the block
(``KEY_BIAS_FAR_BLOCK``, ``KEY_BIAS_BLOCK``). Other biases are written out per query block within a memory budget
(``BIAS_BLOCK_ELEMENTS``). Rows whose positions jump take the general path (``blocks.masked_blocks``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import rope_ext.attention.blocks as blocks
import rope_ext.attention.dispatch as dispatch
import rope_ext.attention.flex as flex
import rope_ext.attention.kernels as kernels
from rope_ext.attention.merge import Accumulator
from rope_ext.attention.program import Bias, Call, Kernel, QueryScale, RowGroup, register_kernel

#: queries per block when the biases have a key-only form (its values grow with the block: ALiBi's by the slope
#: times the block length, kept small against the scores' float32 precision); on the inference path, queries per
#: causal square (whose bias is the whole one, rows and keys) and per call over the keys before it in its far block
KEY_BIAS_BLOCK = 256
#: queries per far call of the inference path with key-only biases: every query of the block against the keys
#: before it (the CPU flash op works in 256-query splits from 768 queries on, in 32- or 64-query ones below)
KEY_BIAS_FAR_BLOCK = 1024
#: elements of one query block's bias ``[heads, block, keys]`` (float32) for biases without a key-only form
BIAS_BLOCK_ELEMENTS = 1 << 23


class KeyBias:
    """The sum of a program's biases in their key-only forms (``Bias.key_bias``): for causal pairs ``j <= i``,
    ``bias(i, j) = keys(c, j) + rows(c, i)``, both taken relative to a position ``c <= i``. Calling it
    ``(i, j) -> [h, 1, m]`` gives ``keys`` relative to the block's first query ``i[0]``."""

    def __init__(self, biases: list[Bias]) -> None:
        self.biases = biases

    def keys(self, c: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """``[h, 1, m]``: the key part at positions ``j`` relative to ``c`` (a 0-d float32 position)."""
        out = self.biases[0].key_bias(c, j)
        for term in self.biases[1:]:
            out = out + term.key_bias(c, j)
        return out.float()

    def rows(self, c: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """``[h, n]``: the per-query part at positions ``i >= c``, ``bias(i, c) - keys(c, c)`` (what a call that
        added ``keys`` alone adds to its log-sum-exp to be merged with calls that added the whole bias)."""
        at = c.reshape(1)
        out = self.biases[0].bias(i, at) - self.biases[0].key_bias(c, at)
        for term in self.biases[1:]:
            out = out + term.bias(i, at) - term.key_bias(c, at)
        return out.float()[..., 0]  # [h or 1, n]

    def __call__(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return self.keys(i[0], j)


def key_bias_function(call: Call) -> KeyBias | None:
    """The biases' key-only forms (``KeyBias``), or ``None`` when a bias declares none (``Bias.has_key_bias``:
    ``KeyOnlyBias``). For causal rows at positions ``0..m-1`` only (``i`` a contiguous block)."""
    biases = call.program.of_type(Bias)
    if not biases or not all(term.has_key_bias for term in biases):
        return None
    return KeyBias(biases)


def bias_block(q: torch.Tensor, keys: int, key_only: bool) -> int:
    """Queries per block of a plain call with biases: ``KEY_BIAS_BLOCK`` with key-only forms, else as many as keep
    the block's bias within ``BIAS_BLOCK_ELEMENTS`` (at least 16), never more than ``kernels.query_block``."""
    if key_only:
        return min(kernels.query_block(q), KEY_BIAS_BLOCK)
    return min(kernels.query_block(q), max(16, BIAS_BLOCK_ELEMENTS // max(1, q.shape[1] * keys)))


def _key_bias_blocks(acc: Accumulator, q, k, v, scale: float, q0: int, bias, key_bias: KeyBias) -> None:
    """Causal attention of ``q`` (positions ``q0..``, indices of the keys ``k, v``) with biases that have key-only
    forms, for inference: far blocks of ``KEY_BIAS_FAR_BLOCK`` queries, each one call over every key before it
    (``key_bias.keys`` relative to the block's first query), then its rows in squares of ``KEY_BIAS_BLOCK``: one
    call over the block's keys before the square (relative to the square's first query) and the causal square with
    the whole bias ``bias(i, j)``. Each call's values near its rows' largest are small (none grows with the
    block, so none loses float32 digits), and a call that added key parts only has its log-sum-exp moved by
    ``key_bias.rows`` before the merge."""
    n, device = q.shape[2], q.device

    def positions(lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi, device=device, dtype=torch.float32)

    def before(a: int, b: int, lo: int, c: int) -> None:  # queries a..b-1 against the keys lo..c-1, c = q0 + a
        if c > lo:
            at = torch.tensor(float(c), device=device)
            acc.attend(a, b, q[:, :, a:b], k[:, :, lo:c], v[:, :, lo:c], scale, lo,
                       bias=key_bias.keys(at, positions(lo, c)), lse_shift=key_bias.rows(at, positions(q0 + a, q0 + b)))

    for a in range(0, n, KEY_BIAS_FAR_BLOCK):
        b = min(n, a + KEY_BIAS_FAR_BLOCK)
        before(a, b, 0, q0 + a)
        for s in range(a, b, KEY_BIAS_BLOCK):
            e = min(b, s + KEY_BIAS_BLOCK)
            before(s, e, q0 + a, q0 + s)
            i = positions(q0 + s, q0 + e)
            acc.attend(s, e, q[:, :, s:e], k[:, :, q0 + s : q0 + e], v[:, :, q0 + s : q0 + e], scale, q0 + s,
                       causal=True, bias=bias(i, i))


# --- plain attention (queries and keys as they arrive) ------------------------------------------------


def run_plain(call: Call) -> torch.Tensor:
    """Causal attention (within the layer's sliding window) on queries and keys as the model rotated them,
    with the program's query scales and biases. Positions by index, as transformers' masks take them; a bias
    sees the rows' positions."""
    bias = blocks.bias_function(call)
    far_limit = None if call.sliding_window is None else call.sliding_window - 1
    if _fused(call, bias):
        return F.scaled_dot_product_attention(
            call.q, call.k, call.v, dropout_p=call.dropout, is_causal=True, scale=call.scale, enable_gqa=True
        )  # [b, h, n, dv]

    key_only = None if bias is None else key_bias_function(call)
    of_distance = bias is not None and all(term.of_distance for term in call.program.of_type(Bias))

    def attend(group: RowGroup) -> torch.Tensor:
        q, k, v = blocks.scaled_queries(call, group), group.k, group.v
        n, m = q.shape[2], k.shape[2]
        acc = blocks.accumulator_for(call, q, k, v, bias)
        inference = type(acc) is Accumulator and not acc.dropout  # (not decode, not recorded for training)
        if of_distance and group.contiguous and far_limit is None and inference and n > 1 and flex.available(q, k, v):
            # (CUDA: one fused call, see flex; a closed form of the distance computed, else (or where that compile
            # failed) read from a table)
            form = flex.closed_form(call.program.of_type(Bias), q.device, q.shape[1])
            out = None if form is None else flex.distance_biased(q, k, v, call.scale, form=form)
            if out is None:
                out = flex.distance_biased(q, k, v, call.scale, flex.distance_table(bias, m, q.device, q.shape[1]))
            if out is not None:
                return out
        if key_only is not None and group.contiguous and far_limit is None and inference:
            _key_bias_blocks(acc, q, k, v, call.scale, m - n, bias, key_only)
        elif group.contiguous or bias is None:
            q0 = m - n
            start = 0 if far_limit is None else max(0, q0 - far_limit)
            block_bias = bias if key_only is None or not group.contiguous else key_only
            # (a bias block per query block: [h, 1, keys] for a key-only form, else within a memory budget)
            block = n if bias is None else bias_block(q, m - start, block_bias is key_only)
            for a in range(0, n, block):
                b = min(n, a + block)
                kernels.region(
                    acc, q[:, :, a:b], k[:, :, start:], v[:, :, start:], call.scale, q0 + a, 0, far_limit, start,
                    kernels.TILE, out_offset=a, bias=block_bias,
                )
        else:  # positions with jumps: the causal (sliding) pairs by index, the bias at the rows' positions
            blocks.masked_blocks(acc, q, k, v, call.scale, group, [(None, None, None)], bias, far_limit)
        return acc.out.to(q.dtype)

    if bias is None:
        return call.run_rows(attend)
    with dispatch.flushed_denormals(call.q.device):  # (a distance bias makes far weights denormal: slow on CPU)
        return call.run_rows(attend)


def _fused(call: Call, bias) -> bool:
    """A plain causal call with nothing of the program's inside it (no bias, no query scale, no padding, no cached
    prefix, no window, positions the keys' own): torch's fused attention runs it, forward and backward (the
    blockwise kernel keeps every block's scores for autograd). What a wrapper's regrouped calls are: S2-Attn."""
    n, m = call.q.shape[2], call.k.shape[2]
    return (
        bias is None
        and n == m
        and call.rows is None
        and call.sliding_window is None
        and not call.program.of_type(QueryScale)
        and call.custom_positions() is None
    )


PLAIN_KERNEL = register_kernel(Kernel("plain attention", None, run_plain, rank=0, handles=(Bias,)))
BIAS_KERNEL = register_kernel(Kernel("blockwise attention with biases", Bias, run_plain, rank=10, handles=(Bias,)))
