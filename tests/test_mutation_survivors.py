"""Tests for mutants that survived `mutmut` (issue #34; docs/testing.md, "Mutation testing"): each pins behaviour no
selected test reached, against values computed here from the paper's formula in plain ``math`` (or, for DeBERTa's
buckets, against transformers' own functions)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position, make_log_bucket_position

from rope_ext.methods import deberta_log_bucket, make_config
from rope_ext.methods.absolute import sinusoids


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


# --- the tables, buckets and xPos (docs/results/mutation/tables.json) --------------------------------------------


def _pe(k: int, d: int, base: float = 10000.0) -> list[float]:
    """Vaswani et al.: PE(k, 2i) = sin(k / base^(2i/d)), PE(k, 2i+1) = cos(k / base^(2i/d))."""
    return [(math.sin if j % 2 == 0 else math.cos)(k / base ** (2 * (j // 2) / d)) for j in range(d)]


def test_sinusoids_at_far_positions_are_vaswanis_to_float32s_rounding():
    """Angles up to 1e5 (d = 64): every value within float32's rounding of the float64 formula (frequencies in
    float32 would put the angle at position k off by up to k x 6e-8: 3e-3 here)."""
    positions = [1000, 5000, 20000, 100000]
    expected = torch.tensor([_pe(k, 64) for k in positions], dtype=torch.float64)
    torch.testing.assert_close(sinusoids(torch.tensor(positions), 64).double(), expected, rtol=0, atol=1e-7)


def test_sinusoidal_scale_base_and_dtype():
    """``scale=None``: the learned table's root mean square over a sinusoid's, sqrt(1/2): a float64 table of 3s gives
    3 sqrt(2) PE; ``scale=2, base=100`` gives 2 PE with 100 for 10000 (k = 7: angle 0.7 on the second pair, not
    0.07); the embeddings in the table's dtype."""
    positions = torch.tensor([0, 1, 7])
    table = torch.full((5, 4), 3.0, dtype=torch.float64)
    got = make_config("sinusoidal").embed(table, positions)
    assert got.dtype == torch.float64
    expected = [[3 * math.sqrt(2) * v for v in _pe(k, 4)] for k in (0, 1, 7)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=2e-7, atol=1e-7)
    got = make_config("sinusoidal", scale=2.0, base=100.0).embed(table.to(torch.bfloat16), positions)
    assert got.dtype == torch.bfloat16
    expected = [[2 * v for v in _pe(k, 4, 100.0)] for k in (0, 1, 7)]
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=8e-3)


def test_abs_interp_reads_far_positions_at_their_exact_fraction():
    """factor 3 on 2,048 rows alternating 0 and 1: position k reads rows floor(k / 3) and the next one with weight
    (k mod 3) / 3, so the embedding is that weight or its complement (the last position, 3 x 2047, is row 2047: 1).
    Near k = 6,100, k / 3 in float32 is off by up to 6e-5 (its spacing there is 1.2e-4)."""
    table = torch.tensor([[0.0], [1.0]]).repeat(1024, 1)
    positions = [6100, 6101, 6119, 6131, 6137, 6140, 6141]
    got = make_config("abs_interp:factor=3").embed(table, torch.tensor(positions))[:, 0].tolist()
    expected = []
    for k in positions:
        low, weight = k // 3, (k % 3) / 3
        expected.append((1 - weight) * (low % 2) + weight * ((low + 1) % 2) if low < 2047 else 1.0)
    assert got == pytest.approx(expected, abs=2e-7)


def test_abs_hierarchical_past_the_tables_rows_is_su_s_formula():
    """Su's q_k = a u_{k // N} + (1 - a) u_{k mod N}, u_i = (p_i - a p_0) / (1 - a), a = 0.4, on N = 3 rows 2, 5, -3
    (p_0 is not 1: a p_0 and a / p_0 differ): u = 2, 7, -19/3; k = 3 (the first past the rows): 0.4 x 7 + 0.6 x 2 =
    4; k = 4: 7; k = 5: 2.8 - 3.8 = -1; k = 6: -7.6/3 + 1.2 = -4/3; k = 8: -19/3; k < 3: the rows."""
    table = torch.tensor([[2.0], [5.0], [-3.0]], dtype=torch.float64)
    got = make_config("abs_hierarchical").embed(table, torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]))[:, 0].tolist()
    assert got == pytest.approx([2.0, 5.0, -3.0, 4.0, 7.0, -1.0, -4 / 3, -19 / 3], rel=1e-12)


@pytest.mark.parametrize(("method", "positions", "message"), [
    ("abs_interp:factor=2", [0, 5], ("abs_interp: position 5 is past the 5 positions this method reaches from a "
                                     "3-row table (factor 2 reaches factor x (rows - 1) + 1; use a larger factor)")),
    ("abs_hierarchical", [9, 1], ("abs_hierarchical: position 9 is past the 9 positions this method reaches from a "
                                  "3-row table (rows^2 positions; abs_interp with a larger factor or sinusoidal reach "
                                  "further)")),
    ("abs_interp:factor=2", [2, -1], "abs_interp: positions must be >= 0, got -1"),
    ("sinusoidal", [4, -2, -1], "sinusoidal: positions must be >= 0, got -2"),
])
def test_a_table_read_past_its_reach_or_before_zero_is_refused_with_the_whole_message(method, positions, message):
    with pytest.raises(ValueError) as raised:
        make_config(method).embed(torch.zeros(3, 4), torch.tensor(positions))
    assert str(raised.value) == message


