"""Positions from ``position_ids``: PoSE-style ids with jumps (per row, increasing) reach every method; a PoSE
training batch attends causally across the jump, unpatched and patched; fast == the plain reference with such
ids; what stays refused says so."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, tiny_model

import rope_ext
from rope_ext.attention import kernels
from rope_ext.attention.program import kernel_override
from rope_ext.attention.reference import program_reference
from rope_ext.train import pose_batch, pose_position_ids

L = ORIGINAL_CONTEXT
LONG_FACTOR = [1.0 + 3.0 * i / 7 for i in range(8)]
#: every registered method, with options that make it act on a window of 3L tokens aimed at 8L positions
EVERY_METHOD = {
    "pi": {"factor": 8.0}, "ntk": {"factor": 8.0}, "dynamic_ntk": {"factor": 8.0}, "ntk_by_parts": {"factor": 8.0},
    "yarn": {"factor": 8.0}, "dynamic_yarn": {"factor": 8.0}, "llama3": {"factor": 8.0},
    "longrope": {"factor": 8.0, "long_factor": LONG_FACTOR},
    "rerope": {}, "leaky_rerope": {"k": 4.0}, "self_extend": {"G": 4}, "string": {}, "dca": {}, "logn": {},
    "temperature": {"floor_scale": 16},
    "s2_attn": {},  # (eval mode: full attention; in training, tests/test_s2attn.py)
    "alibi": {}, "kerple": {}, "sandwich": {}, "fire": {}, "xpos": {"scale_base": 64.0},
}
#: methods for learned absolute tables (GPT-2), with jumping ids in tests/test_biases.py; T5's, DeBERTa's and XLNet's
#: (no position ids of their own: tests/test_t5.py, test_deberta.py, test_xlnet.py)
TABLE_METHODS = {"abs_interp", "abs_hierarchical", "sinusoidal"} | {
    "t5_bucket_scale", "t5_bucket_extend", "deberta_bucket_scale", "deberta_bucket_stretch", "xlnet_interp",
    "xlnet_clamp",
}
PROGRAMS = ["rerope", "leaky_rerope", "self_extend", "string", "dca", "logn", "temperature:floor_scale=16",
            "dynamic_ntk:factor=8:cache_consistent=true",
            "yarn:factor=8+dca", "self_extend:G=4+logn", "alibi", "fire", "xpos:scale_base=64"]


def test_every_registered_method_is_covered():
    assert set(EVERY_METHOD) | TABLE_METHODS == set(rope_ext.list_methods())


def test_pose_position_ids_follow_the_reference_scheme():
    """Two chunks: the first 1..ceil(W/2) tokens at 0.., the rest jumping by 0..T-W; ids increase, stay below T;
    every first-chunk length and both extreme skips occur."""
    generator = torch.Generator().manual_seed(0)
    firsts, skips = set(), set()
    for _ in range(400):
        ids = pose_position_ids(10, 40, generator)
        assert ids.shape == (10,) and bool((ids[1:] > ids[:-1]).all()) and int(ids.max()) < 40 and int(ids[0]) == 0
        steps = (ids[1:] - ids[:-1]).tolist()
        jump = next((i + 1 for i, step in enumerate(steps) if step != 1), None)
        first = jump if jump is not None else None
        skip = int(ids[jump] - jump) if jump is not None else 0
        if first is not None:
            firsts.add(first)
        skips.add(skip)
    assert firsts == {1, 2, 3, 4, 5} and {1, 30} <= skips and 0 in skips
    assert pose_position_ids(7, 7, generator).tolist() == list(range(7))  # no room to skip
    for window, target, error in [(1, 10, "window must be >= 2"), (10, 5, "target=5 must be at least the window")]:
        with pytest.raises(ValueError, match=error):
            pose_position_ids(window, target)
    with pytest.raises(TypeError, match="window must be an int"):
        pose_position_ids(10.0, 40)


@torch.no_grad()
def _logits(model, **inputs) -> torch.Tensor:
    return model(**inputs).logits


def _jumping_batch(window: int, target: int, seed: int = 0):
    ids = torch.cat([input_ids(window, seed=seed), input_ids(window, seed=seed + 1)])
    batch = pose_batch(ids, target, torch.Generator().manual_seed(seed))
    batch["position_ids"][0] = torch.cat([torch.arange(window // 3), torch.arange(window - window // 3) + 5 * L])
    return batch


def _second_chunk_sees_the_first(model, batch, **kwargs) -> bool:
    """Whether changing the first chunk's tokens changes the second chunk's logits (row 0: jump after W/3)."""
    cut = batch["input_ids"].shape[1] // 3
    changed = {**batch, "input_ids": batch["input_ids"].clone()}
    changed["input_ids"][0, :cut] = (changed["input_ids"][0, :cut] + 7) % 100 + 3
    keys = ("input_ids", "position_ids", "attention_mask")
    a = _logits(model, **{k: batch[k] for k in keys if k in batch}, **kwargs)
    b = _logits(model, **{k: changed[k] for k in keys if k in changed}, **kwargs)
    return bool((a[0, cut:] - b[0, cut:]).abs().max() > 1e-4)


def test_the_packed_sequence_trap_and_pose_batch_avoiding_it():
    """transformers reads a jump in position_ids without a mask or cache as a packed-sequence boundary (the second
    chunk no longer sees the first); ``pose_batch``'s all-ones mask keeps attention causal across the jump."""
    model = tiny_model("llama")
    batch = _jumping_batch(3 * L, 8 * L)
    trap = {k: batch[k] for k in ("input_ids", "position_ids")}
    assert not _second_chunk_sees_the_first(model, trap, use_cache=False)  # the trap, measured
    assert _second_chunk_sees_the_first(model, batch, use_cache=False)


