"""Confidence intervals (rope_ext.eval.intervals) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rope_ext.eval.intervals import LEVEL, RESAMPLES, bootstrap, mean_nll_ppl, normal_quantile, ppl_ratio, wilson


def test_defaults_and_the_normal_quantile():
    assert (LEVEL, RESAMPLES) == (0.95, 2000)
    assert normal_quantile() == pytest.approx(1.959963984540054, abs=1e-12)
    assert normal_quantile(0.9) == pytest.approx(1.6448536269514722, abs=1e-12)


@pytest.mark.parametrize(("successes", "trials", "low", "high"), [
    (0, 10, 0.0, 0.2775327998628892),  # z^2 / (n + z^2)
    (10, 10, 0.7224672001371108, 1.0),
    (5, 10, 0.2365930905452820, 0.7634069094547180),
    (3, 3, 0.4385029682449546, 1.0),
    (1, 20, 0.0088814488007954, 0.2361311934467420),  # (statsmodels: 0.00888, 0.23613)
])
def test_wilson_intervals_at_hand_values(successes, trials, low, high):
    got = wilson(successes, trials)
    assert got == pytest.approx((low, high), abs=1e-9)


def test_wilson_is_exactly_0_and_1_at_the_ends():
    """(A trial found low 5.6e-15 above a score of 0, high 1 - 1e-16 below a score of 1: rounding.)"""
    for n in range(1, 30):
        assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0


def test_wilson_refuses_impossible_counts():
    for successes, trials in ((1, 0), (-1, 3), (4, 3)):
        with pytest.raises(ValueError, match="a proportion needs 0 <= successes <= trials and trials >= 1"):
            wilson(successes, trials)
    with pytest.raises(ValueError, match=r"confidence level must be in \(0, 1\), got 1.5"):
        wilson(1, 2, level=1.5)


def test_bootstrap_of_a_mean_is_seeded_covers_the_mean_and_narrows_with_more_units():
    g = torch.Generator().manual_seed(1)
    few, many = torch.randn(10, generator=g).tolist(), torch.randn(400, generator=g).tolist()
    mean = lambda x: x.mean(-1)  # noqa: E731
    a = bootstrap(few, mean, seed=3)
    assert a == bootstrap(few, mean, seed=3) and a != bootstrap(few, mean, seed=4)
    assert a[0] < sum(few) / len(few) < a[1]
    b = bootstrap(many, mean)
    assert b[1] - b[0] < (a[1] - a[0]) / 3  # (width ~ 1/sqrt(n): 400 units against 10)
    assert abs((b[1] - b[0]) - 2 * 1.96 / math.sqrt(400)) < 0.05  # (unit variance: the normal interval's width)
    assert bootstrap([7.0], mean) == (7.0, 7.0)
    assert bootstrap([2.0] * 5, mean) == (2.0, 2.0)
    with pytest.raises(ValueError, match="at least one unit"):
        bootstrap([], mean)


def test_perplexity_and_paired_ratio_statistics():
    windows = [(2.0, 1.0), (4.0, 1.0)]  # (nll sum, tokens) of two windows
    assert mean_nll_ppl(torch.tensor([windows], dtype=torch.float64)).item() == pytest.approx(math.exp(3.0))
    paired = torch.tensor([[(2.0, 1.0, 2.0), (4.0, 3.0, 2.0)]], dtype=torch.float64)  # (nll_a, nll_b, tokens)
    assert ppl_ratio(paired).item() == pytest.approx(math.exp((6.0 - 4.0) / 4.0))
    # paired: the same windows on both sides, so a ratio that is the same on every window has no spread
    units = [(1.0 + k, 0.5 + k, 1.0) for k in range(8)]
    low, high = bootstrap(units, ppl_ratio)
    assert low == pytest.approx(math.exp(0.5)) and high == pytest.approx(math.exp(0.5))


def _record(document: str, mean_nll: float, tokens: int):
    from rope_ext.eval.perplexity import PerplexityRecord

    return PerplexityRecord(method="m", config=[], protocol="fixed", document=document, length=8, start=0, end=tokens,
                            tokens_scored=tokens, mean_nll=mean_nll, perplexity=math.exp(mean_nll), seconds=0.0,
                            peak_memory_mb=0.0)


def test_paired_takes_the_shared_documents_weighted_by_their_own_tokens():
    """``perplexity.paired``: the ratio over the documents both sides scored, base's NLL per token weighted by the
    records' own tokens; a record read back from JSON with a field it does not know."""
    from rope_ext.eval.perplexity import PerplexityRecord, paired

    mine = [_record("a", 2.0, 10), _record("b", 3.0, 30), _record("c", 9.0, 5)]
    base = [_record("d", 0.1, 7), _record("b", 3.5, 60), _record("a", 1.5, 10)]  # (b: 60 tokens, weighted by 30)
    got = paired(mine, base)
    # by hand: a 20 vs 15, b 90 vs 105, over 40 tokens; c and d unshared
    assert got["documents"] == 2 and got["tokens_scored"] == 40
    assert got["perplexity"] == pytest.approx(math.exp(110 / 40), rel=1e-12)
    assert got["ratio"] == pytest.approx(math.exp((110 - 120) / 40), rel=1e-12)
    assert got["ratio_low"] <= got["ratio"] <= got["ratio_high"] and got["low"] <= got["perplexity"] <= got["high"]
    # (a resample of two documents: the interval's ends are the all-b and all-a resamples, per token -0.5 and +0.5)
    assert (got["ratio_low"], got["ratio_high"]) == pytest.approx((math.exp(-0.5), math.exp(0.5)), rel=1e-12)
    assert paired(mine[2:], base) is None and paired(mine, []) is None
    line = {**mine[0].to_dict(), "added_later": 1}
    assert PerplexityRecord.from_dict(line) == mine[0]
