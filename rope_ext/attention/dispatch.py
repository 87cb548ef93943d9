"""One exact attention call with its log-sum-exp, on the op the device runs.

``lse_attention`` returns a call's output and log-sum-exp, the pieces every region kernel merges. It goes to
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` on CPU (it returns the LSE, takes GQA key/value heads
as they are, skips the blocks a causal call never needs). On CUDA in float16 / bfloat16 unmasked and causal calls go
to ``torch.ops.aten._flash_attention_forward`` (or cuDNN where SDPA prefers it), a region's flash-attention window to
the same op with window sizes (``window_attention``), and other calls to the memory-efficient op (float32, or an
explicit mask). Without either (other devices, float64, dropout) a plain matmul-softmax over query tiles does it
(``FALLBACK_TILE``); all are exact. The ops have no derivative for their LSE: with gradients the calls are recorded
instead (``rope_ext.attention.recorder``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

#: queries per matmul of the fallback path (its score block is ``FALLBACK_TILE x keys``)
FALLBACK_TILE = 512


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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, softmax and merged outputs: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def needs_grad(q: torch.Tensor, k: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)


def use_cpu_flash(q: torch.Tensor, k: torch.Tensor) -> bool:
    half_or_single = q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return q.device.type == "cpu" and half_or_single and not needs_grad(q, k)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(q: torch.Tensor) -> tuple[int, int]:
    return _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())


def use_cuda_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA flash attention: half precision, one head size up to 256 for queries, keys and values, an Ampere or
    later GPU, and SDPA's flash backend not switched off (``torch.backends.cuda.enable_flash_sdp``)."""
    half = q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
    dims = q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256
    if not (q.device.type == "cuda" and half and dims and not needs_grad(q, k)):
        return False
    return torch.backends.cuda.flash_sdp_enabled() and _device_capability(q) >= (8, 0)


def _use_cuda_efficient(q: torch.Tensor, k: torch.Tensor) -> bool:
    single = q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    enabled = torch.backends.cuda.mem_efficient_sdp_enabled()
    return q.device.type == "cuda" and single and enabled and not needs_grad(q, k)


def _use_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """cuDNN attention where SDPA itself prefers it (Hopper and later): about 1.6x the flash op's speed there."""
    return use_cuda_flash(q, k, v) and torch.backends.cuda.cudnn_sdp_enabled() and _device_capability(q) >= (9, 0)


def _dense_cuda(q, k, v, scale, causal=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked or square causal attention in half precision on CUDA: cuDNN (causal there is top-left: square
    calls only) or the flash op."""
    if _use_cudnn(q, k, v) and (not causal or q.shape[2] == k.shape[2]):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.reshape(q.shape[:3])
    return _flash_cuda(q, k, v, scale, causal=causal, right=0 if causal else -1)


def _flash_cuda(q, k, v, scale, causal=False, left=-1, right=-1) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._flash_attention_forward`` on ``[b, h, *, d]`` tensors (GQA heads as they are): query ``a`` sees
    key ``j`` when ``a + m - n - left <= j <= a + m - n + right`` (``-1``: no bound; ``causal``: ``right = 0``)."""
    n, m = q.shape[2], k.shape[2]
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, n, m, 0.0, causal, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )
    return out.transpose(1, 2), lse


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
    return out, lse[..., : q.shape[2]]


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
    optional additive ``bias [h or 1, n, m]`` on the scaled scores -> ``(out [b, h, n, d], lse [b, h, n])``: ``lse``
    in float32 (float64 for float64 inputs), ``out`` in the op's dtype (the flash ops: the call's, unconverted; the
    matmul path: float32); a query with no allowed key gets ``out = 0``, ``lse = -inf``.
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
    elif use_cpu_flash(q, k):
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
    elif allowed is None and bias is None and use_cuda_flash(q, k, v):
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
        scores = tile_scores(scores, a, b, keys, causal, allowed, bias)
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        if dropout:
            weights = torch.nn.functional.dropout(weights, p=dropout)
        outs.append(weights @ v[:, :, :keys])
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def tile_scores(scores, a: int, b: int, keys: int, causal: bool, allowed, bias) -> torch.Tensor:
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
    if use_cuda_flash(q, k, v):
        square = q.shape[2] == k.shape[2]
        if left == -1 and (right == -1 or right == 0 and square):  # no band: unmasked, or causal
            return _dense_cuda(q, k, v, scale, causal=right == 0)
        return _flash_cuda(q, k, v, scale, left=left, right=right)
    return lse_attention(q, k, v, scale, window_mask(q.shape[2], k.shape[2], left, right, q.device))
