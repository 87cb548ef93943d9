"""Confidence intervals of the evaluations' numbers.

* ``wilson`` -- a proportion (retrieval: correct trials of a cell) with Wilson's score interval (Wilson 1927), which
  stays inside [0, 1] and is not empty at 0 or n successes, unlike the normal approximation.
* ``bootstrap`` -- a statistic of independent units (perplexity: the target windows) with the percentile bootstrap
  interval: the units resampled with replacement ``resamples`` times from a seeded generator, the statistic of each
  resample, its ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles. Paired comparisons resample the units of both
  sides together (the same windows), so that what the windows share cancels.

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

#: the confidence level of every interval rope-ext reports
LEVEL = 0.95
#: bootstrap resamples
RESAMPLES = 2000


def normal_quantile(level: float = LEVEL) -> float:
    """``z`` with ``P(|Z| <= z) = level`` for a standard normal ``Z`` (1.959964 at 0.95)."""
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    return math.sqrt(2.0) * torch.special.erfinv(torch.tensor(level, dtype=torch.float64)).item()


def wilson(successes: int, trials: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson's score interval of a proportion: ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)``."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"a proportion needs 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    z = normal_quantile(level)
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # (exactly 0 at no successes and 1 at all: the formula's own bounds, which rounding would leave a hair off)
    return 0.0 if successes == 0 else max(0.0, centre - half), 1.0 if successes == trials else min(1.0, centre + half)


def bootstrap(
    units: Sequence[Sequence[float]] | Sequence[float],
    statistic: Callable[[torch.Tensor], torch.Tensor],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over ``units`` (``[n]`` values, or ``[n, k]``: k values per
    unit resampled together, the paired case). ``statistic`` maps ``[resamples, n(, k)]`` float64 to
    ``[resamples]``. One unit gives the point itself (nothing to resample)."""
    values = torch.as_tensor(units, dtype=torch.float64)
    if values.numel() == 0 or values.shape[0] == 0:
        raise ValueError("a bootstrap interval needs at least one unit")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    n = values.shape[0]
    if n == 1:
        point = statistic(values[None]).item()
        return point, point
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, n, (resamples, n), generator=generator)
    stats = statistic(values[picks])
    low, high = torch.quantile(stats, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return low.item(), high.item()


def mean_nll_ppl(resampled: torch.Tensor) -> torch.Tensor:
    """Perplexity of resampled windows, each unit ``(nll_sum, tokens)``: ``exp(sum nll / sum tokens)``."""
    return torch.exp(resampled[..., 0].sum(-1) / resampled[..., 1].sum(-1))


def ppl_ratio(resampled: torch.Tensor) -> torch.Tensor:
    """Ratio of two perplexities over the same resampled windows, each unit ``(nll_a, nll_b, tokens)``:
    ``exp((sum nll_a - sum nll_b) / sum tokens)``."""
    return torch.exp((resampled[..., 0].sum(-1) - resampled[..., 1].sum(-1)) / resampled[..., 2].sum(-1))
