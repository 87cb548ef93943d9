"""The pair-scale kernel (xPos): plain RoPE rotated in attention, queries and keys scaled per rotary pair.

Queries and keys are scaled relative to each query block's first position, so no factor overflows however long the
sequence (``XposConfig.safe_block`` caps the block).
"""

from __future__ import annotations

import torch

import rope_ext.attention.blocks as blocks
import rope_ext.attention.kernels as kernels
from rope_ext.attention.key_cache import KeyRotation
from rope_ext.attention.program import Bias, Call, Kernel, PairScale, PositionRule, RowGroup, register_kernel
from rope_ext.methods.position_rules import same_position
from rope_ext.methods.rope import rotate


def _pair_scaled(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``x [b, h, t, d]`` with rotary pair ``p`` (dims ``p`` and ``p + r/2``) times ``factors [t, r/2]``."""
    half = factors.shape[-1]
    f = factors.to(x.dtype)
    scaled = x[..., : 2 * half].unflatten(-1, (2, half)) * f[:, None]  # [b, h, t, 2, r/2]
    return torch.cat((scaled.flatten(-2), x[..., 2 * half :]), dim=-1)


def run_pair_scale(call: Call) -> torch.Tensor:
    """Plain RoPE rotated in attention with a pair scale: per query block starting at position ``c``, queries
    scaled by ``f(i - c)``, keys (rotated once, kept while decoding) by ``f(c - j)``."""
    term = call.program.position_rule
    if term is None or term.config is not None:
        raise ValueError("a pair scale (xpos) runs on plain RoPE rotated in attention, not with a position rule")
    (pair,) = call.program.of_type(PairScale)
    inv_freq, attention_factor = term.frequencies(call.position_ids, call.k.shape[2], call.q.device)
    bias = blocks.bias_function(call)
    far_limit = None if call.sliding_window is None else call.sliding_window - 1

    def attend(group: RowGroup) -> torch.Tensor:
        q, k, v = blocks.scaled_queries(call, group), group.k, group.v
        n, m = q.shape[2], k.shape[2]
        q0 = m - n
        acc = blocks.accumulator_for(call, q, k, v, bias)
        if group.contiguous:  # (the rotated keys kept on the cache while decoding, as plain RoPE keeps them)
            k_rot = KeyRotation(term, group.keep, inv_freq, attention_factor).at("position", k, same_position)
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


PAIR_SCALE_KERNEL = register_kernel(
    Kernel("plain RoPE with pair scales", PairScale, run_pair_scale, rank=30, handles=(PositionRule, PairScale, Bias))
)
