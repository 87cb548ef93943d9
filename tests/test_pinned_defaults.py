"""Defaults that no other test pinned (each survived hand mutation, issue #34), against values written out here from
the papers and reference repositories, never computed by the package:

- KERPLE (Chi et al. 2022, arXiv:2205.09921; chijames/KERPLE): ``log`` initialises ``r1 ~ U(0, 2)``, ``r2 ~ U(0, 1)``,
  ``power`` ``r1 ~ U(0, 1)``, ``r2 ~ U(0, 2)`` (its exponent), both kept ``>= eps = 0.01``;
- FIRE (Li et al. 2023, arXiv:2310.04418): ``c = 0.1`` and the threshold ``L = 512`` in
  ``f(psi(i - j) / psi(max(i, L)))``, ``psi(x) = log(c x + 1)``;
- PoSE (Zhu et al. 2024, arXiv:2309.10400; dwzhu-pku/PoSE ``train_pose.py``: ``rt1 = random.randint(1,
  (len_chunk + 1) // 2)``, both ends included): the first chunk is 1..ceil(W/2) tokens long, at odd windows too.
"""

from __future__ import annotations

import math

import pytest
import torch

import rope_ext
from rope_ext.methods import make_config
from rope_ext.train import pose_position_ids

HEADS = 4096  # heads drawn at once: enough draws to read a uniform distribution's range off them

# --- KERPLE --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("form", "r1_high", "r2_high"), [("log", 2.0, 1.0), ("power", 1.0, 2.0)])
def test_kerple_initial_scales_are_the_references_uniform_ranges(form, r1_high, r2_high):
    """Each of r1, r2 is uniform on (0, high) -- its mean high/2, its largest draw just below high, a quarter of the
    draws below high/4 -- and the draws below eps are raised to exactly eps = 0.01."""
    module = make_config("kerple", form=form).module(HEADS)
    for name, high in (("r1", r1_high), ("r2", r2_high)):
        values = getattr(module, name).detach().double()
        assert values.shape == (HEADS,)
        assert 0.99 * high < values.max().item() <= high, name
        assert values.mean().item() == pytest.approx(high / 2, rel=0.03), name
        assert (values < high / 4).double().mean().item() == pytest.approx(0.25, abs=0.03), name
        assert values.min().item() == pytest.approx(0.01, rel=1e-6), name  # U(0, high) < 0.01 happens 40/high times
        assert (values == values.min()).sum().item() >= 5, name  # the clamped draws, all at eps


def test_kerple_default_eps_is_a_hundredth_and_bounds_r1_and_r2_in_the_bias():
    """The default config's eps is 0.01, and a parameter trained below it acts as 0.01: log form
    -r1 log(1 + r2 d) with r1 -> 0.01 (or r2 -> 0.01); power form -r1 d^r2 with r2 -> 0.01 (and at most 2)."""
    assert make_config("kerple").eps == 0.01
    i, j = torch.tensor([3.0]), torch.tensor([0.0])  # d = 3
    log = make_config("kerple").module(1)
    with torch.no_grad():
        log.r1.fill_(-1.0)
        log.r2.fill_(0.5)
    assert log(i, j)[0, 0, 0].item() == pytest.approx(-0.01 * math.log(1 + 0.5 * 3), rel=1e-6)
    with torch.no_grad():
        log.r1.fill_(1.5)
        log.r2.fill_(-1.0)
    assert log(i, j)[0, 0, 0].item() == pytest.approx(-1.5 * math.log(1 + 0.01 * 3), rel=1e-6)
    power = make_config("kerple", form="power").module(1)
    with torch.no_grad():
        power.r1.fill_(0.001)
        power.r2.fill_(-1.0)
    assert power(i, j)[0, 0, 0].item() == pytest.approx(-0.01 * 3 ** 0.01, rel=1e-6)


# --- FIRE ----------------------------------------------------------------------------------------------------------


def _fire_by_hand(i: float, j: float, head: int) -> float:
    """The paper's formula with c = 0.1, L = 512 and the MLP ``_fix_mlp`` sets: head h is (h + 1) x."""
    x = math.log(0.1 * abs(i - j) + 1) / math.log(0.1 * max(i, 512) + 1)
    return (head + 1) * x


def _fix_mlp(fire: torch.nn.Module) -> None:
    """f(x) = (h + 1) relu(x) summed over the hidden units / width: the bias reads the normalised distance x."""
    first, last = fire.mlp[0], fire.mlp[2]
    with torch.no_grad():
        first.weight.fill_(1.0)
        first.bias.zero_()
        heads, width = last.weight.shape
        last.weight.copy_(torch.arange(1, heads + 1, dtype=torch.float32)[:, None].expand(heads, width) / width)
        last.bias.zero_()