@pytest.mark.parametrize("method", sorted(EVERY_METHOD))
def test_a_pose_batch_attends_causally_across_the_jump_for_every_method(method):
    model = tiny_model("llama")
    batch = _jumping_batch(3 * L, 8 * L)
    with rope_ext.patched(model, method, **EVERY_METHOD[method]):
        assert _second_chunk_sees_the_first(model, batch, use_cache=False)
        no_mask = {k: batch[k] for k in ("input_ids", "position_ids")}  # rope_ext's attention: no packing either
        if model.config._attn_implementation == "rope_ext":
            assert _second_chunk_sees_the_first(model, no_mask, use_cache=False)
        loss = model(**batch, use_cache=False).loss
    assert torch.isfinite(loss)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
@pytest.mark.parametrize("method", PROGRAMS)
def test_fast_path_matches_the_reference_with_jumping_position_ids(family, method, monkeypatch):
    """Ids with jumps and offsets, different per row, padded or not, with gradients or not: the general path (the
    rule's regions) against the plain formula; and the ids matter (they change the logits)."""
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 41)
    monkeypatch.setattr(kernels, "MASKED_BLOCK", 16)  # several masked blocks on the general path
    model = tiny_model(family)
    batch = _jumping_batch(3 * L, 8 * L, seed=3)
    batch["position_ids"][1] += 17  # an offset too
    mask = torch.ones_like(batch["input_ids"])
    mask[1, :9] = 0  # (a padded row's positions count from its first token)
    with rope_ext.patched(model, method):
        for extra in ({}, {"attention_mask": mask}):
            inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], **extra}
            fast = _logits(model, **inputs)
            with kernel_override(program_reference):
                reference = _logits(model, **inputs)
            torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)
        plain = logits(model, batch["input_ids"])
        assert (fast[0] - plain[0]).abs().max() > 1e-4
        leaf = model.get_input_embeddings().weight
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        assert torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0
        model.zero_grad()


