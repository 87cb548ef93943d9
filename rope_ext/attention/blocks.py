"""What every attention-program kernel shares: the program's query scales and biases at a call's positions, the
accumulator a call merges into, and the general path.

The general path (``masked_blocks``) runs any rows, whatever their positions (``position_ids`` with jumps, offsets):
each region of a position rule (pair predicate, query rotation, key rotation) as explicitly masked calls over query
blocks. It is exact everywhere and the path of a rule without a fast runner (``rope_ext.attention.rules``).
"""

from __future__ import annotations

import torch

import rope_ext.attention.kernels as kernels
from rope_ext.attention.key_cache import KeyRotation
from rope_ext.attention.merge import Accumulator, SingleQuery
from rope_ext.attention.program import Bias, Call, QueryScale, RowGroup
from rope_ext.attention.recorder import Recorder
from rope_ext.methods.rope import rotate


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


def scaled_queries(call: Call, group: RowGroup) -> torch.Tensor:
    """The group's queries times the program's query scales at their positions."""
    multiplier = query_multiplier(call, group.q_pos)
    return group.q if multiplier is None else group.q * multiplier.to(group.q.dtype)[:, None]


def accumulator_for(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias=None):
    """Decode's one score row, the recorded calls of a training step (one backward from the merged log-sum-exp:
    queries, keys, values or a learnable ``bias`` needing gradients), or the merging accumulator (dropout in
    training: each call's weights dropped as autograd runs them)."""
    if call.dropout:
        return Accumulator(q, v.shape[-1], call.dropout)
    if SingleQuery.applies(q, k, biased=bias is not None):
        return SingleQuery(q, v)
    if torch.is_grad_enabled():
        one = torch.zeros(1, device=q.device)
        if q.requires_grad or k.requires_grad or v.requires_grad or bias is not None and bias(one, one).requires_grad:
            return Recorder(q, v.shape[-1])
    return Accumulator(q, v.shape[-1])


def masked_blocks(
    acc, q, k, v, scale, group: RowGroup, regions, bias, far_limit, rotation: KeyRotation | None = None
) -> None:
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

