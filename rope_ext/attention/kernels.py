"""The fast path: exact attention over position regions, merged through the log-sum-exp, never ``n x n``.

A region is a set of (query, key) pairs whose scores use one rotation of the queries and one of the keys.
Each is covered by a few exact attention calls that the flash kernel runs at full speed:

* a lower region (``j <= i - near``: everything at least ``near`` behind) is one unmasked call over the keys
  every query sees plus one *causal* square call -- no tiles;
* a band (``i - far <= j <= i - near``) is walked in query tiles of ``t <= far - near`` queries; each tile is
  a causal square (its nearest ``t`` keys), an unmasked core, and an *anti-causal* square (its farthest
  ``t`` keys: the causal call on sequences read backwards);
* pieces clipped by the ends of the key range fall back to a small explicit mask.

Each call returns its output and log-sum-exp; ``Accumulator`` merges them:
``out = sum_r exp(lse_r - lse) out_r`` with ``lse = logsumexp_r lse_r``, exactly the softmax over the union.
One query per row (decode) needs no merging: the regions of a single query split its keys, so
``SingleQuery`` writes each region's scores into one score row over all keys and takes one softmax and one
product with the values (a few small matmuls instead of a flash call per region).

Calls go to ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` on CPU (it returns the LSE,
takes GQA key/value heads as they are, skips the blocks a causal call never needs). On CUDA in float16 /
bfloat16 a whole region is *one* call of ``torch.ops.aten._flash_attention_forward`` with window sizes (its
window is a band around the bottom-right diagonal: ``window_plan`` maps a region onto it), and other calls go
to the same op (unmasked or causal) or to the memory-efficient op (float32, or an explicit mask). Without
either (other devices, float64) a plain matmul-softmax over query tiles does it; all are exact. The ops have
no derivative for their LSE, so with gradients ``Recorder`` takes the place of ``Accumulator``: the calls run as
above without autograd and one backward (attention's own, from the merged LSE) gives their gradients.

Positions here are per row and contiguous: keys at ``0..m-1``, queries at ``q0..q0+n-1`` (the last ``n``
keys). The attention hook compacts padded rows to this form first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

#: queries per band tile (at most); the flash kernel works in 256-query blocks from 768 queries on
TILE = 1024
#: queries per matmul of the fallback path (its score block is ``FALLBACK_TILE x keys``)
FALLBACK_TILE = 512
#: queries per block of a far region on CPU: the block's rotated queries and output are the temporaries
QUERY_BLOCK = 4096
#: queries per explicitly masked call of the general path (positions with jumps): its mask and bias are that x keys
MASKED_BLOCK = 1024


def _flushing_denormals() -> bool:
    """Whether this thread flushes float32 denormals to zero (``torch.set_flush_denormal`` has no getter)."""
    return torch.tensor(1e-39, dtype=torch.float32).item() == 0.0


@contextlib.contextmanager
def flushed_denormals(device: torch.device) -> Iterator[None]:
    """On CPU, float32 denormals flushed to zero inside the block (then the thread's setting as it was).

    A distance bias drives the far keys' ``exp(score - max)`` through the denormal range (ALiBi: every key about
    ``87 / m`` to ``104 / m`` behind the query, thousands of keys for the small slopes), where x86 arithmetic is
    many times slower: the CPU flash op with ALiBi's bias took 1.7x its time without it at 4k, and the same time
    with denormals flushed. What is flushed are weights below ``exp(-87)`` of the row's largest, far below
    float32's precision for the sum they join."""
    if device.type != "cpu" or _flushing_denormals() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def query_block(q: torch.Tensor) -> int:
    """How many queries of a far region to rotate and attend at once: ``QUERY_BLOCK`` on CPU (peak memory), all
    of them elsewhere (one call: on CUDA a square causal region goes to cuDNN whole)."""
    return QUERY_BLOCK if q.device.type == "cpu" else max(1, q.shape[2])


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, softmax and merged outputs: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def _needs_grad(q: torch.Tensor, k: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)


def _use_flash(q: torch.Tensor, k: torch.Tensor) -> bool:
    half_or_single = q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return q.device.type == "cpu" and half_or_single and not _needs_grad(q, k)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(q: torch.Tensor) -> tuple[int, int]:
    return _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _use_cuda_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA flash attention: half precision, one head size up to 256 for queries, keys and values, an Ampere or
    later GPU, and SDPA's flash backend not switched off (``torch.backends.cuda.enable_flash_sdp``)."""
    half = q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
    dims = q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256
    if not (q.device.type == "cuda" and half and dims and not _needs_grad(q, k)):
        return False
    return torch.backends.cuda.flash_sdp_enabled() and _device_capability(q) >= (8, 0)


