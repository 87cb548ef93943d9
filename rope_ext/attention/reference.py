"""The paper's formula, pair by pair: RoPE attention scores at any relative position ``rel'[i, j]``.

With HF's ``rotate_half`` layout, rotary pair ``m`` is dims ``m`` and ``m + r/2`` (``r`` the rotary
dimension; dims past ``r`` are not rotated). Rotating ``q`` by ``a theta_m`` and ``k`` by ``b theta_m``
gives, per pair, ``(q1 k1 + q2 k2) cos((a - b) theta_m) - (q2 k1 - q1 k2) sin((a - b) theta_m)``: the
score depends on the positions only through ``a - b``, so it can be evaluated at a remapped ``rel'``
directly. This builds ``[b, h, q, k, r/2]`` tensors: for tests on tiny shapes, never for real lengths.
"""

from __future__ import annotations

import torch

from rope_ext.attention.program import Bias, Call, PairScale, QueryScale, RowGroup
from rope_ext.methods.rope import rotate
from rope_ext.methods.xpos import xpos_zeta


def remapped_rope_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    rel: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    pair_factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [b, h, n_q, d]`` and ``k [b, h, n_k, d]`` unrotated, ``rel [b, n_q, n_k]`` -> scores ``[b, h, n_q, n_k]``
    (unscaled dot products; the rotated dims carry ``attention_factor ** 2`` as cos and sin do in HF).
    ``pair_factor [b, n_q, n_k, r/2]`` multiplies each rotary pair's score (xPos's ``zeta^((i - j)/B)``)."""
    half = inv_freq.shape[-1]
    rotary = 2 * half
    q, k = q.to(torch.float64), k.to(torch.float64)
    q1, q2, q_pass = q[..., :half], q[..., half:rotary], q[..., rotary:]
    k1, k2, k_pass = k[..., :half], k[..., half:rotary], k[..., rotary:]
    real = q1[:, :, :, None] * k1[:, :, None] + q2[:, :, :, None] * k2[:, :, None]  # [b, h, q, k, r/2]
    imag = q2[:, :, :, None] * k1[:, :, None] - q1[:, :, :, None] * k2[:, :, None]  # [b, h, q, k, r/2]
    angle = rel.to(torch.float64)[:, None, :, :, None] * inv_freq.to(torch.float64)  # [b, 1, q, k, r/2]
    pairs = real * angle.cos() - imag * angle.sin()  # [b, h, q, k, r/2]
    if pair_factor is not None:
        pairs = pairs * pair_factor.to(torch.float64)[:, None]
    rotated = pairs.sum(-1) * attention_factor**2  # [b, h, q, k]
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
    bias: torch.Tensor | None = None,
    pair_factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention over ``remapped_rope_scores`` (with ``pair_factor``); ``allowed [b, n_q, n_k]`` is the causal and padding
    mask, ``query_scale [b, n_q]`` multiplies each query (log-n), ``bias [h or 1, n_q, n_k]`` is added to the
    scaled scores. GQA: ``k``/``v`` with fewer heads repeat."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = remapped_rope_scores(q, k, rel, inv_freq, attention_factor, pair_factor) * scaling  # [b, h, q, k]
    return _softmax_out(scores, v, q.dtype, allowed, query_scale, bias)


def program_reference(call: Call) -> torch.Tensor:
    """A whole attention call straight from the formulas (the kernel ``kernel_override`` swaps in for tests):
    per row, ``rel'`` from the rule's ``relative`` at the rows' positions (plain ``i - j`` for plain RoPE; queries
    and keys as they arrived without a rule), the causal (and sliding-window) mask by index, each query scale's
    multiplier and each bias, one float64 softmax."""
    program = call.program
    rule = program.position_rule
    n, m = call.q.shape[2], call.k.shape[2]
    frequencies = None if rule is None else rule.frequencies(call.position_ids, m, call.q.device)

    def attend(group: RowGroup) -> torch.Tensor:
        q, k, v = group.q, group.k, group.v
        n_r, m_r = q.shape[2], k.shape[2]
        i, j = group.q_pos[:, None].to(torch.float64), group.k_pos[None].to(torch.float64)
        index_i = torch.arange(m_r - n_r, m_r, device=q.device)[:, None]
        index_j = torch.arange(m_r, device=q.device)[None]
        allowed = index_j <= index_i
        if call.sliding_window is not None:
            allowed &= index_i - index_j < call.sliding_window
        multiplier = torch.ones(n_r, dtype=torch.float64, device=q.device)
        for term in program.of_type(QueryScale):
            multiplier = multiplier * term.multiplier(group.q_pos).to(torch.float64)
        bias = torch.zeros(1, n_r, m_r, dtype=torch.float64, device=q.device)
        for term in program.of_type(Bias):
            bias = bias + term.bias(group.q_pos, group.k_pos).to(torch.float64)
        if rule is None:
            return plain_attention(q, k, v, allowed=allowed[None], scaling=call.scale, query_scale=multiplier[None], bias=bias)
        inv_freq, attention_factor = frequencies
        rel = i - j if rule.config is None else rule.config.relative(i, j)
        pair_factor = None
        for term in program.of_type(PairScale):  # (the paper's relative form: no block offsets, float64)
            zeta = xpos_zeta(term.dim, term.method.gamma).to(q.device)
            pair_factor = zeta ** ((i - j)[..., None] / term.method.scale_base)  # [n, m, r/2]
        return reference_attention(
            q, k, v, rel[None], inv_freq, allowed=allowed[None], scaling=call.scale, attention_factor=attention_factor,
            query_scale=multiplier[None], bias=bias, pair_factor=None if pair_factor is None else pair_factor[None],
        )

    return call.run_rows(attend)


def plain_attention(q, k, v, *, allowed, scaling, query_scale=None, bias=None) -> torch.Tensor:
    """Softmax attention of queries and keys as they are, in float64 (``reference_attention``'s masks, query
    scale and bias)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2) * scaling  # [b, h, q, k]
    return _softmax_out(scores, v, q.dtype, allowed, query_scale, bias)


