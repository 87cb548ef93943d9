"""The kernels of attention programs: plain attention (with biases and query scales) and position rules.

A position rule keeps RoPE's scores but evaluates them at remapped positions; every rule is, region by region,
``(query rotated at one position) . (key rotated at another)``, so each region is an exact attention call on
rotated copies and the regions merge through their log-sum-exp (``kernels.Accumulator``), never ``n x n``.

* Rows whose positions are the keys' own (``0..m-1``, the common case) take the rule's fast runner from
  ``FAST_RUNNERS`` (keyed by the rule's class: windows, chunks, plain RoPE): region kernels over index ranges,
  with the rotated keys kept on the cache while decoding (``key_cache``).
* Other rows (``position_ids`` with jumps, offsets) take the general path: the rule's ``regions()`` (pair
  predicate, query rotation, key rotation) as explicitly masked calls over query blocks.

Biases are added block by block (``Bias.bias(q_pos, k_pos)``), query scales multiply the queries first. A pair
scale (xPos) runs plain RoPE with queries and keys scaled per rotary pair relative to each query block's first
position, so no factor overflows however long the sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rope_ext.attention import kernels
from rope_ext.attention.key_cache import NOWHERE, KeyRotation
from rope_ext.attention.program import Bias, Call, Kernel, PairScale, PositionRule, QueryScale, RowGroup, register_kernel
from rope_ext.methods.attention import DualChunkConfig, WindowConfig, plain_regions
from rope_ext.methods.rope import rotate, rotate_at_zero


def query_multiplier(call: Call, q_pos: torch.Tensor) -> torch.Tensor | None:
    """The product of the program's query scales at ``q_pos`` (float32 ``[n]``), or ``None``."""
    product = None
    for term in call.program.of_type(QueryScale):
        factor = term.multiplier(q_pos)
        product = factor if product is None else product * factor
    return None if product is None else product.float()