def _use_cuda_efficient(q: torch.Tensor, k: torch.Tensor) -> bool:
    single = q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    enabled = torch.backends.cuda.mem_efficient_sdp_enabled()
    return q.device.type == "cuda" and single and enabled and not _needs_grad(q, k)


def _use_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """cuDNN attention where SDPA itself prefers it (Hopper and later): about 1.6x the flash op's speed there."""
    return _use_cuda_flash(q, k, v) and torch.backends.cuda.cudnn_sdp_enabled() and _device_capability(q) >= (9, 0)


def _dense_cuda(q, k, v, scale, causal=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked or square causal attention in half precision on CUDA: cuDNN (causal there is top-left: square
    calls only) or the flash op."""
    if _use_cudnn(q, k, v) and (not causal or q.shape[2] == k.shape[2]):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out.float(), lse.reshape(q.shape[:3])
    return _flash_cuda(q, k, v, scale, causal=causal, right=0 if causal else -1)


def _flash_cuda(q, k, v, scale, causal=False, left=-1, right=-1) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._flash_attention_forward`` on ``[b, h, *, d]`` tensors (GQA heads as they are): query ``a`` sees
    key ``j`` when ``a + m - n - left <= j <= a + m - n + right`` (``-1``: no bound; ``causal``: ``right = 0``)."""
    n, m = q.shape[2], k.shape[2]
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, n, m, 0.0, causal, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )
    return out.transpose(1, 2).float(), lse


