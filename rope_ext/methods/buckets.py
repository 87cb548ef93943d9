"""T5's relative-position buckets read past the distances they were trained on.

T5 (Raffel et al. 2020; Mesh TensorFlow's ``_relative_position_bucket``) adds a learned bias per head for the
bucket of the relative position ``rel = j - i`` (key minus query). Per direction there are ``n`` buckets
(``num_buckets / 2`` in the bidirectional encoder, keys after the query in the second half; ``num_buckets`` in
the causal decoder, where only ``rel <= 0`` occurs); ``e = n // 2`` of them hold the distances ``r = |rel| < e``
exactly, the others ``e + trunc(ln(r / e) / ln(D / e) * (n - e))``, capped at ``n - 1`` (``D = max_distance``,
128). The last bucket so holds every distance from ``e (D / e)^((n - 1 - e) / (n - e))`` on: 91 for t5's 32
buckets, whatever the length. The methods below are rope_ext's own (PI's division of distances, and a longer reach at
the same resolution, applied to buckets; no paper proposes them as such).

* ``t5_bucket_scale`` -- distances divided by ``factor`` before bucketing: the bucket of ``floor(r / factor)``
  with the sign kept, the learned table as it is. A model trained at ``N`` tokens sees at ``factor x N`` the
  buckets it saw at ``N``; neighbours closer than ``factor`` share a bucket.
* ``t5_bucket_extend`` -- the log buckets continued past the last at the same width: the formula above without
  its cap at ``n - 1``, capped at ``n' - 1`` instead, with ``n' = n + ceil((n - e) ln(factor) / ln(D / e))`` per
  direction, so distances up to about ``factor x`` the old reach get buckets of their own. The table grows to
  ``n'`` rows per direction, a parameter the patch owns: every old bucket keeps its distances and its row, the
  new ones start as copies of the old last bucket's row (so the untrained model is the original model) and learn
  from there in training.

``t5_bucket`` is the plain formula, written from the paper's code; with ``cap=None`` it is transformers'
``T5Attention._relative_position_bucket`` operation for operation (the tests compare them on every distance).

DeBERTa-v2/v3 (He et al. 2021; ``make_log_bucket_position``) buckets the relative position ``rel = i - j``
(query minus key) itself: with ``mid = position_buckets / 2``, distances ``< mid`` are kept, larger ones become
``sign(rel) (mid + ceil(ln(r / mid) / ln((P - 1) / mid) (mid - 1)))``, ``P = max_relative_positions`` (512 for
v3), so ``r = P - 1`` reaches bucket ``2 mid - 1``, and the attention clamps every bucket to ``-2 mid .. 2 mid - 1``
(content-to-position and position-to-content alike: both read these positions); keys after the query from ``P``
on land in ``-2 mid``. Without buckets
(``position_buckets <= 0``) the distances are used as they are, clamped at ``P``.

* ``deberta_bucket_scale`` -- distances divided by ``factor`` before bucketing: ``sign(rel) floor(r / factor)``.
* ``deberta_bucket_stretch`` -- the log buckets stretched to ``factor`` times the reach: ``P' - 1 = factor (P -
  1)``; the exact distances below ``mid`` stay, the log ones are spread over ``factor x`` the distances (needs
  ``position_buckets > 0``).

``deberta_log_bucket`` is the plain formula, operation for operation transformers' (``P`` may be a float).

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import HOOK_BUCKET, HOOK_LOG_BUCKET, MethodConfig, register_method
from rope_ext.methods.options import factor_range, option

#: the ``factor`` of every bucket method (required)
BUCKET_FACTOR = factor_range("the distances the buckets cover grow factor times", "shrink the distances the buckets cover")


def t5_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int, cap: int | None = None
) -> torch.Tensor:
    """The bucket of each ``rel = j - i`` (an integer tensor) -> long tensor of the same shape.

    ``num_buckets`` and ``max_distance`` are the trained model's (they fix ``n``, ``e`` and the log width);
    ``cap`` is the number of buckets per direction actually kept (``None``: ``n``, T5's own); keys after the query
    take the buckets from ``cap`` on in a bidirectional table."""
    n = trained_per_direction(bidirectional, num_buckets)
    cap = n if cap is None else cap
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        buckets = buckets + (relative_position > 0).to(torch.long) * cap
        distance = torch.abs(relative_position)
    else:
        distance = -torch.min(relative_position, torch.zeros_like(relative_position))
    exact = n // 2
    small = distance < exact
    # (as T5 computes it, in float32, truncated toward zero: the tests need the very same buckets)
    large = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (n - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, cap - 1))
    return buckets + torch.where(small, distance, large)


def trained_per_direction(bidirectional: bool, num_buckets: int) -> int:
    """T5's buckets per direction: half of them in a bidirectional table, all of them in a causal one."""
    return num_buckets // 2 if bidirectional else num_buckets


def divided(relative_position: torch.Tensor, factor: float) -> torch.Tensor:
    """``sign(rel) floor(|rel| / factor)`` (integer tensor in, the same dtype out), in float64 (float32 where the
    device has none: Apple's MPS)."""
    exact = torch.float32 if relative_position.device.type == "mps" else torch.float64
    scaled = torch.floor(relative_position.abs().to(exact) / float(factor)).to(relative_position.dtype)
    return scaled * torch.sign(relative_position)


@dataclass(frozen=True)
class BucketConfig(MethodConfig):
    """Base of the methods that read a T5 bucket table (hook kind ``bucket``): ``bucket(rel, ...)`` gives each
    relative position's row of ``table(weight, ...)``, the table the patched model reads (``None``: the model's
    own)."""

    hook: ClassVar[str] = HOOK_BUCKET
    required_options: ClassVar[frozenset[str]] = frozenset({"factor"})
    #: whether the method brings a table of its own (a parameter the patch owns)
    grows_table: ClassVar[bool] = False

    factor: float | None = option(
        None, BUCKET_FACTOR, meaning="how many times farther the buckets reach: the distances they cover grow factor "
                                     "times (1: the trained buckets)")

    def per_direction(self, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
        """Rows per direction of the table the patched model reads."""
        return trained_per_direction(bidirectional, num_buckets)

    def bucket(
        self, relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
    ) -> torch.Tensor:
        raise NotImplementedError

    def table(
        self, weight: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
    ) -> torch.Tensor | None:
        """The initial table of a method that grows it (``[rows, heads]``), from the trained one; ``None``: the
        model's own table, read as it is."""
        return None


@register_method
@dataclass(frozen=True)
class T5BucketScaleConfig(BucketConfig):
    """Distances divided by ``factor`` before bucketing: ``bucket(sign(rel) floor(|rel| / factor))``."""

    method: ClassVar[str] = "t5_bucket_scale"
    summary: ClassVar[str] = (
        "T5's relative distances divided by factor before bucketing (Raffel et al. 2020's buckets; PI's idea applied "
        "to them, rope_ext's own), so a model trained at ``N`` tokens sees at ``factor x N`` the buckets it saw at "
        "``N``."
    )

    def bucket(self, relative_position, bidirectional, num_buckets, max_distance):
        return t5_bucket(divided(relative_position, self.factor), bidirectional, num_buckets, max_distance)


@register_method
@dataclass(frozen=True)
class T5BucketExtendConfig(BucketConfig):
    """The log buckets continued at their width to about ``factor x`` the trained reach; the new rows start as
    copies of the last trained one."""

    method: ClassVar[str] = "t5_bucket_extend"
    summary: ClassVar[str] = (
        "T5's log buckets (Raffel et al. 2020) continued past the last at the same width to about factor times the "
        "trained reach (rope_ext's own); the new rows of the table, a parameter the patch owns, start as copies of "
        "the last trained one."
    )
    grows_table: ClassVar[bool] = True

    def per_direction(self, bidirectional, num_buckets, max_distance):
        n = trained_per_direction(bidirectional, num_buckets)
        exact = n // 2
        if self.factor == 1 or max_distance <= exact:
            return n
        extra = (n - exact) * math.log(self.factor) / math.log(max_distance / exact)
        return n + math.ceil(extra - 1e-9)

    def bucket(self, relative_position, bidirectional, num_buckets, max_distance):
        cap = self.per_direction(bidirectional, num_buckets, max_distance)
        return t5_bucket(relative_position, bidirectional, num_buckets, max_distance, cap=cap)

    def table(self, weight, bidirectional, num_buckets, max_distance):
        n = trained_per_direction(bidirectional, num_buckets)
        rows = self.per_direction(bidirectional, num_buckets, max_distance)
        old = torch.arange(rows, device=weight.device).clamp(max=n - 1)  # new bucket b reads old min(b, n - 1)
        if bidirectional:
            old = torch.cat([old, old + n])
        return weight.detach()[old].clone()


# --- DeBERTa-v2/v3 ------------------------------------------------------------------------------------------


def deberta_log_bucket(relative_position: torch.Tensor, bucket_size: int, max_position: float) -> torch.Tensor:
    """DeBERTa's log bucket of each ``rel = i - j`` (integer tensor) -> float tensor of the same shape (whole
    numbers; transformers casts it to long)."""
    sign = torch.sign(relative_position)
    mid = bucket_size // 2
    inside = (relative_position < mid) & (relative_position > -mid)
    distance = torch.where(inside, torch.tensor(mid - 1).type_as(relative_position), torch.abs(relative_position))
    span = torch.log(torch.tensor((max_position - 1) / mid))
    log_position = torch.ceil(torch.log(distance / mid) / span * (mid - 1)) + mid
    return torch.where(distance <= mid, relative_position.type_as(log_position), log_position * sign)


@dataclass(frozen=True)
class LogBucketConfig(MethodConfig):
    """Base of the methods that remap DeBERTa's relative positions (hook kind ``log_bucket``):
    ``positions(rel, position_buckets, max_relative_positions) -> long`` gives what the attention reads."""

    hook: ClassVar[str] = HOOK_LOG_BUCKET
    required_options: ClassVar[frozenset[str]] = frozenset({"factor"})
    needs_buckets: ClassVar[bool] = False

    factor: float | None = option(
        None, BUCKET_FACTOR, meaning="how many times farther the buckets reach: the distances they cover grow factor "
                                     "times (1: the trained buckets)")

    def distances(self, relative_position: torch.Tensor) -> torch.Tensor:
        return relative_position

    def reach(self, max_relative_positions: int) -> float:
        return max_relative_positions

    def positions(
        self, relative_position: torch.Tensor, position_buckets: int, max_relative_positions: int
    ) -> torch.Tensor:
        rel = self.distances(relative_position)
        if position_buckets > 0 and max_relative_positions > 0:
            rel = deberta_log_bucket(rel, position_buckets, self.reach(max_relative_positions))
        return rel.to(torch.long)


@register_method
@dataclass(frozen=True)
class DebertaBucketScaleConfig(LogBucketConfig):
    """DeBERTa's distances divided by ``factor`` before bucketing: ``sign(rel) floor(|rel| / factor)``."""

    method: ClassVar[str] = "deberta_bucket_scale"
    summary: ClassVar[str] = (
        "DeBERTa-v2/v3's relative distances (He et al. 2021) divided by factor before its log bucketing, "
        "``sign(rel) floor(|rel| / factor)``."
    )

    def distances(self, relative_position):
        return divided(relative_position, self.factor)


@register_method
@dataclass(frozen=True)
class DebertaBucketStretchConfig(LogBucketConfig):
    """DeBERTa's log buckets spread over ``factor x`` the distances: ``max_relative_positions - 1`` times
    ``factor``; the exact buckets below ``position_buckets / 2`` kept."""

    method: ClassVar[str] = "deberta_bucket_stretch"
    summary: ClassVar[str] = (
        "DeBERTa-v2/v3's log buckets (He et al. 2021) spread over factor times the distances, "
        "``max_relative_positions - 1`` times factor; the exact buckets below ``position_buckets / 2`` kept."
    )
    needs_buckets: ClassVar[bool] = True

    def reach(self, max_relative_positions):
        return self.factor * (max_relative_positions - 1) + 1
