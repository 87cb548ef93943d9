"""Relative-position remappings of the attention-rewrite methods and the pair-by-pair reference attention."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rope_ext.attention import reference_attention, remapped_rope_scores
from rope_ext.methods import LogNConfig
from rope_ext.methods.frequency import default_inv_freq
from rope_ext.methods.windows import (
    leaky_rerope_positions,
    rerope_positions,
    self_extend_positions,
    string_positions,
)

N = 48
I = torch.arange(N)[None, :, None]  # [1, q, 1]
J = torch.arange(N)[None, None, :]  # [1, 1, k]


def _rope_scores(q, k, positions, inv_freq):
    """Plain RoPE as transformers applies it: rotate q and k by their positions, then dot them."""
    freqs = positions[..., None].float() * inv_freq  # [b, n, r/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    rotary = emb.shape[-1]  # partial rotary (GPT-NeoX, Phi) rotates only the first r dims
    q_part, k_part = apply_rotary_pos_emb(q[..., :rotary], k[..., :rotary], emb.cos(), emb.sin())
    q_rot, k_rot = torch.cat((q_part, q[..., rotary:]), -1), torch.cat((k_part, k[..., rotary:]), -1)
    return q_rot @ k_rot.transpose(-1, -2)


@pytest.mark.parametrize("rotary", [16, 8])  # full and partial rotary (GPT-NeoX, Phi)
def test_reference_scores_at_the_true_distance_are_transformers_rope(rotary):
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, N, 16), torch.randn(2, 3, N, 16)
    inv_freq = default_inv_freq(10000.0, rotary)
    positions = torch.arange(N)[None].expand(2, N) + torch.tensor([[0], [5]])  # a shifted row too
    rel = positions[:, :, None] - positions[:, None, :]
    expected = _rope_scores(q, k, positions, inv_freq)
    torch.testing.assert_close(remapped_rope_scores(q, k, rel, inv_freq).float(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "remap",
    [
        lambda i, j: rerope_positions(i, j, window=N),
        lambda i, j: leaky_rerope_positions(i, j, window=N, slope=16.0),
        lambda i, j: leaky_rerope_positions(i, j, window=4, slope=1.0),
        lambda i, j: self_extend_positions(i, j, neighbor_window=N, group=8),
        lambda i, j: self_extend_positions(i, j, neighbor_window=4, group=1),
        lambda i, j: string_positions(i, j, shift=N, local=8),
    ],
)
def test_identity_settings_are_plain_rope(remap):
    assert torch.equal(remap(I, J).to(torch.float64), (I - J).to(torch.float64))


def test_rerope_scores_depend_only_on_the_clamped_distance():
    torch.manual_seed(0)
    window = 6
    q = torch.randn(1, 1, 1, 16).expand(1, 1, N, 16)  # the same query and key vector at every position
    k = torch.randn(1, 1, 1, 16).expand(1, 1, N, 16)
    rel = rerope_positions(I, J, window)
    scores = remapped_rope_scores(q, k, rel, default_inv_freq(10000.0, 16))[0, 0]
    causal = (I - J)[0] >= 0
    distance = (I - J)[0].clamp(max=window)
    for d in range(window + 1):  # every causal pair at clamped distance d has one score
        values = scores[causal & (distance == d)]
        torch.testing.assert_close(values, values[:1].expand_as(values), rtol=0, atol=1e-9)
    assert not torch.allclose(scores[20, 20], scores[20, 19])  # within the window, distances still differ


def test_mappings_match_their_formulas():
    rel = I - J
    leaky = leaky_rerope_positions(I, J, window=8, slope=4.0)
    torch.testing.assert_close(leaky[0, 20, 2], torch.tensor(8 + (18 - 8) / 4.0, dtype=torch.float64))
    extend = self_extend_positions(I, J, neighbor_window=8, group=4)
    assert extend[0, 40, 3] == (40 // 4 + 8 - 8 // 4) - 3 // 4 and extend[0, 40, 35] == 5
    string = string_positions(I, J, shift=16, local=4)
    assert string[0, 30, 2] == 28 - 16 + 4 and string[0, 30, 20] == 10
    assert torch.equal(rerope_positions(I, J, 5), torch.minimum(rel, torch.tensor(5)))
    # the grouped far region never reaches further than the window plus the grouped span
    assert extend[rel >= 8].max() <= 8 + (N - 8) // 4 + 1


def test_logn_is_one_inside_the_original_context_and_grows_beyond():
    """``LogNConfig.scale`` (the one log-n formula: the fast path's and the reference's query scale)."""
    scale = LogNConfig().query_multiplier(torch.arange(0, 256), 64)
    assert torch.all(scale[:64] == 1.0)
    torch.testing.assert_close(scale[255], torch.tensor(math.log(256) / math.log(64), dtype=torch.float64))
    assert torch.all(scale[64:] > 1.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: rerope_positions(I, J, 0), r"window must be a finite number > 0, got 0"),
        (lambda: leaky_rerope_positions(I, J, 4, float("nan")), r"slope must be a finite number > 0, got nan"),
        (lambda: self_extend_positions(I, J, 4, 0), r"group must be an int >= 1, got 0"),
        (lambda: self_extend_positions(I, J, 4, True), r"group must be an int >= 1, got True"),
        (lambda: self_extend_positions(I, J, 4, 2.0), r"group must be an int >= 1, got 2.0"),
        (lambda: string_positions(I, J, -1, 4), r"shift must be a finite number > 0, got -1"),
        (lambda: LogNConfig(original_max_position_embeddings=1), r"logn: original_max_position_embeddings must be an int >= 2, got 1"),
    ],
)
def test_bad_values_name_the_valid_range(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_reference_attention_with_true_distances_is_sdpa_with_rope():
    torch.manual_seed(0)
    b, heads, kv_heads, d = 2, 4, 2, 16
    q, k, v = torch.randn(b, heads, N, d), torch.randn(b, kv_heads, N, d), torch.randn(b, kv_heads, N, d)
    inv_freq = default_inv_freq(10000.0, d)
    positions = torch.arange(N)[None].expand(b, N)
    allowed = (I - J >= 0).expand(b, N, N)
    out = reference_attention(q, k, v, I - J + torch.zeros(b, 1, 1, dtype=torch.long), inv_freq,
                              allowed=allowed, scaling=d**-0.5)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    expected = torch.nn.functional.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_each_mapping_names_its_bad_argument():
    from rope_ext.methods.windows import (dca_positions, leaky_rerope_positions, rerope_positions,
                                          self_extend_positions, string_positions)

    i, j = torch.arange(4)[:, None], torch.arange(4)[None, :]
    cases = [
        (lambda: rerope_positions(i, j, 0), "window must be a finite number > 0, got 0"),
        (lambda: leaky_rerope_positions(i, j, True, 2.0), "window must be a finite number > 0, got True"),
        (lambda: leaky_rerope_positions(i, j, 2, float("inf")), "slope must be a finite number > 0, got inf"),
        (lambda: self_extend_positions(i, j, -1, 2), "neighbor_window must be a finite number > 0, got -1"),
        (lambda: self_extend_positions(i, j, 2, 0), "group must be an int >= 1, got 0"),
        (lambda: string_positions(i, j, 0, 1), "shift must be a finite number > 0, got 0"),
        (lambda: string_positions(i, j, 3, "1"), "local must be a finite number > 0, got '1'"),
        (lambda: dca_positions(i, j, 0, 1), "chunk_size must be a finite number > 0, got 0"),
        (lambda: dca_positions(i, j, 4, float("nan")), "local_window must be a finite number > 0, got nan"),
        (lambda: dca_positions(i, j, 4, 4), "local_window must be below chunk_size, got 4 >= 4"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == message