def _efficient_cuda(q, k, v, scale, allowed, causal, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_efficient_attention`` (no GQA: the key/value heads are repeated)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None
    if allowed is not None or bias is not None:  # (the op wants the bias rows 16-byte aligned: a padded buffer)
        n, m = q.shape[2], k.shape[2]
        heads = 1 if bias is None else bias.shape[0]
        mask = torch.zeros(heads, n, -(-m // 16) * 16, dtype=q.dtype, device=q.device)[..., :m]
        if bias is not None:
            mask += bias.to(q.dtype)
        if allowed is not None:
            mask = mask.masked_fill_(~allowed, float("-inf"))
        mask = mask.expand(q.shape[0], q.shape[1], n, m)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, True, 0.0, causal, scale=scale
    )
    return out.float(), lse[..., : q.shape[2]]


def lse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
    causal: bool = False,
    bias: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [b, h, n, d]`` over ``k, v [b, hk, m, d]`` (``h`` a multiple of ``hk``) with an
    optional ``allowed [n, m]`` bool mask, or ``causal`` (query ``a`` sees keys ``0..a``, ``n <= m``), plus an
    optional additive ``bias [h or 1, n, m]`` on the scaled scores -> ``(out [b, h, n, d], lse [b, h, n])`` in
    float32 (float64 for float64 inputs); a query with no allowed key gets ``out = 0``, ``lse = -inf``.
    ``dropout``: that fraction of the attention weights dropped (after the softmax, the rest scaled up; ``lse``
    is the softmax's own), as transformers' eager attention does in training."""
    if causal and allowed is not None:
        raise ValueError("lse_attention: pass either causal or an allowed mask")
    if causal:  # (a causal query never sees the keys after the last query's)
        k, v = k[:, :, : q.shape[2]], v[:, :, : q.shape[2]]
        if bias is not None:
            bias = bias[..., : q.shape[2]]
            if q.device.type != "cpu":  # (on CUDA the pair rule as a mask beside the bias; CPU's ops take both)
                allowed, causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril_(), False
    if dropout:
        out, lse = _matmul_attention(q, k, v, scale, allowed, causal, bias, dropout)
    elif _use_flash(q, k):
        mask = None
        if allowed is not None:
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        if bias is not None:  # [1, h or 1, n, m]: the flash op takes a 4D mask (2D or 4D only); in float32 for a
            # bf16/fp16 call too (the op adds it to its float32 scores: a bias rounded to 8 bits lost a whole unit)
            bias = bias.to(accumulation_dtype(q.dtype))
            mask = bias[None] if mask is None else (bias + mask)[None]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=causal, attn_mask=mask, scale=scale
        )
        out = out.float()
    elif allowed is None and bias is None and _use_cuda_flash(q, k, v):
        out, lse = _dense_cuda(q, k, v, scale, causal)
    elif _use_cuda_efficient(q, k):
        out, lse = _efficient_cuda(q, k, v, scale, allowed, causal, bias)
    else:
        out, lse = _matmul_attention(q, k, v, scale, allowed, causal, bias)
    if allowed is not None:
        empty = ~allowed.any(-1)  # [n]
        if bool(empty.any()):
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty[:, None], 0.0)
    return out, lse


def _matmul_attention(q, k, v, scale, allowed, causal, bias=None, dropout=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, as float32 (float64) matmuls over query tiles (differentiable, any device)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    dtype = accumulation_dtype(q.dtype)
    k, v = k.to(dtype), v.to(dtype)
    n = q.shape[2]
    outs, lses = [], []
    for a in range(0, n, FALLBACK_TILE):
        b = min(n, a + FALLBACK_TILE)
        keys = b if causal else k.shape[2]  # a causal tile never needs later keys
        scores = (q[:, :, a:b].to(dtype) @ k[:, :, :keys].transpose(-1, -2)) * scale  # [b, h, tile, keys]
        scores = _tile_scores(scores, a, b, keys, causal, allowed, bias)
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        if dropout:
            weights = torch.nn.functional.dropout(weights, p=dropout)
        outs.append(weights @ v[:, :, :keys])
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _tile_scores(scores, a: int, b: int, keys: int, causal: bool, allowed, bias) -> torch.Tensor:
    """Queries ``a..b-1``'s scaled scores over the first ``keys`` keys with the bias added (``[h or 1, n, m]``, or
    ``[h, 1, m]``: one row for every query) and the pairs not allowed (``causal``: key after query) at ``-inf``."""
    if bias is not None:
        scores = scores + (bias[..., a:b, :keys] if bias.shape[-2] > 1 else bias[..., :keys]).to(scores.dtype)
    if causal:
        i, j = torch.arange(a, b, device=scores.device)[:, None], torch.arange(keys, device=scores.device)[None]
        return scores.masked_fill(j > i, float("-inf"))
    if allowed is not None:
        return scores.masked_fill(~allowed[a:b], float("-inf"))
    return scores


def _flipped(q, k, v, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Anti-causal square attention (query ``a`` sees keys ``a..n-1``): the causal call read backwards."""
    out, lse = lse_attention(q.flip(2), k.flip(2), v.flip(2), scale, causal=True)
    return out.flip(2), lse.flip(-1)


class Accumulator:
    """Running ``(out, lse)`` of the queries; ``add`` merges one call's result into a slice of queries (and may
    overwrite that result: pass tensors the caller no longer needs)."""

    def __init__(self, q: torch.Tensor, value_dim: int, dropout: float = 0.0) -> None:
        dtype = accumulation_dtype(q.dtype)
        self.dropout = dropout
        self.out = torch.zeros(*q.shape[:-1], value_dim, dtype=dtype, device=q.device)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        #: query ranges no call has reached yet (a first result there is stored, not merged)
        self._fresh = [(0, q.shape[2])]

    def _first_time(self, start: int, stop: int) -> bool:
        """Whether ``start..stop-1`` is reached for the first time (and mark it reached)."""
        inside = next((r for r in self._fresh if r[0] <= start and stop <= r[1]), None)
        for lo, hi in list(self._fresh):
            if lo < stop and start < hi:
                self._fresh.remove((lo, hi))
                self._fresh += [r for r in ((lo, start), (stop, hi)) if r[0] < r[1]]
        return inside is not None

    def attend(
        self, a: int, b: int, q, k, v, scale: float, first_key: int, allowed=None, causal=False, bias=None, lse_shift=None
    ) -> None:
        """Queries ``a..b-1`` of the output over ``k, v`` (the keys from index ``first_key`` on): see
        ``lse_attention``. ``lse_shift [h or 1, b - a]`` is added to the call's log-sum-exp before the merge (a bias
        whose per-query part the call left out)."""
        out, lse = lse_attention(q, k, v, scale, allowed, causal, bias, self.dropout)
        self.add(a, b, out, lse if lse_shift is None else lse + lse_shift.to(lse.dtype))

    def add(self, start: int, stop: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        grad = torch.is_grad_enabled() and (out.requires_grad or self.out.requires_grad)
        if self._first_time(start, stop) and not grad:
            self.out[:, :, start:stop] = out
            self.lse[:, :, start:stop] = lse
            return
        old_out, old_lse = self.out[:, :, start:stop], self.lse[:, :, start:stop]
        new_lse = torch.logaddexp(old_lse, lse)
        finite = torch.isfinite(new_lse)
        safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
        keep = torch.where(finite, torch.exp(old_lse - safe), torch.zeros_like(safe))
        take = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(safe))
        if grad:
            merged = old_out * keep[..., None] + out * take[..., None]
            self.out, self.lse = self.out.clone(), self.lse.clone()  # autograd keeps the old tensors it saved
            self.out[:, :, start:stop] = merged
        else:  # in place: no temporaries the size of the output (``out`` is the caller's own result)
            old_out.mul_(keep[..., None]).add_(out.mul_(take[..., None]))
        self.lse[:, :, start:stop] = new_lse


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
        self.dtype, self.device = accumulation_dtype(q.dtype), q.device
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
        ctx.save_for_backward(acc.out, acc.lse, *tensors, *masks)
        return acc.out

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
    ``grad_out``, ``delta`` and ``lse`` at its queries, over query tiles of ``FALLBACK_TILE`` (a causal tile
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
    for a in range(0, n, FALLBACK_TILE):
        b = min(n, a + FALLBACK_TILE)
        seen = b if causal else keys  # keys this tile scores
        qt = q[:, :, a:b].to(dtype).unflatten(1, (kv_heads, groups))  # [b, hk, g, t, d]
        scores = (qt @ kd[..., :seen, :].transpose(-1, -2)).flatten(1, 2) * scale  # [b, h, t, seen]
        scores = _tile_scores(scores, a, b, seen, causal, allowed, bias)
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


class SingleQuery:
    """``Accumulator`` for one query per row over all the keys ``v [b, hk, m, d]`` of the call: each
    ``attend`` writes its scores (float32, float64 for float64) into ``scores [b, h, 1, m]`` at the keys it
    covers; ``out`` is the softmax over the row times ``v``. Exact when the calls cover disjoint keys, as the
    regions of one query do (keys no call covers get no weight)."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor) -> None:
        self.v = v
        shape, dtype = (*q.shape[:2], 1, v.shape[2]), accumulation_dtype(q.dtype)
        self.scores = torch.full(shape, float("-inf"), dtype=dtype, device=q.device)

    @staticmethod
    def applies(q: torch.Tensor, k: torch.Tensor) -> bool:
        """One query, no gradients, and a dtype whose scores the flash op would not keep more exactly (a
        half-precision cache on CPU stays on the flash op: float32 copies of its keys cost more than they save)."""
        exact_enough = q.dtype in (torch.float32, torch.float64) or not (_use_flash(q, k) or _use_cuda_flash(q, k, k))
        return q.shape[2] == 1 and not _needs_grad(q, k) and exact_enough

    def attend(self, a: int, b: int, q, k, v, scale: float, first_key: int, allowed=None, causal=False, bias=None) -> None:
        if (a, b) != (0, 1) or causal and k.shape[2] != 1:
            raise ValueError(f"SingleQuery takes the one query 0..1, got {a}..{b} (causal={causal})")
        batch, heads, _, dim = q.shape
        groups = heads // k.shape[1]
        dtype = self.scores.dtype
        scores = q.to(dtype).reshape(batch, k.shape[1], groups, dim) @ k.to(dtype).transpose(-1, -2)  # [b, hk, g, keys]
        scores = scores.reshape(batch, heads, 1, -1) * scale
        if bias is not None:
            scores = scores + bias.to(dtype)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        self.scores[..., first_key : first_key + k.shape[2]] = scores

    @property
    def out(self) -> torch.Tensor:
        batch, heads, _, m = self.scores.shape
        hk = self.v.shape[1]
        weights = torch.softmax(self.scores, dim=-1).reshape(batch, hk, heads // hk, m)
        return (weights @ self.v.to(weights.dtype)).reshape(batch, heads, 1, self.v.shape[-1])


def region(
    acc: Accumulator | SingleQuery,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q0: int,
    near: int,
    far: int | None,
    key_offset: int = 0,
    tile: int = TILE,
    out_offset: int = 0,
    windowed: bool | None = None,
    bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Add the pairs ``i - far <= j <= i - near`` (``far=None``: no lower bound) to ``acc``.

    ``q [b, h, n, d]`` holds queries at positions ``q0..q0+n-1`` (rows ``out_offset..`` of ``acc``);
    ``k, v [b, hk, *, d]`` hold keys at positions ``key_offset..`` (a region that never reaches early keys
    gets only the keys it needs). ``windowed``: one windowed attention call (``window_plan``) instead of the
    pieces, for an ``Accumulator``; by default where CUDA flash attention runs it. ``bias(i, j) -> [h or 1, n, m]``
    at query positions ``i`` and key positions ``j`` (float32) is added to each piece's scores; with a bias (or
    dropout) every piece is an explicitly masked call.
    """
    if windowed is None:
        windowed = _use_cuda_flash(q, k, v) and bias is None
    if windowed and isinstance(acc, Accumulator):  # (one query per row keeps its one score row)
        plan = window_plan(q.shape[2], q0, near, far, key_offset, k.shape[2])
        if plan is not None:
            a, b, lo, hi, left, right = plan
            keys = slice(lo - key_offset, hi + 1 - key_offset)
            result = window_attention(q[:, :, a:b], k[:, :, keys], v[:, :, keys], scale, left, right)
            acc.add(a + out_offset, b + out_offset, *result)
        return
    pieces = _Pieces(acc, q, k, v, scale, q0, near, far, key_offset, out_offset, bias)
    if far is None:
        pieces.lower()
    elif far - near < 1:
        pieces.masked_tiles(tile)
    else:
        pieces.band(min(tile, far - near))


def window_plan(
    n: int, q0: int, near: int, far: int | None, key_offset: int, num_keys: int
) -> tuple[int, int, int, int, int, int] | None:
    """The region ``i - far <= j <= i - near`` of queries at ``q0..q0+n-1`` over keys at
    ``key_offset..key_offset+num_keys-1`` as one flash-attention window: ``(a, b, lo, hi, left, right)``, the
    queries ``a..b-1`` that see a key (every one of them sees at least one), the keys at positions ``lo..hi``, and
    the window around the bottom-right diagonal (see ``window_attention``); ``None`` when no query sees a key.

    Query ``x`` (of ``a..b-1``) aligns with key index ``x - a + sk - sq`` (``sq = b - a``, ``sk = hi - lo + 1``);
    it should see up to position ``q0 + x - near``, index ``x - a + q0 + a - near - lo``, so
    ``right = q0 + b - 1 - near - hi`` (``> 0`` only when the keys end before the last query's bound) and
    ``left = far - near - right`` (``-1``: no lower bound)."""
    if far is not None and far < near:
        return None
    last_key = key_offset + num_keys - 1
    a = max(0, key_offset + near - q0)  # the first query whose nearest bound reaches the keys
    b = n if far is None else min(n, last_key + far - q0 + 1)  # after the last whose farthest bound does
    if b <= a or num_keys <= 0:
        return None
    lo = key_offset if far is None else max(key_offset, q0 + a - far)
    hi = min(last_key, q0 + b - 1 - near)
    right = q0 + b - 1 - near - hi
    left = -1 if far is None else far - near - right
    return a, b, lo, hi, left, right


def window_mask(n: int, m: int, left: int, right: int, device=None) -> torch.Tensor:
    """The ``[n, m]`` pairs of a flash-attention window: ``a + m - n - left <= j <= a + m - n + right``."""
    i = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None]
    allowed = torch.ones(n, m, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


def window_attention(q, k, v, scale: float, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lse_attention`` over a flash-attention window (``window_mask``): the CUDA flash op with its window
    sizes where it runs (no mask is built), else ``lse_attention`` with the window as a mask."""
    if _use_cuda_flash(q, k, v):
        square = q.shape[2] == k.shape[2]
        if left == -1 and (right == -1 or right == 0 and square):  # no band: unmasked, or causal
            return _dense_cuda(q, k, v, scale, causal=right == 0)
        return _flash_cuda(q, k, v, scale, left=left, right=right)
    return lse_attention(q, k, v, scale, window_mask(q.shape[2], k.shape[2], left, right, q.device))


class _Pieces:
    """One region's calls (see ``region``): the key range, the pair rule, where results go."""

    def __init__(self, acc, q, k, v, scale, q0, near, far, key_offset, out_offset, bias=None) -> None:
        self.acc, self.q, self.k, self.v, self.scale = acc, q, k, v, scale
        self.q0, self.near, self.far, self.key_offset, self.out_offset = q0, near, far, key_offset, out_offset
        self.n, self.last_key = q.shape[2], key_offset + k.shape[2] - 1
        self.bias = bias
        #: every piece explicitly masked (a bias block per piece; dropout runs on the matmul path anyway)
        self.masked = bias is not None or bool(getattr(acc, "dropout", 0.0)) or isinstance(acc, Recorder)

    def call(self, a: int, b: int, lo: int, hi: int, kind: str) -> None:
        """Queries ``a..b-1`` (indices) against keys at positions ``lo..hi``: ``"all"`` (every pair allowed),
        ``"causal"`` / ``"anticausal"`` (a square whose pair rule is the diagonal) or ``"masked"``."""
        lo, hi = max(lo, self.key_offset), min(hi, self.last_key)
        if hi < lo or b <= a:
            return
        qt = self.q[:, :, a:b]
        ks = self.k[:, :, lo - self.key_offset : hi + 1 - self.key_offset]
        vs = self.v[:, :, lo - self.key_offset : hi + 1 - self.key_offset]
        at, square = (a + self.out_offset, b + self.out_offset), hi - lo + 1 == b - a
        if self.masked:
            i = torch.arange(self.q0 + a, self.q0 + b, device=self.q.device, dtype=torch.float32)
            j = torch.arange(lo, hi + 1, device=self.q.device, dtype=torch.float32)
            bias = None if self.bias is None else self.bias(i, j)
            if kind == "causal" and square:  # (the square's pair rule is the diagonal, whatever near and far are)
                self.acc.attend(*at, qt, ks, vs, self.scale, lo, causal=True, bias=bias)
                return
            allowed = None
            if kind != "all":
                allowed = j[None] <= i[:, None] - self.near
                if self.far is not None:
                    allowed &= j[None] >= i[:, None] - self.far
                if not bool(allowed.any()):
                    return
            self.acc.attend(*at, qt, ks, vs, self.scale, lo, allowed, bias=bias)
        elif kind == "all":
            self.acc.attend(*at, qt, ks, vs, self.scale, lo)
        elif kind == "causal" and square:
            self.acc.attend(*at, qt, ks, vs, self.scale, lo, causal=True)
        elif kind == "anticausal" and square:  # (never one query: a band tile of one query is one "all" call)
            self.acc.add(*at, *_flipped(qt, ks, vs, self.scale))
        else:  # clipped by the key range, or asked for: the pair rule as an explicit mask
            i = torch.arange(self.q0 + a, self.q0 + b, device=self.q.device)[:, None]
            j = torch.arange(lo, hi + 1, device=self.q.device)[None]
            allowed = j <= i - self.near
            if self.far is not None:
                allowed &= j >= i - self.far
            if bool(allowed.any()):
                self.acc.attend(*at, qt, ks, vs, self.scale, lo, allowed)

    def lower(self) -> None:
        """``key_offset <= j <= i - near``: query ``a`` sees ``a + d + 1`` keys, ``d = q0 - near - key_offset``."""
        d = self.q0 - self.near - self.key_offset
        first = max(0, -d)  # queries before this one see no key
        d += first
        if self.n - first == 1:  # one query (decode): one call
            self.call(first, self.n, self.key_offset, self.key_offset + d, "all")
            return
        # keys every query (from `first` on) sees, then a causal square over the next ones
        self.call(first, self.n, self.key_offset, self.key_offset + d - 1, "all")
        self.call(first, self.n, self.key_offset + d, self.key_offset + d + self.n - first - 1, "causal")

    def band(self, t: int) -> None:
        """Tiles of ``t <= far - near`` queries: the ``t`` nearest keys (causal square), a core every query of
        the tile sees, the ``t`` farthest keys (anti-causal square)."""
        for a in range(0, self.n, t):
            b = min(self.n, a + t)
            p0, p1 = self.q0 + a, self.q0 + b - 1
            if p1 - self.near < self.key_offset or p0 - self.far > self.last_key:
                continue
            size = b - a
            if size == 1:  # one query (decode): one call
                self.call(a, b, p0 - self.far, p0 - self.near, "all")
                continue
            self.call(a, b, p0 - self.far, p0 - self.far + size - 1, "anticausal")
            self.call(a, b, p0 - self.far + size, p0 - self.near - 1, "all")
            self.call(a, b, p0 - self.near, p1 - self.near, "causal")

    def masked_tiles(self, t: int) -> None:
        for a in range(0, self.n, t):
            b = min(self.n, a + t)
            p0, p1 = self.q0 + a, self.q0 + b - 1
            self.call(a, b, p0 - self.far, p1 - self.near, "masked")