QUERIES = [1.0, 10.0, 100.0, 511.0, 512.0, 513.0, 600.0, 2000.0]  # below, at and past L = 512


def test_fire_defaults_are_the_papers_c_and_threshold():
    config = make_config("fire")
    assert (config.c, config.threshold) == (0.1, 512.0)
    fire = config.module(2)
    assert fire.c.item() == pytest.approx(0.1, rel=1e-7) and fire.threshold.item() == 512.0
    _fix_mlp(fire)
    q = torch.tensor(QUERIES)
    k = torch.tensor([0.0, 1.0, 5.0, 400.0])
    bias = fire(q, k)  # [2, 8, 4]
    for a, i in enumerate(QUERIES):
        for b, j in enumerate(k.tolist()):
            if j > i:
                continue  # (causal pairs only)
            for head in range(2):
                assert bias[head, a, b].item() == pytest.approx(_fire_by_hand(i, j, head), rel=1e-5, abs=1e-7), (i, j)
    # a few of them written out: psi(x) = ln(0.1 x + 1), psi(512) = ln 52.2 = 3.955082
    assert bias[0, 1, 0].item() == pytest.approx(0.175255, rel=1e-5)  # i = 10, j = 0: ln 2 / ln 52.2
    assert bias[0, 2, 0].item() == pytest.approx(0.606282, rel=1e-5)  # i = 100, j = 0: ln 11 / ln 52.2
    assert bias[0, 7, 0].item() == pytest.approx(1.0, rel=1e-5)  # i = 2000 > L: psi(i) / psi(i)
    assert bias[1, 6, 3].item() == pytest.approx(1.481205, rel=1e-5)  # head 2, i = 600, j = 400: 2 ln 21 / ln 61


def test_fire_defaults_reach_the_patched_model():
    """The layers a plain ``rope_ext.patch(model, "fire")`` builds use c = 0.1 and L = 512 (GPT-2 of 4 heads)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    rope_ext.patch(model, "fire")
    fire = model.rope_ext.fire.layers[0]
    _fix_mlp(fire)
    q = torch.tensor(QUERIES)
    bias = fire(q, torch.tensor([0.0]))  # [4, 8, 1]
    expected = [[_fire_by_hand(i, 0.0, head) for i in QUERIES] for head in range(4)]
    assert bias[:, :, 0].tolist() == [pytest.approx(row, rel=1e-5) for row in expected]
    rope_ext.unpatch(model, discard_trained=True)


# --- PoSE at odd windows -------------------------------------------------------------------------------------------

#: window -> the longest first chunk, ceil(W / 2) = (W + 1) // 2 in the reference, written out
LONGEST_FIRST_CHUNK = {2: 1, 3: 2, 5: 3, 7: 4, 9: 5, 11: 6}


@pytest.mark.parametrize("window", sorted(LONGEST_FIRST_CHUNK))
def test_pose_first_chunk_at_odd_windows(window):
    """The first chunk holds 1..ceil(W/2) tokens, uniformly, at positions 0..; the rest follow one jump of s in
    0..T - W (s = 0: no jump to see). Every length and both extreme jumps occur, nothing else does."""
    target = window + 20
    longest = LONGEST_FIRST_CHUNK[window]
    generator = torch.Generator().manual_seed(window)
    counts: dict[int, int] = {}
    skips = set()
    draws = 300 * longest
    for _ in range(draws):
        ids = pose_position_ids(window, target, generator).tolist()
        jumps = [k for k in range(1, window) if ids[k] != ids[k - 1] + 1]
        assert len(jumps) <= 1, ids
        first = jumps[0] if jumps else None
        skip = ids[first] - first if jumps else 0
        skips.add(skip)
        assert ids == list(range(first or window)) + list(range((first or window) + skip, window + skip)), ids
        assert 0 <= skip <= target - window and ids[-1] < target
        if first is not None:
            counts[first] = counts.get(first, 0) + 1
    assert sorted(counts) == list(range(1, longest + 1)), counts
    seen = sum(counts.values())
    assert seen == pytest.approx(draws * 20 / 21, rel=0.05)  # a jump unless s = 0 (1 in 21): never a whole-window chunk
    for length, count in counts.items():
        assert count == pytest.approx(seen / longest, rel=0.25), (length, counts)
    assert {0, 1, target - window} <= skips