@pytest.mark.parametrize("jumps", [True, False], ids=["pose", "contiguous"])
@pytest.mark.parametrize("method", PROGRAMS)
def test_training_gradients_match_the_reference(method, jumps, monkeypatch):
    """A training step, on PoSE-like ids (jumps and an offset: the rules' regions) or on plain ones (the fast
    runners' tiles), one row padded: every parameter's gradient through the fast path (its calls recorded, one
    backward from the merged log-sum-exp) equals the plain formula's."""
    monkeypatch.setattr(kernels, "MASKED_BLOCK", 16)  # several masked blocks on the general path
    monkeypatch.setattr(kernels, "TILE", 16)  # several tiles per region on the fast runners
    model = tiny_model("llama")
    model.train()
    batch = _jumping_batch(2 * L, 8 * L, seed=3)
    batch["position_ids"][1] += 17
    if not jumps:
        del batch["position_ids"]
    batch["attention_mask"][1, :9] = 0
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    grads = []
    with rope_ext.patched(model, method):
        for override in (contextlib.nullcontext(), kernel_override(program_reference)):
            with override:
                model(**batch, use_cache=False).loss.backward()
            grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
    fast, reference = grads
    assert fast.keys() == reference.keys() and len(fast) > 10
    for name in fast:  # (relative to the largest entry: gradients of a tiny model are small; some are ~0 by symmetry)
        error, scale = (fast[name] - reference[name]).abs().max().item(), reference[name].abs().max().item()
        assert error <= 1e-4 * scale + 1e-8, f"{name}: {error:.2e} off, its largest gradient {scale:.2e}"


def test_position_ids_are_taken_as_they_are_and_padding_shifts_nothing():
    """A padded row: ids numbered by slot (transformers' own, the pads counted) or by token (generate's) are its
    own positions; an offset or a jump is taken as it is, in a padded batch as alone; a row without padding keeps
    its ids whatever else the batch holds."""
    model = tiny_model("llama")
    ids = input_ids(2 * L, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    by_slot = torch.arange(2 * L)[None].repeat(2, 1)
    by_token = (mask.cumsum(-1) - 1).clamp(min=0)
    with rope_ext.patched(model, "self_extend", G=4):
        a = logits(model, ids, attention_mask=mask, position_ids=by_slot)
        b = logits(model, ids, attention_mask=mask, position_ids=by_token)
        alone = logits(model, ids[1:, 10:])
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        torch.testing.assert_close(a[1, 10:], alone[0], rtol=0, atol=2e-5)
        shifted = by_token + 101  # (not a multiple of G: grouped distances change)
        jumped = by_token.clone()
        jumped[:, 70:] += 40
        for custom in (shifted, jumped):
            batch = logits(model, ids, attention_mask=mask, position_ids=custom)
            row0 = logits(model, ids[:1], position_ids=custom[:1])
            row1 = logits(model, ids[1:, 10:], position_ids=custom[1:, 10:])
            torch.testing.assert_close(batch[0], row0[0], rtol=0, atol=2e-5)
            torch.testing.assert_close(batch[1, 10:], row1[0], rtol=0, atol=2e-5)
            assert (batch[0] - a[0]).abs().max() > 1e-4  # the ids mattered


def test_what_stays_refused_says_so():
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = input_ids(2 * L)
    jumped = torch.cat([torch.arange(L), torch.arange(L) + 3 * L])[None]
    with rope_ext.patched(model, "dca"):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, position_ids=jumped, past_key_values=cache)  # a prefill with jumps: taken
            with pytest.raises(ValueError, match=r"custom position_ids .* are supported on a forward without a cached "
                                                 r"prefix, not with a cache"):
                model(input_ids=ids[:, :1], position_ids=jumped[:, -1:] + 1, past_key_values=cache)
        for bad, message in [(torch.cat([torch.arange(L), torch.arange(L)])[None], "Packed sequences"),
                             (torch.arange(2 * L).flip(0)[None], "increasing position_ids"),
                             (torch.arange(2 * L)[None] - 5, "increasing position_ids >= 0")]:
            with pytest.raises(ValueError, match=message):
                model(input_ids=ids, position_ids=bad)