def test_xpos_decay_bases_follow_gamma():
    """zeta_i = (2i/r + gamma) / (1 + gamma), r = 8, gamma = 0.8: 0.8/1.8, 1.05/1.8, 1.3/1.8, 1.55/1.8."""
    got = make_config("xpos", gamma=0.8).zeta(8).tolist()
    assert got == pytest.approx([0.8 / 1.8, 1.05 / 1.8, 1.3 / 1.8, 1.55 / 1.8], rel=1e-12)


def test_xpos_factors_at_a_scale_base_that_is_no_power_of_two():
    """zeta_i^(offset / B) at B = 100 for offsets within a safe block (638 here), to float32's rounding (6e-8
    relative): the exponent in float32 would be off by up to 2.4e-7, the factor by 3e-7 relative."""
    offsets = list(range(-630, 631, 7))
    zeta = [(2 * i / 8 + 0.4) / 1.4 for i in range(4)]
    expected = torch.tensor([[z ** (o / 100) for z in zeta] for o in offsets], dtype=torch.float64)
    got = make_config("xpos", scale_base=100.0).factors(torch.tensor(offsets), 8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1.2e-7, atol=0)


def test_xpos_safe_block_is_one_query_where_one_step_passes_e8():
    """The block's factors stay within e^8: at scale_base 0.1 one position of offset scales pair 0 by
    zeta_0^(-1/0.1) = 3.5^10 = 2.8e5, past e^8 (2981), so every query is a block of its own (8 x 0.1 / ln 3.5 =
    0.64); at 512, 8 x 512 / ln 3.5 = 3269.4."""
    assert (1.4 / 0.4) ** 10 > math.exp(8)
    assert make_config("xpos", scale_base=0.1).safe_block(8) == 1
    assert make_config("xpos").safe_block(8) == 3269


def test_scaled_t5_buckets_read_the_trained_tables_rows():
    """t5_bucket_scale keeps the trained table: per direction num_buckets // 2 in the encoder (bidirectional),
    num_buckets in the decoder."""
    config = make_config("t5_bucket_scale", factor=4)
    got = [config.per_direction(b, n, 128) for n in (32, 33) for b in (True, False)]
    assert got == [16, 32, 16, 33]


def test_grown_t5_table_at_an_odd_count_and_without_log_buckets():
    """n' = n + ceil((n - e) ln(factor) / ln(D / e)), e = n // 2. 30 buckets, bidirectional: n = 15, e = 7; factor 3,
    D = 128: 15 + ceil(8 ln 3 / ln(128 / 7) = 3.02) = 19 (e = 7.5 would give 18). D <= e: no log buckets to
    continue, n stays (D = e = 8 in the encoder of 32; D = 10 < e = 16 in the decoder)."""
    assert 8 * math.log(3) / math.log(128 / 7) == pytest.approx(3.0243, abs=1e-4)
    assert make_config("t5_bucket_extend", factor=3).per_direction(True, 30, 128) == 19
    assert make_config("t5_bucket_extend", factor=2).per_direction(True, 32, 8) == 16
    assert make_config("t5_bucket_extend", factor=2).per_direction(False, 32, 10) == 32


def test_distances_are_divided_in_float64_on_the_cpu():
    """floor(r / 9.1) at multiples of 9.1 (deberta_bucket_scale without buckets reads the divided distances; T5's
    scale divides the same way): 273 -> 30, 455 -> 50, ... In float32 9.1 rounds up to 9.1000004 and 273 / 9.1 to
    29.999998, floor 29."""
    rel = torch.tensor([273, -273, 455, 546, -910, 272, 9, 0])
    got = make_config("deberta_bucket_scale", factor=9.1).positions(rel, -1, 512).tolist()
    assert got == [30, -30, 50, 60, -100, 29, 0, 0]


@pytest.mark.parametrize(("buckets", "reach"), [(5, 64), (255, 512), (17, 100), (16, 9), (256, 129)])
def test_deberta_log_buckets_are_transformers_at_odd_counts_and_a_reach_of_mid_plus_one(buckets, reach):
    """Odd bucket counts (mid = buckets // 2) and P - 1 = mid (ln((P - 1) / mid) = 0: every distance past mid is
    +-inf in transformers too, the distance mid itself stays mid)."""
    rel = torch.arange(-3000, 3001)
    assert torch.equal(deberta_log_bucket(rel, buckets, reach), make_log_bucket_position(rel, buckets, reach))


@pytest.mark.parametrize(("buckets", "reach"), [(0, 64), (-1, 64), (16, 0), (16, 1), (256, 512)])
def test_deberta_positions_bucket_when_transformers_does(buckets, reach):
    """transformers' build_relative_position buckets only when position_buckets > 0 and max_relative_positions > 0
    (0 of either: the distances as they are), and returns long; a reach of 1 puts every distance past mid in bucket
    +-mid (ln(0 / mid) = -inf)."""
    queries, keys = 40, 70
    rel = torch.arange(queries)[:, None] - torch.arange(keys)[None]
    expected = build_relative_position(torch.zeros(1, queries, 1), torch.zeros(1, keys, 1), buckets, reach)[0]
    got = make_config("deberta_bucket_scale", factor=1).positions(rel, buckets, reach)
    assert got.dtype == torch.long and torch.equal(got, expected)
    if (buckets, reach) == (16, 1):
        assert got.abs().max() == 8 and torch.equal(got[rel.abs() <= 8], rel[rel.abs() <= 8])
