"""The fast path: exact attention over position regions, merged through the log-sum-exp, never ``n x n``.

A region is a set of (query, key) pairs whose scores use one rotation of the queries and one of the keys.
Each is covered by a few exact attention calls that the flash kernel runs at full speed:

* a lower region (``j <= i - near``: everything at least ``near`` behind) is one unmasked call over the keys
  every query sees plus one *causal* square call -- no tiles;
* a band (``i - far <= j <= i - near``) is walked in query tiles of ``t <= far - near`` queries; each tile is
  a causal square (its nearest ``t`` keys), an unmasked core, and an *anti-causal* square (its farthest
  ``t`` keys: the causal call on sequences read backwards);
* pieces clipped by the ends of the key range fall back to a small explicit mask.

Each call (``rope_ext.attention.dispatch``: the op the device runs) returns its output and log-sum-exp, merged by an
``Accumulator`` (``rope_ext.attention.merge``; ``SingleQuery`` for one query per row, ``Recorder`` in
``rope_ext.attention.recorder`` with gradients). Where CUDA flash attention runs, a whole region is *one* call with
window sizes (its window is a band around the bottom-right diagonal: ``window_plan`` maps a region onto it).

Positions here are per row and contiguous: keys at ``0..m-1``, queries at ``q0..q0+n-1`` (the last ``n``
keys). The attention hook compacts padded rows to this form first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import rope_ext.attention.dispatch as dispatch
from rope_ext.attention.merge import Accumulator, SingleQuery
from rope_ext.attention.recorder import Recorder

#: queries per band tile (at most); the flash kernel works in 256-query blocks from 768 queries on
TILE = 1024
#: queries per block of a far region on CPU: the block's rotated queries and output are the temporaries
QUERY_BLOCK = 4096
#: queries per explicitly masked call of the general path (positions with jumps): its mask and bias are that x keys
MASKED_BLOCK = 1024


def query_block(q: torch.Tensor) -> int:
    """How many queries of a far region to rotate and attend at once: ``QUERY_BLOCK`` on CPU (peak memory), all
    of them elsewhere (one call: on CUDA a square causal region goes to cuDNN whole)."""
    return QUERY_BLOCK if q.device.type == "cpu" else max(1, q.shape[2])


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
        windowed = dispatch.use_cuda_flash(q, k, v) and bias is None
    if windowed and isinstance(acc, Accumulator):  # (one query per row keeps its one score row)
        plan = window_plan(q.shape[2], q0, near, far, key_offset, k.shape[2])
        if plan is not None:
            a, b, lo, hi, left, right = plan
            keys = slice(lo - key_offset, hi + 1 - key_offset)
            result = dispatch.window_attention(q[:, :, a:b], k[:, :, keys], v[:, :, keys], scale, left, right)
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
    the window around the bottom-right diagonal (see ``dispatch.window_attention``); ``None`` when no query sees a key.

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


def _flipped(q, k, v, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Anti-causal square attention (query ``a`` sees keys ``a..n-1``): the causal call read backwards."""
    out, lse = dispatch.lse_attention(q.flip(2), k.flip(2), v.flip(2), scale, causal=True)
    return out.flip(2), lse.flip(-1)
