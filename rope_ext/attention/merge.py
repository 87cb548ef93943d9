"""Merging attention calls: the softmax over a union of key sets from each set's ``(out, lse)``.

``Accumulator`` keeps the running ``(out, lse)`` of the queries and merges each call's result into it:
``out = sum_r exp(lse_r - lse) out_r`` with ``lse = logsumexp_r lse_r``, exactly the softmax over the union. One
query per row (decode) needs no merging: the regions of a single query split its keys, so ``SingleQuery`` writes
each region's scores into one score row over all keys and takes one softmax and one product with the values (a few
small matmuls instead of a flash call per region).
"""

from __future__ import annotations

import torch

import rope_ext.attention.dispatch as dispatch


class Accumulator:
    """Running ``(out, lse)`` of the queries; ``add`` merges one call's result into a slice of queries (and may
    overwrite that result: pass tensors the caller no longer needs).

    A first result over every query is kept as it came, in the call's dtype (the flash ops return half precision
    outputs): a single call then costs no copy, and a first merge over every query reads it into float32 while
    scaling it (one pass instead of a conversion, a copy and a scaling; a merge over some queries converts it
    first). Merged outputs are float32 (float64 for float64 calls)."""

    def __init__(self, q: torch.Tensor, value_dim: int, dropout: float = 0.0) -> None:
        self.dtype = dispatch.accumulation_dtype(q.dtype)
        self.dropout = dropout
        self.shape, self.device = (*q.shape[:-1], value_dim), q.device
        self._out: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None
        #: query ranges no call has reached yet (a first result there is stored, not merged)
        self._fresh = [(0, q.shape[2])]

    @property
    def out(self) -> torch.Tensor:
        """``[b, h, n, dv]``: float32 (float64), or a single call's output over every query as it came; zeros
        where no call reached."""
        self._allocate()
        return self._out

    @property
    def lse(self) -> torch.Tensor:
        self._allocate()
        return self._lse

    def _allocate(self) -> None:
        if self._out is None:
            self._out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self._lse = torch.full(self.shape[:-1], float("-inf"), dtype=self.dtype, device=self.device)

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
        ``dispatch.lse_attention``. ``lse_shift [h or 1, b - a]`` is added to the call's log-sum-exp before the merge (a bias
        whose per-query part the call left out)."""
        out, lse = dispatch.lse_attention(q, k, v, scale, allowed, causal, bias, self.dropout)
        self.add(a, b, out, lse if lse_shift is None else lse + lse_shift.to(lse.dtype))

    def add(self, start: int, stop: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        grad = torch.is_grad_enabled() and (out.requires_grad or self._out is not None and self._out.requires_grad)
        first = self._first_time(start, stop)
        if first and not grad and self._out is None and (start, stop) == (0, self.shape[2]):
            self._out, self._lse = out, lse.to(self.dtype)  # (kept as it came: see the class)
            return
        self._allocate()
        if first and not grad:
            self._out[:, :, start:stop] = out
            self._lse[:, :, start:stop] = lse
            return
        old_lse = self._lse[:, :, start:stop]
        new_lse = torch.logaddexp(old_lse, lse)
        # (a query no call has seen yet: both -inf, weights exp(-inf - 0) = 0; six launches, where a where() per
        # weight took fourteen: on CUDA each launch costs more than a merge's arithmetic)
        safe = torch.nan_to_num(new_lse, neginf=0.0)
        keep, take = torch.exp(old_lse - safe), torch.exp(lse - safe)
        if grad:
            merged = self._out[:, :, start:stop] * keep[..., None] + out * take[..., None]
            self._out, self._lse = self._out.to(self.dtype, copy=True), self._lse.clone()  # (autograd keeps the old)
            self._out[:, :, start:stop] = merged
        elif self._out.dtype != self.dtype and (start, stop) == (0, self.shape[2]):  # (read into float32 as scaled)
            self._out = (self._out * keep[..., None]).addcmul_(out, take[..., None])
        else:  # in place: no temporaries the size of the output (a first result kept as it came read into float32)
            if self._out.dtype != self.dtype:
                self._out = self._out.to(self.dtype)
            self._out[:, :, start:stop].mul_(keep[..., None]).addcmul_(out, take[..., None])
        self._lse[:, :, start:stop] = new_lse


#: the most memory (bytes) a half-precision decode step with a bias on CUDA may take for float32 copies of one
#: layer's keys and values on the one-row matmul path (``SingleQuery``); above it, the memory-efficient op
SINGLE_QUERY_COPY_BYTES = 512 * 2**20


class SingleQuery:
    """``Accumulator`` for one query per row over all the keys ``v [b, hk, m, d]`` of the call: each
    ``attend`` writes its scores (float32, float64 for float64) into ``scores [b, h, 1, m]`` at the keys it
    covers; ``out`` is the softmax over the row times ``v``. Exact when the calls cover disjoint keys, as the
    regions of one query do (keys no call covers get no weight)."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor) -> None:
        self.v = v
        shape, dtype = (*q.shape[:2], 1, v.shape[2]), dispatch.accumulation_dtype(q.dtype)
        self.scores = torch.full(shape, float("-inf"), dtype=dtype, device=q.device)

    @staticmethod
    def applies(q: torch.Tensor, k: torch.Tensor, biased: bool = False) -> bool:
        """One query, no gradients, and a dtype whose scores the flash op would not keep more exactly (a
        half-precision cache on CPU stays on the flash op: float32 copies of its keys cost more than they save).
        With a bias (``biased``) on CUDA in half precision too, while the float32 copies of the keys and values
        stay within ``SINGLE_QUERY_COPY_BYTES``: there the call with a bias is the memory-efficient op, which runs
        one query row in as many blocks as rows and heads (0.9 ms a layer over 16k keys on an H200, 30 ms of device
        time a decode step of the default model against SDPA's 2.7; 12 ms this way)."""
        cpu_or_cuda_flash = dispatch.use_cpu_flash(q, k) or dispatch.use_cuda_flash(q, k, k)
        exact_enough = q.dtype in (torch.float32, torch.float64) or not cpu_or_cuda_flash
        copies = 2 * k.numel() * 4  # (bytes of float32 keys and values)
        exact_enough = exact_enough or (biased and q.device.type == "cuda" and copies <= SINGLE_QUERY_COPY_BYTES)
        return q.shape[2] == 1 and not dispatch.needs_grad(q, k) and exact_enough

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
