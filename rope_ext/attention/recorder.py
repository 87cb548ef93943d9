"""Attention calls that need gradients (training): recorded, run once without autograd, differentiated once.

The flash ops give no derivative for their log-sum-exp, and the matmul path keeps every tile's scores for autograd
(a ``dca`` training step of the default model on a 2,048-token PoSE window ran out of 24 GB with it). ``Recorder``
takes the place of the ``Accumulator`` instead: its calls run as inference does and one backward, attention's own
from the merged log-sum-exp, gives all their gradients.
"""

from __future__ import annotations

import torch

import rope_ext.attention.dispatch as dispatch
from rope_ext.attention.merge import Accumulator


class Recorder:
    """``Accumulator`` for calls that need gradients (training): ``attend`` records each call; ``out`` runs them all
    as one autograd function (``_RecordedAttention``). Its forward is the no-gradient path (the flash op on CPU,
    log-sum-exp merging); its backward is attention's own, ``dS = P (dP - rowsum(dO * O))`` with ``P`` recomputed
    tile by tile from the *merged* log-sum-exp, so no call's scores are kept for autograd (the matmul path keeps
    every tile's: a ``dca`` training step of the default model on a 2,048-token PoSE window ran out of 24 GB with
    it); what is kept is each call's queries, keys, values, mask and bias block (a bias without a key-only form is
    score-sized). Gradients reach the calls' queries, keys, values and biases, and through autograd whatever made
    them (the rotations, a learnable bias). First derivatives only (``once_differentiable``)."""

    def __init__(self, q: torch.Tensor, value_dim: int) -> None:
        self.shape = (*q.shape[:-1], value_dim)
        self.dtype, self.device = dispatch.accumulation_dtype(q.dtype), q.device
        self.calls: list[tuple] = []
        self._out: torch.Tensor | None = None

    def attend(self, a: int, b: int, q, k, v, scale: float, first_key: int, allowed=None, causal=False, bias=None) -> None:
        if self._out is not None:
            raise RuntimeError("Recorder: a call after its output was taken")
        self.calls.append((a, b, q, k, v, scale, allowed, causal, bias))

    @property
    def out(self) -> torch.Tensor:
        if self._out is None:
            if not self.calls:  # (no query sees a key)
                self._out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            else:
                tensors = [t for a, b, q, k, v, scale, allowed, causal, bias in self.calls for t in (q, k, v, bias)]
                self._out = _RecordedAttention.apply(self, *tensors)
        return self._out


class _RecordedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recorder: Recorder, *tensors):
        acc = Accumulator(torch.empty(recorder.shape[:-1] + (1,), dtype=recorder.dtype, device=recorder.device), recorder.shape[-1])
        for a, b, q, k, v, scale, allowed, causal, bias in recorder.calls:
            acc.attend(a, b, q, k, v, scale, 0, allowed, causal, bias)
        # (the masks saved as tensors: gradient checkpointing frees them with the rest; only positions kept aside)
        ctx.calls = [(a, b, scale, causal) for a, b, q, k, v, scale, allowed, causal, bias in recorder.calls]
        masks = [allowed for a, b, q, k, v, scale, allowed, causal, bias in recorder.calls]
        recorder.calls = []  # (autograd holds the tensors it saved, and frees them after the backward)
        out = acc.out.to(recorder.dtype)  # (a single call's output comes in the call's dtype)
        ctx.save_for_backward(out, acc.lse, *tensors, *masks)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        out, lse, *saved = ctx.saved_tensors
        count = len(ctx.calls)
        tensors, masks = saved[: 4 * count], saved[4 * count :]
        grad_out = grad_out.to(out.dtype)
        delta = (grad_out * out).sum(-1)  # [b, h, n]
        grads = []
        for index, (a, b, scale, causal) in enumerate(ctx.calls):
            i = 4 * index
            needed = ctx.needs_input_grad[1 + i : 5 + i]
            grads += _call_backward(
                *tensors[i : i + 4], scale, masks[index], causal, grad_out[:, :, a:b], delta[:, :, a:b], lse[:, :, a:b],
                needed,
            )
        return (None, *grads)


def _call_backward(q, k, v, bias, scale, allowed, causal, grad_out, delta, lse, needed):
    """One recorded call's ``(dq, dk, dv, dbias)`` (``None`` where not ``needed``) given the whole attention's
    ``grad_out``, ``delta`` and ``lse`` at its queries, over query tiles of ``dispatch.FALLBACK_TILE`` (a causal tile
    scores only the keys up to its last query); GQA key heads summed over their query heads."""
    dtype = lse.dtype
    batch, heads, n, _ = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    keys = n if causal else m  # (a causal call sees the first n keys, as lse_attention cuts them)
    kd, vd = k[:, :, :keys].to(dtype)[:, :, None], v[:, :, :keys].to(dtype)[:, :, None]  # [b, hk, 1, keys, d]
    want_q, want_k, want_v, want_bias = needed
    dq = torch.empty(q.shape, dtype=dtype, device=q.device) if want_q else None
    dk = torch.zeros(batch, kv_heads, m, k.shape[-1], dtype=dtype, device=q.device) if want_k else None
    dv = torch.zeros(batch, kv_heads, m, v.shape[-1], dtype=dtype, device=q.device) if want_v else None
    dbias = torch.zeros(bias.shape, dtype=dtype, device=q.device) if want_bias and bias is not None else None
    for a in range(0, n, dispatch.FALLBACK_TILE):
        b = min(n, a + dispatch.FALLBACK_TILE)
        seen = b if causal else keys  # keys this tile scores
        qt = q[:, :, a:b].to(dtype).unflatten(1, (kv_heads, groups))  # [b, hk, g, t, d]
        scores = (qt @ kd[..., :seen, :].transpose(-1, -2)).flatten(1, 2) * scale  # [b, h, t, seen]
        scores = dispatch.tile_scores(scores, a, b, seen, causal, allowed, bias)
        weights = torch.exp(scores - lse[:, :, a:b, None]).nan_to_num(0.0)  # (a row no call reaches: -inf - -inf)
        go = grad_out[:, :, a:b].unflatten(1, (kv_heads, groups))  # [b, hk, g, t, dv]
        w = weights.unflatten(1, (kv_heads, groups))
        if dv is not None:
            dv[:, :, :seen] += (w.transpose(-1, -2) @ go).sum(2)
        if dq is None and dk is None and dbias is None:
            continue
        ds = w * ((go @ vd[..., :seen, :].transpose(-1, -2)) - delta[:, :, a:b].unflatten(1, (kv_heads, groups))[..., None])
        if dq is not None:
            dq[:, :, a:b] = (ds @ kd[..., :seen, :]).flatten(1, 2) * scale
        if dk is not None:
            dk[:, :, :seen] += (ds.transpose(-1, -2) @ qt).sum(2) * scale
        if dbias is not None:
            d = ds.flatten(1, 2).sum(0)  # [h, t, seen]
            d = d if bias.shape[-3] > 1 else d.sum(0, keepdim=True)
            if bias.shape[-2] > 1:
                dbias[..., a:b, :seen] += d
            else:
                dbias[..., :seen] += d.sum(-2, keepdim=True)
    return [None if g is None else g.to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v), (dbias, bias))]
