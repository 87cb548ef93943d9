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
        assert bias.dtype == torch.float32  # (BiasConfig's contract; the table is computed in float64)
        expected = [_sandwich_by_hand(d, 64, h, 8) for h in range(1, 9)]
        assert bias[:, 0, 0].tolist() == pytest.approx(expected, abs=4e-6), d
    fresh = make_config("sandwich").module(8, head_dim=64)  # (a first call past the initial 1,024 rows)
    bias = fresh(torch.tensor([2500.0, 2501.0]), torch.tensor([0.0]))  # [8, 2, 1]
    assert bias[0, :, 0].tolist() == pytest.approx([_sandwich_by_hand(d, 64, 1, 8) for d in (2500, 2501)], abs=4e-6)


def test_sandwich_with_no_query_or_no_key_is_an_empty_bias():
    module = make_config("sandwich").module(8, head_dim=64)
    assert module(torch.zeros(0), torch.arange(3.0)).shape == (8, 0, 3)
    assert module(torch.arange(3.0), torch.zeros(0)).shape == (8, 3, 0)


@pytest.mark.parametrize(("head_dim", "shown"), [(15, "15"), (None, "None")])
def test_sandwich_refuses_an_odd_or_missing_head_dimension(head_dim, shown):
    """Without ``dim`` Sandwich takes the head dimension, which must be even (d'/2 cosines)."""
    with pytest.raises(ValueError, match=rf"^sandwich: give dim \(an even int\); the model's head dimension is {shown}$"):
        make_config("sandwich").module(4, head_dim=head_dim)
    assert make_config("sandwich:dim=16").module(4, head_dim=15)(torch.tensor([1.0]), torch.tensor([0.0])).shape == (
        4, 1, 1)


@pytest.mark.parametrize("method", ["alibi", "sandwich"])
def test_a_fixed_bias_has_no_state_to_save(method):
    """ALiBi's slopes and Sandwich's compressions and distance table are buffers kept out of the state dict (the
    table grows with the distances asked: saved, it would not reload into a fresh module)."""
    module = make_config(method).module(8, head_dim=64)
    module(torch.arange(40.0), torch.arange(40.0))
    assert module.state_dict() == {} and len(list(module.buffers())) >= 1


@pytest.mark.parametrize("method", ["kerple", "fire"])
def test_a_learnable_bias_module_without_an_index_is_layer_zero(method):
    """``module(heads)`` initialises layer 0's parameters (the layer index seeds the generator; layers differ)."""
    config = make_config(method)
    default, first, second = config.module(4), config.module(4, index=0), config.module(4, index=1)
    for (name, a), b, c in zip(default.named_parameters(), first.parameters(), second.parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(b, c) for b, c in zip(first.parameters(), second.parameters()))


def test_fire_runs_in_the_dtype_of_its_mlp():
    """A model cast to bf16 casts FIRE's MLP: the normalised distances are cast to it, and the bias stays within
    bf16's rounding of the float32 module's."""
    fire = make_config("fire").module(2)
    q, k = torch.tensor([10.0, 600.0]), torch.tensor([0.0, 5.0])
    exact = fire(q, k)
    low = fire.to(torch.bfloat16)(q, k)
    assert low.dtype == torch.float32 and low.shape == (2, 2, 2)
    torch.testing.assert_close(low, exact, rtol=0, atol=0.02)


def test_fire_mlp_starts_as_pytorchs_linear_default():
    """FIRE's MLP starts as ``nn.Linear``'s default (the reference builds plain ``nn.Linear`` layers): weights and
    biases uniform on (-1/sqrt(fan_in), 1/sqrt(fan_in)), here 1 for the first layer (one input) and 1/64 for the
    second (4,096 hidden units); drawn from the patch's own generator."""
    fire = make_config("fire", width=4096).module(64)
    for values, bound in [(fire.mlp[0].weight, 1.0), (fire.mlp[0].bias, 1.0),
                          (fire.mlp[2].weight, 1 / 64), (fire.mlp[2].bias, 1 / 64)]:
        values = values.detach().double().flatten()
        close = 0.98 if values.numel() > 1000 else 0.85  # (64 biases: their extremes lie further in)
        assert -bound <= values.min().item() < -close * bound and close * bound < values.max().item() <= bound
        assert abs(values.mean().item()) < 0.1 * bound
