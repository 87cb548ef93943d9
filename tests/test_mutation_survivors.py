"""Tests for mutants that survived `mutmut` (issue #34; docs/testing.md, "Mutation testing"): each pins behaviour no
selected test reached, against values computed here from the paper's formula in plain ``math``."""

from __future__ import annotations

import math

import pytest
import torch

from rope_ext.methods import make_config


def _sandwich_by_hand(d: int, dim: int, head: int, heads: int) -> float:
    """Sandwich (arXiv:2212.10356) with NeMo's compression: (sum_{k=1..d'/2} cos(d / 10000^(2k/d')) - d'/2) / (8h/H)."""
    inner = sum(math.cos(d / 10000 ** (2 * k / dim)) for k in range(1, dim // 2 + 1)) - dim / 2
    return inner / (8 * head / heads)


def test_sandwich_at_distances_up_to_its_table_and_past_it():
    """The distance table starts at 1,024 rows and grows: a distance of exactly 1,024 (the first call's largest),
    then 1,025 (one past the grown table), then 3,000, then a short one again, each equal to the formula in float64
    (within float32's rounding of values near -24: the table is computed in float64; in float32 the error at 1,024
    is 2e-5)."""
    module = make_config("sandwich").module(8, head_dim=64)
    for d in (1024, 1025, 3000, 10):
        bias = module(torch.tensor([float(d)]), torch.tensor([0.0]))  # [8, 1, 1]
        expected = [_sandwich_by_hand(d, 64, h, 8) for h in range(1, 9)]
        assert bias[:, 0, 0].tolist() == pytest.approx(expected, abs=4e-6), d
    fresh = make_config("sandwich").module(8, head_dim=64)  # (a first call past the initial 1,024 rows)
    bias = fresh(torch.tensor([2500.0, 2501.0]), torch.tensor([0.0]))  # [8, 2, 1]
    assert bias[0, :, 0].tolist() == pytest.approx([_sandwich_by_hand(d, 64, 1, 8) for d in (2500, 2501)], abs=4e-6)
