"""Every formula and constant of the methods against numbers computed independently of the code under test.

Expected values are literals from the papers and reference repositories, or computed here with plain ``math`` (and
plain Python loops) from the formula as the paper or the reference states it; no expected value comes from a
function of ``rope_ext`` (nor from a helper such a function shares). Sources: ../shared/REFERENCES.md, bojone/rerope
(``rerope_patch.py``, ``leaky_rerope_patch.py``), datamllab/LongLM (Self-Extend), HKUNLP/ChunkLlama
(``chunkllama_attn_replace.py``), HKUNLP/STRING, jquesnelle/yarn and the papers named in each method's module.

The last part runs whole tiny models: identity settings at every distance (fast path and general path), and the
fast path of log-n and DCA against attention computed here from the hand formulas through ``reference_attention``.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, tiny_model

import rope_ext
from rope_ext.attention import blocks, rules
from rope_ext.attention.program import kernel_override
from rope_ext.attention.reference import reference_attention
from rope_ext.methods.frequency import yarn_mscale
from rope_ext.methods import (
    DualChunkConfig,
    LeakyReRopeConfig,
    LogNConfig,
    ReRopeConfig,
    RotarySpec,
    SelfExtendConfig,
    StringConfig,
    make_config,
)

L = ORIGINAL_CONTEXT  # 64


# --- hand formulas (plain Python) -------------------------------------------------------------------------


def theta(i: int, base: float, dim: int) -> float:
    """RoPE's inverse frequency of pair ``i``: ``b ** (-2i / d)``."""
    return base ** (-2 * i / dim)