def _softmax_out(scores, v, dtype, allowed, query_scale, bias) -> torch.Tensor:
    if query_scale is not None:
        scores = scores * query_scale.to(torch.float64)[:, None, :, None]
    if bias is not None:
        scores = scores + bias.to(torch.float64)[:, None] if bias.dim() == 3 and bias.shape[0] == 1 else scores + bias.to(torch.float64)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row attends to nothing
    return (weights @ v.to(torch.float64)).to(dtype)  # [b, h, q, d]


def two_matrix_kernel(call: Call) -> torch.Tensor:
    """The reference repositories' strategy for a window rule (ReRoPE's ``rerope_patch.py``): two full ``n x n``
    score matrices, one with plain RoPE and one with the far rotation, joined by ``where(rel < w)``; for
    benchmarks (``kernel_override``), unpadded rows whose positions are the keys' own, no other terms."""
    rule = call.program.position_rule
    if rule is None or not hasattr(rule.config, "far_query") or len(call.program.terms) != 1 or call.rows is not None:
        raise ValueError("two_matrix_kernel runs a window rule alone on unpadded rows")
    inv_freq, attention_factor = rule.frequencies(call.position_ids, call.k.shape[2], call.q.device)
    return two_matrix_attention(
        call.q, call.k, call.v, method=rule.config, inv_freq=inv_freq, attention_factor=attention_factor, scaling=call.scale
    )


def two_matrix_attention(q, k, v, *, method, inv_freq, attention_factor, scaling) -> torch.Tensor:
    """Two full score matrices joined by ``where(rel < w)``; unpadded rows, queries the last ``n`` keys."""
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


def materialised_bias_kernel(call: Call) -> torch.Tensor:
    """BLOOM's and MPT's way with an additive bias (for benchmarks, through ``kernel_override``): the whole
    ``[heads, n, m]`` bias materialised with the causal mask into one float mask, one SDPA call; unpadded rows whose
    positions are the keys' own, no other terms."""
    biases = call.program.of_type(Bias)
    others = [t for t in call.program.terms if not isinstance(t, Bias)]
    if not biases or others or call.rows is not None or call.custom_positions() is not None:
        raise ValueError("materialised_bias_kernel runs bias terms alone on unpadded rows at their own positions")
    n, m = call.q.shape[2], call.k.shape[2]
    k_pos = torch.arange(m, device=call.q.device, dtype=torch.float32)
    mask = biases[0].bias(k_pos[m - n :], k_pos)
    for term in biases[1:]:
        mask = mask + term.bias(k_pos[m - n :], k_pos)
    mask = mask.to(call.q.dtype).masked_fill(k_pos[None, :] > k_pos[m - n :, None], float("-inf"))  # [h, n, m]
    return torch.nn.functional.scaled_dot_product_attention(
        call.q, call.k, call.v, attn_mask=mask[None], scale=call.scale, enable_gqa=True
    )


def relative_reference(call: Call) -> torch.Tensor:
    """A T5 attention call with its bias written out whole (``RelativeBias.dense()``) and one float64 softmax over
    the unpadded keys (causal by position in the decoder); a module without positions, plain attention."""
    from rope_ext.attention.relative import RelativeAttention

    (term,) = call.program.of_type(RelativeAttention)
    q, k = call.q, call.k
    batch, n, m = q.shape[0], q.shape[2], k.shape[2]
    allowed = torch.ones(batch, n, m, dtype=torch.bool, device=q.device)
    if call.rows is not None:
        allowed &= call.rows[:, None, :]
    if not term.positions:
        return plain_attention(q, k, call.v, allowed=allowed, scaling=call.scale)
    bias = call.position_bias.dense()[0]  # [h, n, m]
    if term.causal:
        past = call.position_bias.past
        allowed &= torch.arange(m, device=q.device)[None] <= torch.arange(past, past + n, device=q.device)[:, None]
    return plain_attention(q, k, call.v, allowed=allowed, scaling=call.scale, bias=bias)