def bias_function(call: Call):
    """``(i, j) -> [h or 1, n, m]``: the sum of the program's biases at query positions ``i``, key positions ``j``
    (``None`` without biases)."""
    biases = call.program.of_type(Bias)
    if not biases:
        return None

    def total(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        out = biases[0].bias(i, j)
        for term in biases[1:]:
            out = out + term.bias(i, j)
        return out.float()

    return total


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
    """The biases' key-only forms (``KeyBias``), or ``None`` when a bias has none (``has_key_bias``). For causal
    rows at positions ``0..m-1`` only (``i`` a contiguous block)."""
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


def _key_bias_blocks(acc: kernels.Accumulator, q, k, v, scale: float, q0: int, bias, key_bias: KeyBias) -> None:
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


def _scaled(call: Call, group: RowGroup) -> torch.Tensor:
    multiplier = query_multiplier(call, group.q_pos)
    return group.q if multiplier is None else group.q * multiplier.to(group.q.dtype)[:, None]


def _accumulator(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias=None):
    """Decode's one score row, the recorded calls of a training step (one backward from the merged log-sum-exp:
    queries, keys, values or a learnable ``bias`` needing gradients), or the merging accumulator (dropout in
    training: each call's weights dropped as autograd runs them)."""
    if call.dropout:
        return kernels.Accumulator(q, v.shape[-1], call.dropout)
    if kernels.SingleQuery.applies(q, k):
        return kernels.SingleQuery(q, v)
    if torch.is_grad_enabled():
        one = torch.zeros(1, device=q.device)
        if q.requires_grad or k.requires_grad or v.requires_grad or bias is not None and bias(one, one).requires_grad:
            return kernels.Recorder(q, v.shape[-1])
    return kernels.Accumulator(q, v.shape[-1])


# --- plain attention (queries and keys as they arrive) ------------------------------------------------


def run_plain(call: Call) -> torch.Tensor:
    """Causal attention (within the layer's sliding window) on queries and keys as the model rotated them,
    with the program's query scales and biases. Positions by index, as transformers' masks take them; a bias
    sees the rows' positions."""
    bias = bias_function(call)
    far_limit = None if call.sliding_window is None else call.sliding_window - 1
    if _fused(call, bias):
        return F.scaled_dot_product_attention(
            call.q, call.k, call.v, dropout_p=call.dropout, is_causal=True, scale=call.scale, enable_gqa=True
        )  # [b, h, n, dv]

    key_only = None if bias is None else key_bias_function(call)

    def attend(group: RowGroup) -> torch.Tensor:
        q, k, v = _scaled(call, group), group.k, group.v
        n, m = q.shape[2], k.shape[2]
        acc = _accumulator(call, q, k, v, bias)
        inference = type(acc) is kernels.Accumulator and not acc.dropout  # (not decode, not recorded for training)
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
            _masked_blocks(acc, q, k, v, call.scale, group, [(None, None, None)], bias, far_limit)
        return acc.out.to(q.dtype)

    if bias is None:
        return call.run_rows(attend)
    with kernels.flushed_denormals(call.q.device):  # (a distance bias makes far weights denormal: slow on CPU)
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


# --- position rules --------------------------------------------------------------------------------


def run_rule(call: Call) -> torch.Tensor:
    """A program with a position rule: per row group, the rule's fast runner (positions ``0..m-1``) or its
    regions (any increasing positions)."""
    term = call.program.rule
    device = call.q.device
    inv_freq, attention_factor = term.frequencies(call.position_ids, call.k.shape[2], device)
    bias = bias_function(call)
    far_limit = None if call.sliding_window is None else call.sliding_window - 1
    fast = FAST_RUNNERS.get(type(term.rule)) or next(
        (run for cls, run in FAST_RUNNERS.items() if cls is not type(None) and isinstance(term.rule, cls)), None
    )

    def attend(group: RowGroup) -> torch.Tensor:
        q, k, v = _scaled(call, group), group.k, group.v
        acc = _accumulator(call, q, k, v, bias)
        if group.contiguous and fast is not None:
            keys = KeyRotation(term, group.keep, inv_freq, attention_factor)
            fast(acc, term.rule, q, k, v, call.scale, group.q_pos, keys, bias, far_limit)
        else:
            regions = [(r.allowed, r.query, r.key) for r in _regions(term.rule)]
            rotation = KeyRotation(term, NOWHERE, inv_freq, attention_factor)
            _masked_blocks(acc, q, k, v, call.scale, group, regions, bias, far_limit, rotation)
        return acc.out.to(q.dtype)

    return call.run_rows(attend)


def _regions(rule):
    return plain_regions() if rule is None else rule.regions()


def _masked_blocks(acc, q, k, v, scale, group: RowGroup, regions, bias, far_limit, rotation: KeyRotation | None = None):
    """Every region as explicitly masked calls over query blocks: pairs ``j <= i`` (by index; within
    ``far_limit`` keys when given) where the region's predicate holds at the rows' positions, the query and key
    rotated at the region's positions (``None``: as they are)."""
    i_all, j = group.q_pos, group.k_pos
    n, m = q.shape[2], k.shape[2]
    q_index = torch.arange(m - n, m, device=q.device)
    k_index = torch.arange(m, device=q.device)
    keys = []
    for allowed_fn, query_at, key_at in regions:
        if key_at is None:
            keys.append(k)
        else:
            keys.append(rotate(k, key_at(j), rotation.inv_freq, rotation.attention_factor))
    block = min(kernels.query_block(q), kernels.MASKED_BLOCK)  # (each call's mask and bias are block x keys)
    for a in range(0, n, block):
        b = min(n, a + block)
        i = i_all[a:b]
        causal = k_index[None] <= q_index[a:b, None]  # [t, m]
        if far_limit is not None:
            causal &= k_index[None] >= q_index[a:b, None] - far_limit
        block_bias = None if bias is None else bias(i, j)
        for (allowed_fn, query_at, key_at), k_r in zip(regions, keys):
            allowed = causal if allowed_fn is None else causal & allowed_fn(i[:, None], j[None])
            rows, cols = allowed.any(1).nonzero(), allowed.any(0).nonzero()
            if not len(rows):
                continue
            r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1  # (the pairs' bounding box)
            q_r = q[:, :, a + r0 : a + r1]
            if query_at is not None:
                q_r = rotate(q_r, query_at(i[r0:r1]), rotation.inv_freq, rotation.attention_factor)
            acc.attend(
                a + r0, a + r1, q_r, k_r[:, :, c0:c1], v[:, :, c0:c1], scale, c0, allowed[r0:r1, c0:c1],
                bias=None if block_bias is None else block_bias[..., r0:r1, c0:c1],
            )


# --- fast runners (rows at positions 0..m-1) ------------------------------------------------------------


def _same(positions: torch.Tensor) -> torch.Tensor:
    return positions


def plain_rope(acc, rule, q, k, v, scale, q_pos, keys: KeyRotation, bias, far_limit=None) -> None:
    """Plain RoPE rotated here: the queries at their positions over the keys at theirs (kept while decoding),
    within the layer's sliding window (``far_limit`` keys back) if it has one."""
    m, n = k.shape[2], q.shape[2]
    q0 = m - n
    start = 0 if far_limit is None else max(0, q0 - far_limit)
    k_std = keys.at("position", k, _same, first=start)
    block = n if bias is None else kernels.query_block(q)
    for a in range(0, n, block):
        b = min(n, a + block)
        q_std = rotate(q[:, :, a:b], q_pos[a:b], keys.inv_freq, keys.attention_factor)
        kernels.region(
            acc, q_std, k_std, v[:, :, start:], scale, q0 + a, 0, far_limit, start, kernels.TILE, out_offset=a, bias=bias
        )


def window(acc, method: WindowConfig, q, k, v, scale, q_pos, keys: KeyRotation, bias, far_limit=None) -> None:
    """Plain RoPE for the ``w`` nearest keys (a band), the far rotation beyond (``i - j >= w``)."""
    m, n = k.shape[2], q.shape[2]
    q0 = m - n
    w = method.window
    inv_freq, attention_factor = keys.inv_freq, keys.attention_factor
    band_start = max(0, q0 - w + 1)  # the band needs only the last keys (decode rotates w of them)
    far_keys = m - w  # keys 0..m-w-1 can be w or more behind the last query
    if method.far_key_is_position and far_keys > 0:
        k_std = keys.at("position", k, _same)
        k_band = k_std[:, :, band_start:]
    else:
        k_std = None
        k_band = keys.at("position", k, _same, first=band_start)
    block = kernels.query_block(q)  # (in blocks: one block's rotated queries at a time)
    for a in range(0, n, block):
        b = min(n, a + block)
        q_std = rotate(q[:, :, a:b], q_pos[a:b], inv_freq, attention_factor)
        kernels.region(
            acc, q_std, k_band, v[:, :, band_start:], scale, q0 + a, 0, w - 1, band_start, kernels.TILE,
            out_offset=a, bias=bias,
        )
        del q_std
    del k_band
    if far_keys <= 0 or m - 1 < w:  # (the last query is at m - 1)
        return
    if k_std is not None:
        k_far = k_std[:, :, :far_keys]
    elif method.far_key_is_zero:
        k_far = rotate_at_zero(k[:, :, :far_keys], inv_freq, attention_factor)
    else:
        k_far = keys.at(("far", method), k[:, :, :far_keys], method.far_key)
    first = max(0, w - q0)  # queries before position w have no far keys
    for a in range(first, n, block):  # (one block's rotated queries and output at a time)
        b = min(n, a + block)
        q_far = rotate(q[:, :, a:b], method.far_query(q_pos[a:b]), inv_freq, attention_factor)
        kernels.region(acc, q_far, k_far, v[:, :, :far_keys], scale, q0 + a, w, None, out_offset=a, bias=bias)
        del q_far


def dual_chunk(acc, method: DualChunkConfig, q, k, v, scale, q_pos, keys: KeyRotation, bias, far_limit=None) -> None:
    """Keys at ``j mod s``; a query at ``i mod s`` in its own chunk, at ``min(i mod s + s, chunk_size)`` over the
    previous one, at ``chunk_size`` over older ones: one chunk's queries at a time."""
    m, n = k.shape[2], q.shape[2]
    q0 = m - n
    s, size = method.chunk, method.chunk_size
    inv_freq, attention_factor = keys.inv_freq, keys.attention_factor
    k_rot = keys.at(("chunk", method), k, lambda j: torch.remainder(j, s))
    a = 0
    while a < n:  # (rotated per chunk: one chunk's copies at a time)
        p0 = q0 + a
        start = (p0 // s) * s  # their chunk
        b = min(n, start + s - q0)
        qc, within = q[:, :, a:b], torch.remainder(q_pos[a:b], s)
        span = slice(start, q0 + b)
        q_intra = rotate(qc, within, inv_freq, attention_factor)
        kernels.region(acc, q_intra, k_rot[:, :, span], v[:, :, span], scale, p0, 0, None, start, out_offset=a, bias=bias)
        del q_intra
        for span, query in (
            (slice(start - s, start), torch.clamp(within + s, max=size)) if start >= s else (None, None),
            (slice(0, start - s), torch.full_like(within, float(size))) if start >= 2 * s else (None, None),
        ):
            if span is None:
                continue
            block_bias = None if bias is None else bias(q_pos[a:b], torch.arange(span.start, span.stop, device=q.device, dtype=torch.float32))
            q_other = rotate(qc, query, inv_freq, attention_factor)
            acc.attend(a, b, q_other, k_rot[:, :, span], v[:, :, span], scale, span.start, bias=block_bias)
            del q_other
        a = b


# --- pair scales (xPos) -----------------------------------------------------------------------------------


def _pair_scaled(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``x [b, h, t, d]`` with rotary pair ``p`` (dims ``p`` and ``p + r/2``) times ``factors [t, r/2]``."""
    half = factors.shape[-1]
    f = factors.to(x.dtype)
    scaled = x[..., : 2 * half].unflatten(-1, (2, half)) * f[:, None]  # [b, h, t, 2, r/2]
    return torch.cat((scaled.flatten(-2), x[..., 2 * half :]), dim=-1)


def run_pair_scale(call: Call) -> torch.Tensor:
    """Plain RoPE rotated in attention with a pair scale: per query block starting at position ``c``, queries
    scaled by ``f(i - c)``, keys (rotated once, kept while decoding) by ``f(c - j)``."""
    term = call.program.rule
    if term is None or term.rule is not None:
        raise ValueError("a pair scale (xpos) runs on plain RoPE rotated in attention, not with a position rule")
    (pair,) = call.program.of_type(PairScale)
    inv_freq, attention_factor = term.frequencies(call.position_ids, call.k.shape[2], call.q.device)
    bias = bias_function(call)
    far_limit = None if call.sliding_window is None else call.sliding_window - 1

    def attend(group: RowGroup) -> torch.Tensor:
        q, k, v = _scaled(call, group), group.k, group.v
        n, m = q.shape[2], k.shape[2]
        q0 = m - n
        acc = _accumulator(call, q, k, v, bias)
        if group.contiguous:  # (the rotated keys kept on the cache while decoding, as plain RoPE keeps them)
            k_rot = KeyRotation(term, group.keep, inv_freq, attention_factor).at("position", k, _same)
        else:
            k_rot = rotate(k, group.k_pos, inv_freq, attention_factor)
        block = min(kernels.query_block(q), pair.method.safe_block(pair.dim))
        k_index = torch.arange(m, device=q.device)
        for a in range(0, n, block):
            b = min(n, a + block)
            start = 0 if far_limit is None else max(0, q0 + a - far_limit)
            last = q0 + b  # (keys by index up to the block's last query)
            c = group.q_pos[a]
            q_blk = rotate(q[:, :, a:b], group.q_pos[a:b], inv_freq, attention_factor)
            q_blk = _pair_scaled(q_blk, pair.method.factors(group.q_pos[a:b] - c, pair.dim))
            k_blk = _pair_scaled(k_rot[:, :, start:last], pair.method.factors(c - group.k_pos[start:last], pair.dim))
            if group.contiguous:
                kernels.region(acc, q_blk, k_blk, v[:, :, start:last], call.scale, q0 + a, 0, far_limit, start,
                               kernels.TILE, out_offset=a, bias=bias)
            else:
                q_index = torch.arange(q0 + a, q0 + b, device=q.device)
                allowed = k_index[None, start:last] <= q_index[:, None]
                if far_limit is not None:
                    allowed &= k_index[None, start:last] >= q_index[:, None] - far_limit
                block_bias = None if bias is None else bias(group.q_pos[a:b], group.k_pos[start:last])
                acc.attend(a, b, q_blk, k_blk, v[:, :, start:last], call.scale, start, allowed, bias=block_bias)
            del q_blk, k_blk
        return acc.out.to(q.dtype)

    return call.run_rows(attend)


#: the fast runner of each rule class (``type(None)``: plain RoPE); a rule without one runs its ``regions()``
FAST_RUNNERS = {type(None): plain_rope, WindowConfig: window, DualChunkConfig: dual_chunk}

PLAIN_KERNEL = register_kernel(Kernel("plain attention", None, run_plain, rank=0, handles=(Bias,)))
BIAS_KERNEL = register_kernel(Kernel("blockwise attention with biases", Bias, run_plain, rank=10, handles=(Bias,)))
RULE_KERNEL = register_kernel(
    Kernel("position-rule regions", PositionRule, run_rule, rank=20, handles=(PositionRule, Bias))
)
PAIR_SCALE_KERNEL = register_kernel(
    Kernel("plain RoPE with pair scales", PairScale, run_pair_scale, rank=30, handles=(PositionRule, PairScale, Bias))
)