def thetas(base: float, dim: int) -> list[float]:
    return [theta(i, base, dim) for i in range(dim // 2)]


def rerope_rel(i: int, j: int, w: int) -> float:
    """bojone/rerope ``rerope_patch.py``: ``min(i - j, w)``."""
    return min(i - j, w)


def leaky_rel(i: int, j: int, w: int, k: float) -> float:
    """``leaky_rerope_patch.py``: ``rel`` below ``w``, then ``w + (rel - w) / k``."""
    rel = i - j
    return rel if rel < w else w + (rel - w) / k


def self_extend_rel(i: int, j: int, W: int, G: int) -> float:
    """LongLM: neighbour attention below ``W``; grouped ``(i // G + W - W // G) - j // G`` beyond."""
    rel = i - j
    return rel if rel < W else (i // G + W - W // G) - j // G


def string_rel(i: int, j: int, S: int, W: int) -> float:
    """STRING: ``rel`` below the shift ``S``, ``rel - S + W`` from it on."""
    rel = i - j
    return rel if rel < S else rel - S + W


def dca_rel(i: int, j: int, chunk_size: int, local_window: int) -> float:
    """ChunkLlama (``chunkllama_attn_replace.py``): chunks of ``s = chunk_size - local_window``, keys at ``j mod s``
    (``k_t``); a query in the key's chunk at ``i mod s`` (``q_t``), in the next chunk at ``min(i mod s + s,
    chunk_size)`` (``qc_t``), further on at ``chunk_size`` (the reference's ``qc_t[s - 1] = min(2s - 1, chunk_size)``,
    which is ``chunk_size`` whenever ``local_window < s``: every configuration below)."""
    s = chunk_size - local_window
    if i // s == j // s:
        query = i % s
    elif i // s == j // s + 1:
        query = min(i % s + s, chunk_size)
    else:
        query = chunk_size
    return query - j % s


def logn(i: int, length: int) -> float:
    """Su's log-n (in ReRoPE's patch): ``max(1, ln(i + 1) / ln L)``."""
    return max(1.0, math.log(i + 1) / math.log(length))


def dca_mscale(i: int, length: int) -> float:
    """ChunkLlama's ``get_mscale``: ``0.05 ln(n / L) + 1`` for ``n > L`` (else 1) on cos and sin of q and k, so the
    scores carry its square; ``n = i + 1`` per query."""
    n = i + 1
    return (0.05 * math.log(n / length) + 1.0) ** 2 if n > length else 1.0


def hand(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def assert_values(actual: torch.Tensor, expected, rtol: float = 1e-5) -> None:
    """float32 inverse frequencies against float64 hand values (float32 powers are good to a few 1e-7)."""
    torch.testing.assert_close(actual.to(torch.float64), hand(expected), rtol=rtol, atol=0)


# --- frequency methods ---------------------------------------------------------------------------------------

SPEC = RotarySpec(base=10000.0, dim=64, original_max_position_embeddings=2048)


def test_pi_divides_every_frequency_by_the_factor():
    inv_freq, attention = make_config("pi", factor=4.0).frequencies(SPEC, 10_000)
    assert_values(inv_freq, [t / 4.0 for t in thetas(10000.0, 64)])
    assert attention == 1.0


def test_ntk_base_is_b_times_s_to_the_d_over_d_minus_2():
    base = 10000.0 * 4.0 ** (64 / 62)
    inv_freq, attention = make_config("ntk", factor=4.0).frequencies(SPEC)
    assert_values(inv_freq, thetas(base, 64))
    assert attention == 1.0
    # the defining property: the highest frequency kept, the lowest divided by exactly s
    assert inv_freq[0].item() == 1.0
    assert inv_freq[-1].item() == pytest.approx(theta(31, 10000.0, 64) / 4.0, rel=1e-5)


@pytest.mark.parametrize("tensor_length", [False, True], ids=["int", "tensor"])
def test_dynamic_ntk_scale_follows_the_length_and_is_the_identity_up_to_l(tensor_length):
    """``s' = s l / L - (s - 1)`` beyond ``L`` (s=2, l=3L: s'=5; l=L+1: s'=1+2/L), the default frequencies up to L;
    the same for a 0-d tensor length (inside a forward)."""

    def frequencies(factor, length):
        length = torch.tensor(length) if tensor_length else length
        return make_config("dynamic_ntk", factor=factor).frequencies(SPEC, length)

    for length in (1, 1000, 2048):
        inv_freq, attention = frequencies(2.0, length)
        assert_values(inv_freq, thetas(10000.0, 64), rtol=1e-6)
        assert attention == 1.0
    for factor, length, scale in [(2.0, 3 * 2048, 5.0), (2.0, 2049, 1.0 + 2 / 2048), (1.0, 4096, 2.0), (4.0, 4096, 5.0)]:
        inv_freq, attention = frequencies(factor, length)
        assert_values(inv_freq, thetas(10000.0 * scale ** (64 / 62), 64))
        assert float(attention) == 1.0
    assert make_config("dynamic_ntk").factor == 1.0  # (factor 1 still scales past L: by l / L)


def correction_dim(beta: float, dim: int = 64, base: float = 10000.0, length: int = 2048) -> float:
    """YaRN's ``find_correction_dim``: the dimension that turns ``beta`` times in ``L`` tokens,
    ``d ln(L / (2 pi beta)) / (2 ln b)``."""
    return dim * math.log(length / (beta * 2 * math.pi)) / (2 * math.log(base))


def by_parts(factor: float, low: float, high: float, base: float = 10000.0, dim: int = 64) -> list[float]:
    """The reference's ramp over dimensions: kept below ``low``, divided by ``s`` above ``high``, linear between."""
    values = []
    for i in range(dim // 2):
        ramp = min(1.0, max(0.0, (i - low) / (high - low)))  # 0: keep (extrapolate), 1: interpolate
        values.append(theta(i, base, dim) / factor * ramp + theta(i, base, dim) * (1 - ramp))
    return values


def test_ntk_by_parts_ramp_ends_come_from_beta_fast_32_and_beta_slow_1():
    # hand values at b=10000, d=64, L=2048: dimension 8.06 turns 32 times in L, dimension 20.1 once
    assert (correction_dim(32.0), correction_dim(1.0)) == (pytest.approx(8.0640, abs=1e-4), pytest.approx(20.1052, abs=1e-4))
    inv_freq, attention = make_config("ntk_by_parts", factor=4.0).frequencies(SPEC)
    assert_values(inv_freq, by_parts(4.0, 8, 21))  # truncated to whole dimensions: floor 8, ceil 21
    assert attention == 1.0
    untruncated, _ = make_config("ntk_by_parts", factor=4.0, truncate=False).frequencies(SPEC)
    assert_values(untruncated, by_parts(4.0, correction_dim(32.0), correction_dim(1.0)))
    other, _ = make_config("ntk_by_parts", factor=4.0, beta_fast=16.0, beta_slow=2.0).frequencies(SPEC)
    assert_values(other, by_parts(4.0, math.floor(correction_dim(16.0)), math.ceil(correction_dim(2.0))))
    # a context shorter than one turn of every pair: both ends clamp to 0, and the reference widens the ramp by 0.001
    tiny = RotarySpec(base=10000.0, dim=64, original_max_position_embeddings=6)
    assert math.ceil(correction_dim(1.0, length=6)) == 0 and math.floor(correction_dim(32.0, length=6)) < 0
    clamped, _ = make_config("ntk_by_parts", factor=4.0).frequencies(tiny)
    assert_values(clamped, by_parts(4.0, 0, 0.001))
    # a base small enough that the slow end passes the last dimension: the reference clamps it to d - 1 = 63
    small = RotarySpec(base=10.0, dim=64, original_max_position_embeddings=1024)
    ends = (math.floor(correction_dim(32.0, base=10.0, length=1024)), math.ceil(correction_dim(1.0, base=10.0, length=1024)))
    assert ends == (22, 71)
    ramped, _ = make_config("ntk_by_parts", factor=4.0).frequencies(small)
    assert_values(ramped, by_parts(4.0, 22, 63, base=10.0))
    # both ends clamped onto d - 1: a zero-width ramp there, widened by 0.001 (every pair below it kept)
    far = RotarySpec(base=10.0, dim=64, original_max_position_embeddings=19000)
    assert math.floor(correction_dim(32.0, base=10.0, length=19000)) == 63
    kept, _ = make_config("ntk_by_parts", factor=4.0).frequencies(far)
    assert_values(kept, by_parts(4.0, 63, 63.001, base=10.0))
    assert_values(kept, thetas(10.0, 64), rtol=1e-6)


def test_yarn_temperature_is_0_1_ln_s_plus_1_and_the_deepseek_mscale_ratio():
    inv_freq, attention = make_config("yarn", factor=4.0).frequencies(SPEC)
    assert_values(inv_freq, by_parts(4.0, 8, 21))
    assert attention == pytest.approx(1.1386294361119891, rel=1e-12)  # 0.1 ln 4 + 1
    assert make_config("yarn", factor=16.0).frequencies(SPEC)[1] == pytest.approx(0.1 * math.log(16) + 1, rel=1e-12)
    assert make_config("yarn", factor=1.0).frequencies(SPEC)[1] == 1.0
    ratio = make_config("yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0).frequencies(SPEC)[1]
    assert ratio == pytest.approx((0.1 * 0.707 * math.log(4) + 1) / (0.1 * 1.0 * math.log(4) + 1), rel=1e-12)
    ratio = make_config("yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.5).frequencies(SPEC)[1]
    assert ratio == pytest.approx((0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1), rel=1e-12)
    assert make_config("yarn", factor=4.0, attention_factor=1.25).frequencies(SPEC)[1] == 1.25


@pytest.mark.parametrize("tensor_length", [False, True], ids=["int", "tensor"])
def test_dynamic_yarn_is_yarn_at_s_prime(tensor_length):
    """``s' = max(1, s l / L - (s - 1))``: default frequencies and temperature 1 up to ``L``; at l = 3L YaRN at
    s' = 3 (s = 1) or 5 (s = 2), temperature ``0.1 ln s' + 1``."""

    def frequencies(length, **options):
        length = torch.tensor(length) if tensor_length else length
        return make_config("dynamic_yarn", **options).frequencies(SPEC, length)

    for length in (1, 2048):
        inv_freq, attention = frequencies(length)
        assert_values(inv_freq, thetas(10000.0, 64), rtol=1e-6)
        assert float(attention) == 1.0
    for length, options, scale in [(3 * 2048, {}, 3.0), (3 * 2048, {"factor": 2.0}, 5.0), (3072, {}, 1.5)]:
        inv_freq, attention = frequencies(length, **options)
        low = math.floor(correction_dim(32.0))
        high = math.ceil(correction_dim(1.0))
        assert_values(inv_freq, by_parts(scale, low, high))
        assert float(attention) == pytest.approx(0.1 * math.log(scale) + 1, rel=1e-6)


def test_yarn_mscale_at_hand_values():
    """``0.1 * mscale * ln(s) + 1``, 1 for ``s <= 1`` (the reference's ``get_mscale``), for numbers and tensors."""
    for scale, mscale, expected in [(4.0, 1.0, 0.1 * math.log(4) + 1), (4.0, 0.5, 0.05 * math.log(4) + 1),
                                    (1.5, 1.0, 0.1 * math.log(1.5) + 1), (1.0, 1.0, 1.0), (0.5, 2.0, 1.0)]:
        assert yarn_mscale(scale, mscale) == pytest.approx(expected, rel=1e-12)
        assert yarn_mscale(torch.tensor(scale, dtype=torch.float64), mscale).item() == pytest.approx(expected, rel=1e-12)


LLAMA3 = RotarySpec(base=500000.0, dim=128, original_max_position_embeddings=8192)  # Llama 3.1 8B


@pytest.mark.parametrize("low_freq_factor,high_freq_factor", [(1.0, 4.0), (2.0, 8.0)])
def test_llama3_wavelength_bands_and_smooth_interpolation(low_freq_factor, high_freq_factor):
    """Wavelengths ``2 pi / theta`` below ``L / high`` kept, above ``L / low`` divided by ``s``, between
    ``(1 - g) theta / s + g theta`` with ``g = (L / wavelength - low) / (high - low)`` (Meta's
    ``apply_scaling``; defaults low 1, high 4)."""
    factor, length = 8.0, 8192
    expected, bands = [], set()
    for t in thetas(500000.0, 128):
        wavelength = 2 * math.pi / t
        if wavelength < length / high_freq_factor:
            expected.append(t)
            bands.add("kept")
        elif wavelength > length / low_freq_factor:
            expected.append(t / factor)
            bands.add("divided")
        else:
            g = (length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            expected.append((1 - g) * t / factor + g * t)
            bands.add("smooth")
    assert bands == {"kept", "divided", "smooth"}
    options = {"low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor}
    inv_freq, attention = make_config("llama3", factor=factor, **options).frequencies(LLAMA3)
    assert_values(inv_freq, expected)
    assert attention == 1.0
    defaults = make_config("llama3", factor=8.0)
    assert (defaults.low_freq_factor, defaults.high_freq_factor) == (1.0, 4.0)


def test_llama3_wavelengths_exactly_on_the_band_edges():
    """Base 16, two pairs: wavelengths exactly ``2 pi`` (float32) and 4x that, made the edges ``L / high`` and
    ``L / low``: Meta's smooth branch gives ``g = 1`` (kept) and ``g = 0`` (divided by s) there."""
    two_pi = float(torch.tensor(2 * math.pi, dtype=torch.float32))  # the wavelength of theta = 1 in float32
    spec = RotarySpec(base=16.0, dim=4, original_max_position_embeddings=8)
    config = make_config("llama3", factor=4.0, low_freq_factor=8 / (4 * two_pi), high_freq_factor=8 / two_pi)
    inv_freq, _ = config.frequencies(spec)
    assert_values(inv_freq, [1.0, 0.25 / 4.0])


@pytest.mark.parametrize("tensor_length", [False, True], ids=["int", "tensor"])
def test_longrope_factor_lists_and_attention_factor(tensor_length):
    """``theta_i / lambda_i``: ``short_factor`` up to ``L``, ``long_factor`` beyond; attention factor
    ``sqrt(1 + ln s / ln L)`` (s=4, L=2048: ``sqrt(1 + 2/11) = sqrt(13/11)``), 1 at s=1."""
    long_factor = [1.0 + i / 4 for i in range(32)]
    short_factor = [1.0 + i / 64 for i in range(32)]
    config = make_config("longrope", factor=4.0, long_factor=long_factor, short_factor=short_factor)
    length = (lambda n: torch.tensor(n)) if tensor_length else (lambda n: n)
    short, attention = config.frequencies(SPEC, length(2048))
    assert_values(short, [t / f for t, f in zip(thetas(10000.0, 64), short_factor)])
    assert attention == pytest.approx(math.sqrt(13 / 11), rel=1e-12)
    long, attention = config.frequencies(SPEC, length(2049))
    assert_values(long, [t / f for t, f in zip(thetas(10000.0, 64), long_factor)])
    assert attention == pytest.approx(1.0871146130092180, rel=1e-12)
    without_length, attention = config.frequencies(SPEC)  # (no length: the short factors)
    assert_values(without_length, [t / f for t, f in zip(thetas(10000.0, 64), short_factor)])
    assert attention == pytest.approx(math.sqrt(13 / 11), rel=1e-12)
    unset, _ = make_config("longrope", factor=4.0, long_factor=long_factor).frequencies(SPEC, length(100))
    assert_values(unset, thetas(10000.0, 64), rtol=1e-6)  # short_factor defaults to ones
    assert make_config("longrope", factor=1.0, long_factor=long_factor).frequencies(SPEC, 100)[1] == 1.0
    assert make_config("longrope", factor=4.0, long_factor=long_factor, attention_factor=1.5).frequencies(SPEC)[1] == 1.5


# --- the rotation itself ---------------------------------------------------------------------------------------


def _rotated_by_hand(x: torch.Tensor, positions, rotary: int, base: float, factor: float) -> torch.Tensor:
    """RoPE with HF's layout: pair ``i`` is dims ``i`` and ``i + r/2``, turned by ``p * theta_i`` (cos and sin times
    the attention factor); dims past ``r`` unchanged. ``positions[b][n]``, plain loops in float64."""
    out = x.clone()
    half = rotary // 2
    for b in range(x.shape[0]):
        for n in range(x.shape[2]):
            p = positions[b][n]
            for i in range(half):
                c, s = math.cos(p * theta(i, base, rotary)) * factor, math.sin(p * theta(i, base, rotary)) * factor
                lo, hi = x[b, :, n, i], x[b, :, n, i + half]
                out[b, :, n, i], out[b, :, n, i + half] = lo * c - hi * s, hi * c + lo * s
    return out


def test_rotation_turns_each_pair_by_position_times_theta():
    """``rotate`` (what the fast path and the key cache rotate with) and ``rope_cos_sin``: partial rotary (4 of 8
    dims), sequences no longer than the rotary dims, positions per row, attention factors 1, 2 and 0.75, into ``out``
    with and without gradients; ``rotate_at_zero``: the rotary dims times the factor."""
    from rope_ext.methods.rope import rope_cos_sin, rotate, rotate_at_zero

    x = torch.randn(2, 3, 3, 8, dtype=torch.float64)  # [b, h, n, d]: n = 3 below the 4 rotary dims, pairs of 2
    inv_freq = torch.tensor(thetas(10000.0, 4), dtype=torch.float32)
    rows = [[5.0, 9.0, 10.0], [0.0, 100.0, 250.0]]
    for factor in (1.0, 2.0, 0.75):
        expected = _rotated_by_hand(x, rows, 4, 10000.0, factor)
        torch.testing.assert_close(rotate(x, torch.tensor(rows), inv_freq, factor), expected, rtol=0, atol=2e-5)
        shared = _rotated_by_hand(x, [rows[0], rows[0]], 4, 10000.0, factor)
        torch.testing.assert_close(rotate(x, torch.tensor(rows[0]), inv_freq, factor), shared, rtol=0, atol=2e-5)
        buffer = torch.zeros_like(x)
        rotate(x, torch.tensor(rows), inv_freq, factor, out=buffer)
        torch.testing.assert_close(buffer, expected, rtol=0, atol=2e-5)
        leaf, buffer = x.clone().requires_grad_(), torch.zeros_like(x)
        rotate(leaf, torch.tensor(rows), inv_freq, factor, out=buffer)
        torch.testing.assert_close(buffer.detach(), expected, rtol=0, atol=2e-5)
        zero = x.clone()
        zero[..., :4] *= factor
        torch.testing.assert_close(rotate_at_zero(x, inv_freq, factor), zero, rtol=1e-7, atol=0)
        cos, sin = rope_cos_sin(torch.tensor(rows), inv_freq, factor)
        angles = hand([[[p * t for t in thetas(10000.0, 4)] * 2 for p in row] for row in rows])
        torch.testing.assert_close(cos.double(), angles.cos() * factor, rtol=0, atol=2e-5)
        torch.testing.assert_close(sin.double(), angles.sin() * factor, rtol=0, atol=2e-5)


# --- attention mappings at hand-picked pairs ----------------------------------------------------------------

#: (config resolved at L = 64, [(i, j, rel')]): pairs on both sides of every boundary, values worked out by hand
PAIRS = [
    (ReRopeConfig(), [(20, 5, 15), (20, 4, 16), (20, 3, 16), (16, 0, 16), (15, 0, 15), (100, 0, 16), (7, 7, 0)]),
    (LeakyReRopeConfig(), [(20, 5, 15), (20, 4, 16), (20, 3, 16.0625), (63, 0, 18.9375), (100, 0, 21.25)]),
    (LeakyReRopeConfig(k=4.0), [(20, 4, 16), (20, 3, 16.25), (100, 0, 37.0)]),
    (SelfExtendConfig(), [(20, 13, 7), (20, 12, 8), (20, 11, 8), (20, 0, 9), (8, 0, 8), (63, 0, 14), (64, 0, 15),
                          (100, 0, 19), (100, 7, 19), (100, 8, 18)]),
    (SelfExtendConfig(G=4), [(40, 35, 5), (40, 3, 16), (100, 0, 31), (100, 92, 8), (100, 93, 7)]),
    (StringConfig(), [(30, 10, 20), (30, 9, 4), (21, 0, 4), (20, 0, 20), (30, 0, 13), (100, 0, 83)]),
    (DualChunkConfig(), [(39, 0, 39), (39, 39, 0), (40, 39, 1), (40, 0, 40), (45, 0, 45), (47, 0, 47), (48, 0, 48),
                         (50, 0, 48), (50, 10, 38), (79, 40, 39), (79, 39, 9), (80, 0, 48), (80, 39, 9), (80, 40, 40),
                         (80, 79, 1), (85, 41, 44), (120, 0, 48), (120, 80, 40), (121, 79, 9)]),
    (DualChunkConfig(chunk_size=12, local_window=4), [(7, 0, 7), (8, 7, 1), (11, 0, 11), (12, 0, 12), (15, 0, 12),
                                                     (16, 0, 12), (16, 15, 1), (19, 8, 11), (23, 8, 12), (23, 7, 5),
                                                     (23, 16, 7)]),
    # chunks of one position (s = 1): the same and the previous chunk only (older ones: see dca_rel)
    (DualChunkConfig(chunk_size=3, local_window=2), [(5, 5, 0), (5, 4, 1), (1, 0, 1), (0, 0, 0)]),
]


def _rel_by_regions(config, i: int, j: int) -> float:
    """``query(i) - key(j)`` of the one region (of ``regions()``, the general path) that holds the pair."""
    ti, tj = torch.tensor(float(i), dtype=torch.float64), torch.tensor(float(j), dtype=torch.float64)
    holding = [r for r in config.regions() if r.allowed is None or bool(r.allowed(ti, tj))]
    assert len(holding) == 1, (config, i, j, len(holding))
    return (holding[0].query(ti) - holding[0].key(tj)).item()


@pytest.mark.parametrize("config,pairs", PAIRS, ids=[f"{c.method}-{n}" for n, (c, _) in enumerate(PAIRS)])
def test_each_mapping_at_hand_picked_pairs(config, pairs):
    config = config.resolved(L)
    for i, j, expected in pairs:
        assert config.relative(torch.tensor(i), torch.tensor(j)).item() == expected, (config, i, j)
        assert config.relative(torch.tensor(float(i)), torch.tensor(float(j))).item() == expected, (config, i, j)
        assert _rel_by_regions(config, i, j) == expected, (config, i, j)


#: configs resolved at L = 64 and their hand mapping
GRID = [
    (ReRopeConfig(), lambda c: lambda i, j: rerope_rel(i, j, 16)),
    (ReRopeConfig(w=5), lambda c: lambda i, j: rerope_rel(i, j, 5)),
    (LeakyReRopeConfig(), lambda c: lambda i, j: leaky_rel(i, j, 16, 16.0)),
    (LeakyReRopeConfig(w=7, k=3.0), lambda c: lambda i, j: leaky_rel(i, j, 7, 3.0)),
    (SelfExtendConfig(), lambda c: lambda i, j: self_extend_rel(i, j, 8, 8)),
    (SelfExtendConfig(W=10, G=3), lambda c: lambda i, j: self_extend_rel(i, j, 10, 3)),
    (StringConfig(), lambda c: lambda i, j: string_rel(i, j, 21, 4)),
    (StringConfig(S=30, W=9), lambda c: lambda i, j: string_rel(i, j, 30, 9)),
    (DualChunkConfig(), lambda c: lambda i, j: dca_rel(i, j, 48, 8)),
    (DualChunkConfig(chunk_size=12, local_window=4), lambda c: lambda i, j: dca_rel(i, j, 12, 4)),
    (DualChunkConfig(chunk_size=7, local_window=3), lambda c: lambda i, j: dca_rel(i, j, 7, 3)),
]


@pytest.mark.parametrize("config,mapping", GRID, ids=[f"{c.method}-{n}" for n, (c, _) in enumerate(GRID)])
def test_regions_and_relative_equal_the_hand_mapping_on_a_full_grid(config, mapping):
    """Every causal pair of 150 positions: exactly one of ``regions()`` (the general path) holds it, and its
    ``query(i) - key(j)`` equals ``relative(i, j)`` (the reference's rel') and the hand formula, pair by pair."""
    config = config.resolved(L)
    n = 150
    i = torch.arange(n, dtype=torch.float64)[:, None]
    j = torch.arange(n, dtype=torch.float64)[None]
    causal = j <= i
    expected = hand([[mapping(config)(a, b) if b <= a else 0.0 for b in range(n)] for a in range(n)])
    relative = config.relative(i, j).to(torch.float64)
    assert torch.equal(relative[causal], expected[causal])
    covered = torch.zeros(n, n, dtype=torch.int64)
    for region in config.regions():
        allowed = causal & region.allowed(i, j)
        covered += allowed
        difference = (region.query(i.expand(n, n)) - region.key(j.expand(n, n))).to(torch.float64)
        # (Leaky ReRoPE's far positions are fractions: the same value up to float64 rounding)
        torch.testing.assert_close(difference[allowed], expected[allowed], rtol=0, atol=1e-12, msg=str(region))
    assert torch.equal(covered, causal.to(torch.int64))  # the regions partition the causal pairs
    if config.method == "dca":
        assert expected[causal].max() == config.chunk_size  # every rel' at most chunk_size, reached


def test_far_key_shortcuts_match_the_far_keys():
    """The fast path's shortcuts for far keys (ReRoPE: unrotated, STRING: at their own position) are the far keys."""
    j = torch.arange(200, dtype=torch.float64)
    rerope, string = ReRopeConfig().resolved(L), StringConfig().resolved(L)
    assert ReRopeConfig.far_key_is_zero and torch.equal(rerope.far_key(j), torch.zeros(200, dtype=torch.float64))
    assert StringConfig.far_key_is_position and torch.equal(string.far_key(j), j)
    for config in (LeakyReRopeConfig(), SelfExtendConfig()):
        assert not type(config).far_key_is_zero and not type(config).far_key_is_position
        assert not torch.equal(config.resolved(L).far_key(j), j)


# --- query scales ------------------------------------------------------------------------------------------


def test_logn_is_max_1_ln_i_plus_1_over_ln_l_at_hand_values():
    i = torch.tensor([0, 100, 4095, 4096, 8191, 4096 * 4096 - 1])
    expected = [1.0, 1.0, 1.0, math.log(4097) / math.log(4096), 13 / 12, 2.0]
    scale = LogNConfig().query_multiplier(i, 4096)
    torch.testing.assert_close(scale, hand(expected), rtol=1e-14, atol=0)
    assert scale.dtype == torch.float64
    # a stated L wins over the one passed (the model's)
    stated = LogNConfig(original_max_position_embeddings=64).query_multiplier(torch.tensor([63, 4095, 8191]), 4096)
    torch.testing.assert_close(stated, hand([1.0, 2.0, 13 / 6]), rtol=1e-14, atol=0)
    grid = torch.arange(0, 3 * L)
    torch.testing.assert_close(LogNConfig().query_multiplier(grid, L), hand([logn(p, L) for p in range(3 * L)]), rtol=1e-14, atol=0)


def test_dca_mscale_squared_beyond_l_and_1_within():
    i = torch.tensor([0, 100, 4095, 8191, 65535, 4096 * 100 - 1])
    expected = [1.0, 1.0, 1.0, (0.05 * math.log(2) + 1) ** 2, (0.05 * math.log(16) + 1) ** 2,
                (0.05 * math.log(100) + 1) ** 2]
    assert expected[3] == pytest.approx(1.0705158, abs=1e-7)  # (1 + 0.05 ln 2)^2
    scale = DualChunkConfig().query_scale(i, 4096)
    torch.testing.assert_close(scale, hand(expected), rtol=1e-14, atol=0)
    torch.testing.assert_close(DualChunkConfig().query_multiplier(i, 4096), hand(expected), rtol=1e-14, atol=0)
    stated = DualChunkConfig(original_max_position_embeddings=64).query_scale(torch.tensor([63, 127]), 4096)
    torch.testing.assert_close(stated, hand([1.0, (0.05 * math.log(2) + 1) ** 2]), rtol=1e-14, atol=0)
    assert DualChunkConfig(scale_queries=False).query_scale(i, 4096) is None
    assert DualChunkConfig().scale_queries is True  # on by default, as in the reference
    grid = torch.arange(0, 3 * L)
    torch.testing.assert_close(DualChunkConfig().query_scale(grid, L), hand([dca_mscale(p, L) for p in range(3 * L)]),
                               rtol=1e-14, atol=0)


# --- defaults derived from L and intended lengths -----------------------------------------------------------


@pytest.mark.parametrize(
    "length,rerope_w,se_W,string_S,string_W,dca_chunk,dca_local",
    [
        (4096, 1024, 512, 1365, 128, 3072, 512),  # the references' L: w = L/4, W = L/8, S = L/3, W = 128, 3L/4, L/8
        (64, 16, 8, 21, 4, 48, 8),  # the tiny models: STRING's W = L/16
        (1024, 256, 128, 341, 64, 768, 128),
        (131072, 32768, 16384, 43690, 128, 98304, 16384),
        (4, 1, 1, 2, 1, 3, 1),  # the smallest values each option takes
    ],
)
def test_defaults_derived_from_l(length, rerope_w, se_W, string_S, string_W, dca_chunk, dca_local):
    assert ReRopeConfig().resolved(length).w == rerope_w
    leaky = LeakyReRopeConfig(k=min(16.0, length)).resolved(length)  # (a slope above L is refused: 16 needs L >= 16)
    assert (leaky.w, LeakyReRopeConfig().k) == (rerope_w, 16.0)
    extend = SelfExtendConfig(G=min(8, length)).resolved(length)  # (a group above L is refused: 8 needs L >= 8)
    assert (extend.W, SelfExtendConfig().G) == (se_W, 8)
    string = StringConfig().resolved(length)
    assert (string.S, string.W) == (string_S, string_W)
    dca = DualChunkConfig().resolved(length)
    assert (dca.chunk_size, dca.local_window, dca.chunk) == (dca_chunk, dca_local, dca_chunk - dca_local)
    for config in (leaky, extend, string, dca):
        assert config.original_max_position_embeddings == length


def test_defaults_fit_the_options_given_and_a_stated_l():
    assert DualChunkConfig(chunk_size=4).resolved(64).local_window == 3  # L/8 = 8, kept below chunk_size
    assert DualChunkConfig(chunk_size=20).resolved(64).local_window == 8
    assert DualChunkConfig(local_window=5).resolved(64).chunk_size == 48
    assert StringConfig(S=5).resolved(64).W == 4 and StringConfig(S=3).resolved(64).W == 2  # kept below S
    assert StringConfig(W=9).resolved(64).S == 21
    stated = ReRopeConfig(original_max_position_embeddings=32).resolved(64)
    assert (stated.w, stated.original) == (8, 32)
    assert SelfExtendConfig(original_max_position_embeddings=32).resolved(4096).W == 4
    assert SelfExtendConfig(W=3, G=2).resolved(64) == SelfExtendConfig(W=3, G=2, original_max_position_embeddings=64)


def test_option_ranges_at_their_edges():
    """The edges of each option's range (where a formula stops making sense) accepted or refused as stated."""
    assert DualChunkConfig(chunk_size=64).resolved(64).chunk_size == 64  # chunk_size may be L
    dca = DualChunkConfig().resolved(2)  # the smallest L: chunks of 2 with a window of 1
    assert (dca.chunk_size, dca.local_window) == (2, 1)
    assert LeakyReRopeConfig(k=1.0).k == 1.0  # slope 1: plain RoPE
    assert SelfExtendConfig(G=1).G == 1
    assert ReRopeConfig(w=63).resolved(64).w == 63
    for build, message in [
        (lambda: LeakyReRopeConfig(k=0.99), "k .* >= 1"),
        (lambda: StringConfig(S=10, W=10), "W=10 must be below S=10"),
        (lambda: DualChunkConfig(chunk_size=65).resolved(64), "exceeds the original context"),
        (lambda: DualChunkConfig(chunk_size=12, local_window=12).resolved(64), "local_window=12 must be below chunk_size"),
        (lambda: ReRopeConfig(w=64).resolved(64), "valid: 1..63"),
        (lambda: make_config("yarn", factor=2.0, beta_fast=2.0, beta_slow=2.0), "beta_fast must be > beta_slow"),
        (lambda: make_config("llama3", factor=2.0, low_freq_factor=2.0, high_freq_factor=2.0), "high_freq_factor must be >"),
    ]:
        with pytest.raises(ValueError, match=message):
            build()


def _longest_within(mapping, within: int, limit: int = 1200) -> int | None:
    """The longest sequence whose pairs all map to at most ``within - 1`` by the hand mapping (``None``: none up to
    ``limit``); rel' never shrinks as the query moves on, for every method here, so each new query's row decides."""
    n = 1  # a sequence of n tokens is fine; try n + 1 (its new query at position n)
    while n < limit and max(mapping(n, j) for j in range(n + 1)) <= within - 1:
        n += 1
    return n if n < limit else None


@pytest.mark.parametrize(
    "config,mapping,within,expected",
    [
        (LeakyReRopeConfig(), lambda i, j: leaky_rel(i, j, 16, 16.0), 64, 769),  # 16 + 16 * 47 + 1
        (LeakyReRopeConfig(k=4.0), lambda i, j: leaky_rel(i, j, 16, 4.0), 256, 973),
        (SelfExtendConfig(), lambda i, j: self_extend_rel(i, j, 8, 8), 64, 456),  # 8 * (64 - 8 + 1)
        (SelfExtendConfig(G=4), lambda i, j: self_extend_rel(i, j, 8, 4), 128, 488),
        (SelfExtendConfig(W=10, G=3), lambda i, j: self_extend_rel(i, j, 10, 3), 64, 171),  # 3 * (64 - 10 + 3)
        (StringConfig(), lambda i, j: string_rel(i, j, 21, 4), 64, 81),  # 64 + 21 - 4
        (StringConfig(), lambda i, j: string_rel(i, j, 21, 4), 256, 273),
        (ReRopeConfig(), lambda i, j: rerope_rel(i, j, 16), 64, None),
        (DualChunkConfig(), lambda i, j: dca_rel(i, j, 48, 8), 64, None),
    ],
)
def test_intended_length_is_the_longest_sequence_within_the_trained_distances(config, mapping, within, expected):
    config = config.resolved(L)
    assert config.intended_length(within) == expected
    if expected is not None:
        assert _longest_within(mapping, within) == expected
    else:
        assert _longest_within(mapping, within) is None


# --- whole tiny models ---------------------------------------------------------------------------------------

#: the attention scores multiplied by this (each layer's softmax scale), so that a position remap or a query scale
#: moves the logits by far more than float32 rounding: tiny random models attend almost uniformly otherwise
SHARPEN = 16.0


def _model():
    model = tiny_model("llama")
    for module in model.modules():
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):
            module.scaling *= SHARPEN
    return model


def _jump_positions(n: int, at: int, skip: int) -> torch.Tensor:
    return torch.cat([torch.arange(at), torch.arange(at, n) + skip])[None]


class _Seen:
    """Counts of the fast runners, the general regions path and the plain kernel's regions while a block runs."""

    def __init__(self, monkeypatch):
        self.counts: dict[str, int] = {}
        for cls, runner in list(rules.FAST_RUNNERS.items()):
            monkeypatch.setitem(rules.FAST_RUNNERS, cls, self._counting(runner.__name__, runner))
        monkeypatch.setattr(blocks, "masked_blocks", self._counting("general", blocks.masked_blocks))

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted


@pytest.mark.parametrize("method,options", [("leaky_rerope", {"k": 1.0}), ("self_extend", {"G": 1})], ids=["leaky_k1", "self_extend_g1"])
@pytest.mark.parametrize("path", ["fast", "general"])
def test_slope_1_and_group_1_are_plain_rope_at_every_distance(method, options, path, monkeypatch):
    """Leaky ReRoPE with k = 1 and Self-Extend with G = 1 map every distance to itself: patched logits equal the
    unpatched model's at 3L tokens (12x / 24x the window: far regions reached), through the fast runner (positions
    0..n-1) and through the general regions path (position_ids with a jump, every row's mask all ones)."""
    model = _model()
    n = 3 * L
    ids = input_ids(n)
    inputs = {} if path == "fast" else {"position_ids": _jump_positions(n, 50, 37), "attention_mask": torch.ones_like(ids)}
    before = logits(model, ids, **inputs)
    seen = _Seen(monkeypatch)
    with rope_ext.patched(model, method, **options):
        assert rope_ext.get_patch(model, resolved=True).window == {"leaky_rerope": 16, "self_extend": 8}[method]
        during = logits(model, ids, **inputs)
    assert seen.counts == ({"window": 2} if path == "fast" else {"general": 2})  # one call per layer
    torch.testing.assert_close(during, before, rtol=0, atol=2e-5)
    # the same windows with their default slope / group are not plain RoPE (what the identity rules out)
    with rope_ext.patched(model, method):
        assert (logits(model, ids, **inputs) - before).abs().max() > 1e-2


def _hand_kernel(rel_of, scale_of, rotary_dim: int | None):
    """A kernel for ``kernel_override``: each attention call from the formulas of this file, through
    ``reference_attention``. ``rel_of(i, j)`` at the rows' positions (``None``: q and k arrive rotated by the model,
    rel' = 0 adds nothing), ``scale_of(i)`` the query multiplier, RoPE's thetas at base 10000 (the tiny models')."""

    def run(call):
        assert call.rows is None and call.sliding_window is None
        q, k, v = call.q, call.k, call.v
        n, m = q.shape[2], k.shape[2]
        assert n == m  # whole forwards only
        positions = list(range(m)) if call.position_ids is None else call.position_ids[0].tolist()
        allowed = torch.ones(n, m, dtype=torch.bool).tril()
        if rel_of is None:
            rel, inv_freq = torch.zeros(1, n, m, dtype=torch.float64), torch.zeros(q.shape[-1] // 2, dtype=torch.float64)
        else:
            rel = hand([[rel_of(positions[a], positions[b]) if b <= a else 0.0 for b in range(m)] for a in range(n)])[None]
            inv_freq = hand(thetas(10000.0, rotary_dim))
        query_scale = hand([scale_of(p) for p in positions])[None]
        return reference_attention(q, k, v, rel, inv_freq, allowed=allowed[None], scaling=call.scale, query_scale=query_scale)

    return run


#: (patch, rel' by hand or None for q and k rotated by the model, query multiplier by hand)
END_TO_END = {
    "logn": ("logn", None, lambda i: logn(i, L)),
    "dca": ("dca", lambda i, j: dca_rel(i, j, 48, 8), lambda i: dca_mscale(i, L)),
    "dca_small_chunks": ("dca:chunk_size=12:local_window=4:scale_queries=false", lambda i, j: dca_rel(i, j, 12, 4), lambda i: 1.0),
    "dca+logn": ("dca+logn", lambda i, j: dca_rel(i, j, 48, 8), lambda i: dca_mscale(i, L) * logn(i, L)),
}


@pytest.mark.parametrize("name", list(END_TO_END))
@pytest.mark.parametrize("path", ["fast", "general"])
def test_whole_model_equals_attention_from_the_hand_formulas(name, path, monkeypatch):
    """A tiny Llama patched with log-n / DCA (3L + 7 tokens: DCA's default chunks of 40 reach a successive and two
    older chunks) against the same model whose attention is computed here: rel' by the loop over (i, j) of the
    ChunkLlama description, the query scale from the hand formulas, through ``reference_attention``; with positions
    0..n-1 (the fast runners) and with a jump (the general path)."""
    spec, rel_of, scale_of = END_TO_END[name]
    model = _model()
    n = 3 * L + 7
    ids = input_ids(n)
    inputs = {} if path == "fast" else {"position_ids": _jump_positions(n, 60, 45), "attention_mask": torch.ones_like(ids)}
    unpatched = logits(model, ids, **inputs)
    with rope_ext.patched(model, spec):
        seen = _Seen(monkeypatch)
        fast = logits(model, ids, **inputs)
        monkeypatch.undo()
        with kernel_override(_hand_kernel(rel_of, scale_of, 16)):
            expected = logits(model, ids, **inputs)
    if rel_of is None:  # log-n alone: the plain kernel, causal by index, scaled at the rows' positions
        assert seen.counts == {}
    else:
        assert seen.counts == ({"dual_chunk": 2} if path == "fast" else {"general": 2})
    torch.testing.assert_close(fast, expected, rtol=0, atol=2e-5)
    assert (expected - unpatched).abs().max() > 1e-2  # the formulas move these logits far past the tolerance


def test_rotary_tables_in_each_layout_at_hand_values():
    """``rope_cos_sin``'s layouts (the tables a model's own rotary module returns, which a patched one keeps): at
    position p with frequencies (1, 1/2), ``cat`` is (p, p/2, p, p/2), ``interleave`` (p, p, p/2, p/2), ``half``
    (p, p/2), each times the attention factor; another layout is refused naming the valid ones."""
    from rope_ext.methods.rope import rope_cos_sin

    positions, inv_freq, factor = torch.tensor([[0, 1, 3]]), torch.tensor([1.0, 0.5]), 1.25
    angles = {"cat": lambda p: [p, p / 2, p, p / 2], "interleave": lambda p: [p, p, p / 2, p / 2],
              "half": lambda p: [p, p / 2]}
    for layout, of in angles.items():
        cos, sin = rope_cos_sin(positions, inv_freq, factor, layout)
        torch.testing.assert_close(cos, hand([[[math.cos(a) * factor for a in of(p)] for p in (0, 1, 3)]]).float(),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, hand([[[math.sin(a) * factor for a in of(p)] for p in (0, 1, 3)]]).float(),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unknown rotary table layout .pairs.; valid layouts: cat, interleave, half, complex"):
        rope_cos_sin(positions, inv_freq, factor, "pairs")


def test_llama4_temperature_at_hand_values():
    """Llama 4's attention temperature ``1 + s ln(floor((i + 1) / F) + 1)``: 1 below F - 1, a step at every multiple
    of F (s = 0.1, F = 8), and F defaults to L."""
    from rope_ext.methods import TemperatureConfig

    i = torch.tensor([0, 6, 7, 14, 15, 63])
    expected = [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3), 1 + 0.1 * math.log(9)]
    torch.testing.assert_close(TemperatureConfig(floor_scale=8).query_multiplier(i, 4096), hand(expected),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(TemperatureConfig().query_multiplier(i, 8), hand(expected), rtol=1e-14, atol=0)
    doubled = TemperatureConfig(attn_scale=0.2, floor_scale=8).query_multiplier(i, 8)
    torch.testing.assert_close(doubled, hand([1 + 2 * (e - 1) for e in expected]), rtol=1e-12, atol=0)
    assert (TemperatureConfig().attn_scale, TemperatureConfig().layers) == (0.1, "all")
    assert TemperatureConfig().position_offset == 1
    # Ministral 3's llama_4_scaling_beta form, ``1 + s ln(1 + floor(i / F))``: the step one position later
    mistral = [1.0, 1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(8)]
    torch.testing.assert_close(TemperatureConfig(floor_scale=8, position_offset=0).query_multiplier(i, 4096),
                               hand(mistral), rtol=1e-14, atol=0)


@pytest.mark.parametrize(("spec", "message"), [
    ("temperature:attn_scale=0", "temperature: attn_scale must be a number in (0, 10], got 0"),
    ("temperature:attn_scale=11", "temperature: attn_scale must be a number in (0, 10], got 11"),
    ("temperature:floor_scale=1", "temperature: floor_scale must be an int >= 2, got 1"),
    ("temperature:layers=bogus", "temperature: layers must be one of all, nope, rope, got 'bogus'"),
    ("temperature:position_offset=2", "temperature: position_offset must be 0 or 1, got 2"),
    ("temperature:position_offset=true", "temperature: position_offset must be 0 or 1, got True"),
])
def test_llama4_temperature_refuses_bad_values_naming_the_valid_ones(spec, message):
    with pytest.raises(ValueError) as refused:
        make_config(spec)
    assert str(refused.value).startswith(message)
