"""Attention-rewrite methods: identity settings, fast path == reference, padding, chunked prefill, the KV
cache, combinations, isolation between models, save/reload and bad values (tiny models, L = 64)."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, tiny_config, tiny_model

import rope_ext
from rope_ext.attention import blocks, key_cache, kernels, rules
from rope_ext.attention.key_cache import NOWHERE, ROTATED_ATTR, KeyRotation
from rope_ext.attention.program import PositionRule, kernel_override
from rope_ext.attention.reference import program_reference, reference_attention
from rope_ext.installers import attention as attention_hooks
from rope_ext.methods.rope import rope_cos_sin, rotate, rotate_at_zero
from rope_ext.methods.windows import rerope_positions

FAMILIES = ["llama", "qwen2", "gemma3", "gpt_neox", "phi3"]
L = ORIGINAL_CONTEXT
#: (method, options) with windows small enough that a 200-token input crosses every region
METHODS = [
    ("rerope", {}),
    ("leaky_rerope", {"k": 4.0}),
    ("self_extend", {"G": 4}),
    ("string", {}),
    ("dca", {}),
    ("logn", {}),
    ([{"method": "yarn", "factor": 4}, "dca"], None),
    (["rerope", "logn"], None),
    ([{"method": "dynamic_ntk", "factor": 4}, "self_extend"], None),
]
IDS = [m if isinstance(m, str) else "+".join(x if isinstance(x, str) else x["method"] for x in m) for m, _ in METHODS]


def _patch(model, method, options):
    return rope_ext.patch(model, method, **(options or {}))


def _programs(model):
    return [program for _, program in attention_hooks.installed_programs(model)]


def _rules(model):
    """The position rules of the layers a method applies to (their ``config`` set)."""
    return [p.position_rule for p in _programs(model) if p.position_rule is not None and p.position_rule.config is not None]


def reference():
    """Every program runs the plain formula (full score matrices in float64) while the block runs."""
    return kernel_override(program_reference)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(kernels, "TILE", 16)  # several tiles per region


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in FAMILIES}


# --- identity and defining properties -----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "method,options",
    [("rerope", {"w": L - 1}), ("leaky_rerope", {"w": L - 1}), ("self_extend", {"W": L - 1}),
     ("string", {"S": L - 1, "W": 8}), ("dca", {"chunk_size": L, "local_window": 1})],
)
def test_window_beyond_the_sequence_gives_the_unpatched_logits(models, family, method, options):
    model = models[family]
    ids = input_ids(L - 2, batch=2)
    before = logits(model, ids)
    with rope_ext.patched(model, method, **options):
        during = logits(model, ids)
    torch.testing.assert_close(during, before, rtol=0, atol=1e-5)
    assert torch.equal(logits(model, ids), before)  # unpatch is bit-exact


def test_rerope_scores_depend_only_on_min_distance_and_window(monkeypatch):
    """The fast path against full score matrices built from ``min(i - j, w)`` (written out here, not the
    method's own mapping), over lengths around and beyond the window, tile sizes that split it, GQA."""
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    for n, w, tile in [(40, 8, 16), (100, 33, 16), (130, 64, 512), (7, 20, 4)]:
        q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        rel = torch.minimum(i - j, torch.full_like(i - j, w))
        expected = reference_attention(q, k, v, rel[None], inv_freq, allowed=(i >= j)[None], scaling=0.25)
        monkeypatch.setattr(kernels, "TILE", tile)
        acc = kernels.Accumulator(q, 16)
        keys = KeyRotation(None, NOWHERE, inv_freq, 1.0)
        rules.window(acc, rope_ext.methods.ReRopeConfig(w=w), q, k, v, 0.25, torch.arange(n).float(), keys, None)
        torch.testing.assert_close(acc.out, expected.float(), rtol=0, atol=2e-6)
    assert torch.equal(rerope_positions(i, j, w), rel)


@pytest.mark.parametrize("windowed", [False, True], ids=["pieces", "window"])
@pytest.mark.parametrize("grad", [False, True], ids=["flash", "matmul"])
def test_region_covers_exactly_its_pairs(grad, windowed):
    """``region``'s decomposition (causal / anti-causal squares, cores, clipped masked pieces, the untiled lower
    region) and its one-call form (``window_plan``: what CUDA flash attention runs with its window sizes, here
    as the window's mask) against one explicitly masked softmax, for bands of every width, clipped key ranges,
    chunked queries and ``out_offset``."""
    torch.manual_seed(0)
    for n, q0, near, far, key_offset, keys, tile in [
        (50, 0, 0, 9, 0, 50, 4), (50, 0, 0, 9, 0, 50, 64), (37, 20, 0, 15, 5, 52, 8), (40, 0, 0, 0, 0, 40, 4),
        (40, 0, 0, 1, 0, 40, 4), (30, 10, 3, 11, 0, 37, 5), (60, 0, 12, None, 0, 48, 16),
        (25, 30, 0, None, 10, 45, 16), (20, 0, 30, None, 0, 40, 16), (33, 3, 2, 40, 0, 34, 7),
        (1, 49, 0, 9, 0, 50, 4), (1, 49, 10, None, 0, 50, 4), (1, 5, 10, None, 0, 50, 4), (1, 3, 0, 9, 0, 4, 4),
        (30, 0, 0, 9, 0, 12, 8), (30, 20, 2, 6, 0, 40, 8), (30, 20, 0, 9, 25, 10, 8), (12, 0, 5, 3, 0, 12, 4),
    ]:
        q = torch.randn(1, 4, n, 8, requires_grad=grad)
        k, v = torch.randn(1, 2, keys, 8), torch.randn(1, 2, keys, 8)
        acc = kernels.Accumulator(torch.zeros(1, 4, n + 3, 8), 8)
        kernels.region(acc, q, k, v, 0.3, q0, near, far, key_offset, tile, out_offset=3, windowed=windowed)
        i = torch.arange(q0, q0 + n)[:, None]
        j = torch.arange(key_offset, key_offset + keys)[None]
        allowed = (j <= i - near) & (j >= (i - far if far is not None else -1))
        scores = (q.detach() @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
        expected = weights @ v.repeat_interleave(2, 1)
        torch.testing.assert_close(acc.out[:, :, 3:].detach(), expected, rtol=0, atol=2e-6)
        assert torch.equal(acc.out[:, :, :3], torch.zeros(1, 4, 3, 8))
        empty = ~allowed.any(-1)
        assert torch.isneginf(acc.lse[0, :, 3:][:, empty]).all() and torch.isfinite(acc.lse[0, :, 3:][:, ~empty]).all()


def test_half_precision_results_merge_as_one_softmax():
    """The flash op returns a bf16 call's output in bf16: the accumulator keeps a first result over every query as it
    came and reads it into float32 as it merges, over every query and over some of them. Three disjoint key sets, the
    scores of each on another scale (so the merge weights differ), against one float64 softmax over all the keys."""
    from rope_ext.attention import dispatch

    torch.manual_seed(0)
    n = 40
    q = torch.randn(1, 4, n, 16).bfloat16()
    keys = [torch.randn(1, 2, 30, 16) * scale for scale in (0.5, 2.0, 1.0)]
    values = [torch.randn(1, 2, 30, 16) for _ in keys]
    k, v = torch.cat(keys, 2).bfloat16(), torch.cat(values, 2).bfloat16()
    acc = kernels.Accumulator(q, 16)
    for index, (start, first) in enumerate([(0, 0), (0, 30), (25, 60)]):  # (every query twice, then some)
        out, lse = dispatch.lse_attention(q[:, :, start:], k[:, :, first : first + 30], v[:, :, first : first + 30], 0.25)
        assert out.dtype == torch.bfloat16 or index  # (the first is kept as the op returned it)
        acc.add(start, n, out, lse)
    seen = torch.ones(n, 90, dtype=torch.bool)
    seen[:25, 60:] = False  # (the third set reaches only the queries from 25 on)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = (q.double() @ kk.transpose(-1, -2) * 0.25).masked_fill(~seen, float("-inf"))
    expected = torch.softmax(scores, -1) @ vv
    assert acc.out.dtype == torch.float32
    torch.testing.assert_close(acc.out.double(), expected, rtol=0, atol=1e-2)


@pytest.mark.parametrize("bias_form", [None, "full", "one head", "key only"])
def test_recorded_calls_give_the_gradients_of_one_masked_softmax(bias_form):
    """A training step's accumulator (``Recorder``: the calls run without autograd, one backward from the merged
    log-sum-exp) over bands, lower regions, clipped pieces and a causal call, GQA, with a learnable bias of each
    form: its output and the gradients of queries, keys, values and bias equal autograd through one explicitly
    masked softmax over the same pairs."""
    torch.manual_seed(0)
    for n, q0, near, far, key_offset, keys, tile in [
        (50, 0, 0, 9, 0, 50, 4), (37, 20, 0, 15, 5, 52, 8), (60, 0, 12, None, 0, 48, 16), (30, 20, 2, 6, 0, 40, 8),
        (20, 0, 30, None, 0, 40, 16), (40, 0, 0, None, 0, 40, 64),
    ]:
        q = torch.randn(2, 6, n, 8, requires_grad=True)
        k, v = torch.randn(2, 2, keys, 8, requires_grad=True), torch.randn(2, 2, keys, 8, requires_grad=True)
        shape = {None: None, "full": (6, n, keys), "one head": (1, n, keys), "key only": (6, 1, keys)}[bias_form]
        bias = None if shape is None else torch.randn(shape, requires_grad=True)

        def bias_at(i, j):
            rows = (i - q0).long() if bias.shape[1] > 1 else torch.zeros_like(i).long()
            return bias[:, rows][:, :, (j - key_offset).long()]

        acc = kernels.Recorder(q, 8)
        kernels.region(acc, q, k, v, 0.3, q0, near, far, key_offset, tile, bias=None if bias is None else bias_at)
        out = acc.out
        i = torch.arange(q0, q0 + n)[:, None]
        j = torch.arange(key_offset, key_offset + keys)[None]
        allowed = (j <= i - near) & (j >= (i - far if far is not None else -1))
        scores = q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.3
        if bias is not None:
            scores = scores + bias
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        expected = weights @ v.repeat_interleave(3, 1)
        torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
        if not bool(allowed.any()):  # (no call: zeros)
            continue
        leaves = [t for t in (q, k, v, bias) if t is not None]
        g = torch.randn_like(out)
        got = torch.autograd.grad((out * g).sum(), leaves)
        want = torch.autograd.grad((expected * g).sum(), leaves)
        for name, a, b in zip("qkvb", got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_a_training_step_keeps_no_score_matrix_for_autograd():
    """With gradients the rule kernel records its calls (``Recorder``): what autograd saves is queries, keys, values
    and outputs (and the calls' bool masks), never a ``heads x queries x keys`` score or weight block (the matmul
    path saved every tile's), here on PoSE positions (the general path's masked blocks)."""
    model = tiny_model("llama")
    model.train()
    rope_ext.patch(model, "dca")
    ids = input_ids(3 * L)
    heads, n = model.config.num_attention_heads, ids.shape[1]
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())  # bytes
        return t

    jump = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2) + 5 * L])[None]  # (PoSE: the general path)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, position_ids=jump, attention_mask=torch.ones_like(ids)).loss
    loss.backward()
    scores = [size for size in sizes if size >= heads * n * n]  # (a quarter of one float32 score matrix; a bool mask is less)
    assert sizes and not scores, (scores, 4 * heads * n * n)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_single_query_scores_each_region_once_and_softmaxes_the_row():
    """Decode's accumulator: a band region, a far region scored with another query rotation and a masked piece,
    written into one score row, against one softmax over the same scores written out; keys no region covers
    get no weight. It takes one query only, and steps aside for gradients and a CPU half-precision cache."""
    torch.manual_seed(0)
    m, w = 40, 9
    q_near, q_far = torch.randn(2, 6, 1, 8), torch.randn(2, 6, 1, 8)
    k, v = torch.randn(2, 2, m, 8), torch.randn(2, 2, m, 8)
    acc = kernels.SingleQuery(q_near, v)
    kernels.region(acc, q_near, k[:, :, m - w :], v[:, :, m - w :], 0.3, m - 1, 0, w - 1, m - w)
    kernels.region(acc, q_far, k[:, :, 5 : m - w], v[:, :, 5 : m - w], 0.3, m - 1, w, None, 5)
    allowed = torch.arange(5) % 2 == 0
    acc.attend(0, 1, q_far, k[:, :, :5], v[:, :, :5], 0.3, 0, allowed[None])
    kk, vv = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    scores = torch.cat([(q_far @ kk[:, :, : m - w].transpose(-1, -2)), q_near @ kk[:, :, m - w :].transpose(-1, -2)], -1)
    scores = (scores * 0.3).masked_fill(torch.cat([~allowed, torch.zeros(m - 5, dtype=torch.bool)]), float("-inf"))
    torch.testing.assert_close(acc.out, torch.softmax(scores, -1) @ vv, rtol=0, atol=2e-6)
    half = kernels.SingleQuery(q_near, v)
    kernels.region(half, q_near, k[:, :, m - w :], v[:, :, m - w :], 0.3, m - 1, 0, w - 1, m - w)
    expected = torch.softmax(q_near @ kk[:, :, m - w :].transpose(-1, -2) * 0.3, -1) @ vv[:, :, m - w :]
    torch.testing.assert_close(half.out, expected, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="one query"):
        acc.attend(0, 2, torch.randn(2, 6, 2, 8), k, v, 0.3, 0)
    assert kernels.SingleQuery.applies(q_near, k)
    assert not kernels.SingleQuery.applies(torch.randn(2, 6, 2, 8), k)
    assert not kernels.SingleQuery.applies(q_near.requires_grad_(), k)
    assert not kernels.SingleQuery.applies(q_near.detach().bfloat16(), k.bfloat16())


def test_rotate_at_zero_is_rotate_at_position_zero():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6))  # 6 rotary dims of 8: partial rotary
    x = torch.randn(2, 3, 10, 8)
    for factor, dtype in [(1.0, torch.float32), (1.2, torch.float32), (torch.tensor(0.9), torch.bfloat16)]:
        y = x.to(dtype)
        assert torch.equal(rotate_at_zero(y, inv_freq, factor), rotate(y, torch.zeros(10), inv_freq, factor))
    assert rotate_at_zero(x, inv_freq, 1.0) is x


def test_rotate_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(2, 3, 10, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    positions = torch.arange(10).float()
    freqs = positions[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    expected, _ = apply_rotary_pos_emb(x, x, emb.cos()[None], emb.sin()[None])
    assert torch.equal(rotate(x, positions, inv_freq, 1.0), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotate_in_place_is_bit_exact_with_transformers_formula(dtype):
    """``rotate`` writes ``x * cos + rotate_half(x) * sin`` without temporaries; bit for bit the formula as
    transformers computes it (rope_cos_sin's float32 tables cast to the dtype), for partial rotary, a tensor
    attention factor, non-contiguous input and an ``out`` that is a slice of a larger buffer."""
    from transformers.models.llama.modeling_llama import rotate_half

    torch.manual_seed(0)
    for rotary_dims, factor in [(16, 1.0), (12, 1.3), (16, torch.tensor(0.87))]:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dims, 2).float() / rotary_dims))
        x = (torch.randn(2, 3, 40, 16) * 7).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)[:, :, 5:]
        positions = torch.arange(100, 135).float() * 3.5
        cos, sin = rope_cos_sin(positions[None], inv_freq, factor)
        cos, sin = cos.to(dtype)[:, None], sin.to(dtype)[:, None]
        head = x[..., :rotary_dims]
        expected = torch.cat((head * cos + rotate_half(head) * sin, x[..., rotary_dims:]), -1)
        assert torch.equal(rotate(x, positions, inv_freq, factor), expected)
        buffer = torch.full((2, 3, 50, 16), float("nan"), dtype=dtype)
        written = rotate(x, positions, inv_freq, factor, out=buffer[:, :, 10:45])
        assert written.data_ptr() == buffer[:, :, 10:45].data_ptr() and torch.equal(buffer[:, :, 10:45], expected)
        assert buffer[:, :, :10].isnan().all() and buffer[:, :, 45:].isnan().all()
        if dtype == torch.float32:  # with gradients (out of place): the same values, and the formula's gradient
            leaf = x.detach().requires_grad_()
            rotated = rotate(leaf, positions, inv_freq, factor)
            assert torch.equal(rotated, expected)
            rotated.square().sum().backward()
            reference = x.detach().requires_grad_()
            head = reference[..., :rotary_dims]
            torch.cat((head * cos + rotate_half(head) * sin, reference[..., rotary_dims:]), -1).square().sum().backward()
            torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-6, atol=1e-6)


# --- the fast path against the reference, in whole models --------------------------------------


class _PathSpy:
    """Which path computed a forward: counts of the fast runners (``rules.FAST_RUNNERS``), the general regions path
    (``blocks.masked_blocks``) and the region kernels (``kernels.region``: the plain kernel's too), and of the plain
    reference (``reference._softmax_out``: every reference call ends there), which raises while ``fast_only``."""

    def __init__(self, monkeypatch):
        from rope_ext.attention import reference as reference_module

        self.counts: dict[str, int] = {}
        self.fast_only = False
        self._spy(monkeypatch)
        monkeypatch.setattr(reference_module, "_softmax_out", self._counting("reference", reference_module._softmax_out))

    def _spy(self, monkeypatch):
        """Wrap what this spy counts (the reference is always counted)."""
        for cls, runner in list(rules.FAST_RUNNERS.items()):
            monkeypatch.setitem(rules.FAST_RUNNERS, cls, self._counting(runner.__name__, runner))
        monkeypatch.setattr(blocks, "masked_blocks", self._counting("general", blocks.masked_blocks))
        monkeypatch.setattr(kernels, "region", self._counting("region", kernels.region))

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            if name == "reference" and self.fast_only:
                raise AssertionError("the plain reference ran while the fast path was expected")
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def fast(self):
        self.counts, self.fast_only = {}, True
        try:
            yield self.counts
        finally:
            self.fast_only = False


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,options", METHODS, ids=IDS)
def test_fast_path_matches_reference(models, family, method, options, monkeypatch, small_tiles):
    """The fast path (seen to run: its runner, never the reference) equals the plain reference (seen to run: never a
    fast runner), and differs from the unpatched model: forcing every call onto the reference fails here."""
    model = models[family]
    for module in model.modules():  # sharper attention (restored after the test): tiny random models attend almost
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):  # uniformly, so one pair scored at a wrong
            monkeypatch.setattr(module, "scaling", module.scaling * 16.0)  # position would hide under the tolerance
    ids = input_ids(3 * L + 7, batch=2)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 41)  # several query blocks, not aligned with the tiles
    spy = _PathSpy(monkeypatch)
    with rope_ext.patched(model, method, **(options or {})):
        rule = next(iter(_rules(model)), None)
        with spy.fast() as seen:
            fast = logits(model, ids)
        runner = {None: "region", "dca": "dual_chunk"}.get(rule and rule.config.method, "window")  # logn: the plain kernel
        assert seen.get(runner, 0) > 0 and "general" not in seen and "reference" not in seen, seen
        spy.counts = {}
        with reference():
            reference_logits = logits(model, ids)
        assert spy.counts.get("reference", 0) > 0 and set(spy.counts) == {"reference"}, spy.counts
    torch.testing.assert_close(fast, reference_logits, rtol=0, atol=2e-5)
    assert (fast - logits(model, ids)).abs().max() > 1e-4  # the method changed something


@pytest.mark.parametrize("method,options", METHODS[:4], ids=IDS[:4])
def test_sequences_one_or_two_past_the_window_match_the_reference(models, method, options, monkeypatch):
    """The window runners' edges: a sequence of exactly w + 1 tokens has one far key (the last query's key 0, at
    distance w); w + 2 has two; w has none. Each length, fast path == reference (sharpened attention)."""
    model = models["llama"]
    for module in model.modules():
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):
            monkeypatch.setattr(module, "scaling", module.scaling * 16.0)
    with rope_ext.patched(model, method, **(options or {})):
        w = _rules(model)[0].config.window
        for length in (w, w + 1, w + 2):
            ids = input_ids(length, seed=length)
            fast = logits(model, ids)
            with reference():
                expected = logits(model, ids)
            torch.testing.assert_close(fast, expected, rtol=0, atol=2e-5, msg=lambda m: f"length {length}: {m}")


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
@pytest.mark.parametrize("method,options", METHODS[:6], ids=IDS[:6])
def test_left_padded_batch_equals_each_row_alone(models, family, method, options, monkeypatch, small_tiles):
    model = models[family]
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 41)
    long, short = input_ids(2 * L + 10, seed=3), input_ids(L + 5, seed=4)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with rope_ext.patched(model, method, **(options or {})):
        batch = logits(model, ids, attention_mask=mask)
        alone = [logits(model, long), logits(model, short)]
    torch.testing.assert_close(batch[0], alone[0][0], rtol=0, atol=2e-5)
    torch.testing.assert_close(batch[1, pad:], alone[1][0], rtol=0, atol=2e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
@pytest.mark.parametrize("method,options", METHODS[:-1], ids=IDS[:-1])
def test_chunked_prefill_and_decode_equal_the_full_forward(models, family, method, options, small_tiles):
    from transformers import DynamicCache

    model = models[family]
    ids = input_ids(2 * L + 40)
    with rope_ext.patched(model, method, **(options or {})):
        full = logits(model, ids)
        cache = DynamicCache(config=model.config)
        pieces, start = [], 0
        for stop in (50, 90, 91, 150, ids.shape[1]):  # chunks of 50, 40, one token, 59, the rest
            with torch.no_grad():
                out = model(input_ids=ids[:, start:stop], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
            start = stop
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=2e-5)


@pytest.mark.parametrize("method,options", METHODS[:6], ids=IDS[:6])
def test_greedy_generate_with_cache_equals_full_forward(models, method, options):
    model = models["llama"]
    prompt = input_ids(L + 30)
    with rope_ext.patched(model, method, **(options or {})):
        out = model.generate(prompt, max_new_tokens=50, min_new_tokens=50, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        full = logits(model, out.sequences)
    steps = torch.stack(out.logits, 1)  # [1, 50, vocab]
    torch.testing.assert_close(steps, full[:, prompt.shape[1] - 1 : -1], rtol=0, atol=5e-5)
    assert out.sequences.shape[1] == prompt.shape[1] + 50


def test_cache_consistent_dynamic_ntk_equals_the_full_forward_in_one_layer():
    """With one layer, the cache-consistent mode makes every cached step exactly a full forward (all keys
    rotated with the current length's frequencies); natively the cached keys keep their old rotation."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    ids = input_ids(2 * L + 20)

    def stepwise():
        cache, outs = DynamicCache(config=model.config), []
        with torch.no_grad():
            outs.append(model(input_ids=ids[:, :L], past_key_values=cache).logits[:, -1])
            for t in range(L, ids.shape[1]):
                outs.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits[:, -1])
        return torch.stack(outs, 1)

    def prefix_forwards():
        return torch.stack([logits(model, ids[:, : t + 1])[:, -1] for t in range(L - 1, ids.shape[1])], 1)

    with rope_ext.patched(model, "dynamic_ntk", factor=4, cache_consistent=True):
        torch.testing.assert_close(stepwise(), prefix_forwards(), rtol=0, atol=2e-5)
    with rope_ext.patched(model, "dynamic_ntk", factor=4):
        assert (stepwise() - prefix_forwards()).abs().max() > 1e-3  # the inconsistency the mode removes


# --- decoding: rotated keys kept with the cache ---------------------------------------------------

#: every window and chunk kind: rotated keys kept per rule (band, far keys, chunk positions, all keys)
KEPT = [("rerope", {}), ("self_extend", {"G": 4}), ("dca", {}), ("string", {}), ("leaky_rerope", {"k": 4.0})]


def _decode(model, cache, tokens):
    """Feed ``tokens [b, t]`` one at a time; the last-position logits of each step ``[b, t, vocab]``."""
    outs = []
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            outs.append(model(input_ids=tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(outs, 1)


def _forget(cache):
    for layer in cache.layers:
        vars(layer).pop(ROTATED_ATTR, None)


@pytest.mark.parametrize("method,options", KEPT, ids=[m for m, _ in KEPT])
def test_decode_rotates_only_the_new_keys(models, method, options, monkeypatch):
    """A one-shot forward keeps nothing; from the first step that extends the cache on, each decode step
    rotates one key per layer and rule, and gives what rotating every cached key afresh gives."""
    from transformers import DynamicCache

    model = models["llama"]
    ids = input_ids(2 * L + 40, seed=5)
    prompt, steps = ids[:, : 2 * L], ids[:, 2 * L :]
    monkeypatch.setattr(key_cache, "GROWTH", 3)  # buffers run full and move every few steps
    with rope_ext.patched(model, method, **options):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        assert not any(vars(layer).get(ROTATED_ATTR) for layer in cache.layers)
        first = _decode(model, cache, steps[:, :1])
        kept = dict(vars(cache.layers[0])[ROTATED_ATTR])
        assert kept
        rotated_sizes = []
        real_rotate = key_cache.rotate

        def counting(x, positions, inv_freq, factor, out=None, tables=None):
            if x.shape[1] == model.config.num_key_value_heads:  # keys (queries have all heads)
                rotated_sizes.append(x.shape[2])
            return real_rotate(x, positions, inv_freq, factor, out=out, tables=tables)

        monkeypatch.setattr(key_cache, "rotate", counting)
        kept_steps = torch.cat([first, _decode(model, cache, steps[:, 1:])], 1)
        monkeypatch.setattr(key_cache, "rotate", real_rotate)
        assert rotated_sizes and max(rotated_sizes) == 1  # never more than the key a step adds
        assert all(vars(cache.layers[0])[ROTATED_ATTR][slot] is memo for slot, memo in kept.items())
        assert any(memo.start > 0 for memo in kept.values()) == (method != "dca" and method != "string")  # bands move
        monkeypatch.setattr(attention_hooks, "cache_link", lambda layer: None)
        fresh = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=fresh, use_cache=True)
        fresh_steps = _decode(model, fresh, steps)
        assert not any(ROTATED_ATTR in vars(layer) for layer in fresh.layers)
    torch.testing.assert_close(kept_steps, fresh_steps, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method,options", KEPT, ids=[m for m, _ in KEPT])
def test_decode_makes_each_rotation_table_once_per_forward(models, method, options, monkeypatch):
    """A decode step's short position sets (the query's, its far position, the new key's) have their ``(cos, sin)``
    tables made once per forward and used by every layer (``key_cache.SHARED_POSITIONS``), with logits bit-identical
    to every layer making its own (a dynamic method's frequencies, made per call, share nothing)."""
    import copy

    from transformers import DynamicCache

    model = copy.deepcopy(models["llama"])
    ids = input_ids(2 * L + 6, seed=5)
    made, used = [], []
    real_tables, real_rotate = key_cache.rotation_tables, key_cache.KeyRotation.rotate
    monkeypatch.setattr(key_cache, "rotation_tables", lambda *a: made.append(a[0].shape[-1]) or real_tables(*a))

    def rotating(self, x, positions, name):
        used.append(name) if x.shape[2] <= key_cache.SHARED_POSITIONS else None
        return real_rotate(self, x, positions, name)

    monkeypatch.setattr(key_cache.KeyRotation, "rotate", rotating)
    with rope_ext.patched(model, method, **options):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, : 2 * L], past_key_values=cache, use_cache=True)
        alone = copy.deepcopy(cache)
        made.clear(), used.clear()
        shared = _decode(model, cache, ids[:, 2 * L : 2 * L + 3])
        assert 0 < len(made) == len(set(used)) < len(used), (made, used)  # (each name's tables made once, used again)
        monkeypatch.setattr(key_cache, "SHARED_POSITIONS", 0)
        own = _decode(model, alone, ids[:, 2 * L : 2 * L + 3])
    assert torch.equal(shared, own)
    assert len(model.model.layers) >= 2



@pytest.mark.parametrize("edit", ["reorder", "crop", "select", "in_place", "other_sequence", "reset"])
def test_kept_keys_follow_every_edit_of_the_cache(models, edit):
    """A cache reordered (beam search), cropped (assisted decoding), narrowed to some rows, written in place
    or replaced keeps decoding exactly as a cache that never kept rotated keys."""
    from transformers import DynamicCache

    model = models["llama"]
    ids = torch.cat([input_ids(2 * L + 12, seed=6), input_ids(2 * L + 12, seed=7)])
    prompt, more, after = ids[:, : 2 * L], ids[:, 2 * L : 2 * L + 6], ids[:, 2 * L + 6 :]
    with rope_ext.patched(model, "self_extend", G=4):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        _decode(model, cache, more)
        if edit == "reorder":
            cache.reorder_cache(torch.tensor([1, 0]))
        elif edit == "crop":
            cache.crop(-4)
        elif edit == "select":
            cache.batch_select_indices(torch.tensor([1]))
            after = after[1:]
        elif edit == "in_place":
            for layer in cache.layers:
                layer.keys[:, :, : L].mul_(-1.0)
        elif edit == "other_sequence":
            other = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=prompt.flip(0), past_key_values=other, use_cache=True)
            _decode(model, other, more.flip(0))
            for layer, theirs in zip(cache.layers, other.layers):
                layer.keys, layer.values = theirs.keys, theirs.values
        elif edit == "reset":
            cache.reset()
            with torch.no_grad():
                model(input_ids=prompt.flip(0), past_key_values=cache, use_cache=True)
        reference = copy.deepcopy(cache)
        _forget(reference)
        torch.testing.assert_close(_decode(model, cache, after), _decode(model, reference, after), rtol=0, atol=1e-5)


def test_padded_batch_generate_keeps_rows_apart(models):
    """Greedy generation on a left-padded batch (each row keeps its own rotated keys) equals each row alone."""
    model = models["llama"]
    long, short = input_ids(2 * L + 10, seed=8), input_ids(L + 20, seed=9)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                   return_dict_in_generate=True)
    with rope_ext.patched(model, "dca"):
        batch = torch.stack(model.generate(ids, attention_mask=mask, **options).logits, 1)
        alone = [torch.stack(model.generate(row, **options).logits, 1) for row in (long, short)]
    torch.testing.assert_close(batch, torch.cat(alone), rtol=0, atol=5e-5)


def test_inference_mode_decoding_and_a_switch_of_mode_on_one_cache(models):
    """Inference tensors keep no version counter: the copy then relies on the tensor identity alone."""
    from transformers import DynamicCache

    model = models["llama"]
    ids = input_ids(2 * L + 20, seed=10)
    with rope_ext.patched(model, "dca"):
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[:, :-4], past_key_values=cache)
            first = _decode(model, cache, ids[:, -4:-2])
        rest = _decode(model, cache, ids[:, -2:])  # no_grad now, on a cache made under inference_mode
        torch.testing.assert_close(torch.cat([first, rest], 1), logits(model, ids)[:, -4:], rtol=0, atol=2e-5)


def test_stale_copies_go_at_the_next_forward_and_refused_calls_keep_no_cache(models):
    from transformers import DynamicCache

    model = models["llama"]
    ids = input_ids(2 * L, seed=11)
    with rope_ext.patched(model, "self_extend", G=4):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
            _decode(model, cache, ids[:, :2])
        assert all(vars(layer)[ROTATED_ATTR] for layer in cache.layers)
        cache.reset()
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)  # a new sequence: the old copies are dropped
        assert not any(vars(layer)[ROTATED_ATTR] for layer in cache.layers)
        with pytest.raises(ValueError, match="padding mask over"):
            model(input_ids=ids[:, :1], past_key_values=cache, attention_mask=torch.ones(1, 5, dtype=torch.long))
        assert all(program.pending is None for program in _programs(model))


def test_families_whose_attention_ignores_the_interface_are_refused_naming_what_works():
    falcon = tiny_model("falcon")
    refused = r"'dca' needs a 'position_rule' hook, which family 'falcon' does not support; methods for falcon: .*yarn"
    with pytest.raises(ValueError, match=refused):
        rope_ext.patch(falcon, "dca")
    assert rope_ext.get_patch(falcon) is None
    moe = tiny_model("qwen2_moe")  # sliding_window=0 means none (use_sliding_window=False)
    ids = input_ids(2 * L)
    with rope_ext.patched(moe, "dca"):
        torch.testing.assert_close(_steps_of(moe, ids), logits(moe, ids)[:, L - 1 : -1], rtol=0, atol=2e-5)


def _steps_of(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=ids[:, :L], past_key_values=cache).logits[:, -1:]
    return torch.cat([first, _decode(model, cache, ids[:, L:-1])], 1)


def test_a_copy_of_a_patched_model_unpatches_apart_from_it():
    """The forward pre-hooks that note the cache come off the copy alone."""
    model = tiny_model("llama")
    ids = input_ids(2 * L)
    base = logits(model, ids)
    rope_ext.patch(model, "dca")
    patched = logits(model, ids)
    clone = copy.deepcopy(model)
    rope_ext.unpatch(clone)
    assert not any(m._forward_pre_hooks for m in clone.modules())
    assert torch.equal(logits(clone, ids), base) and torch.equal(logits(model, ids), patched)
    rope_ext.unpatch(model)
    assert not any(m._forward_pre_hooks for m in model.modules())


# --- patch mechanics ------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_unpatch_restores_attention_implementation_and_logits_bit_exactly(attn):
    model = tiny_model("llama", attn=attn)
    ids = input_ids(3 * L)
    before = logits(model, ids)
    state = copy.deepcopy(model.state_dict())
    rope_ext.patch(model, [{"method": "yarn", "factor": 4}, "dca", "logn"])
    assert model.config._attn_implementation == "rope_ext"
    assert set(model.state_dict()) == set(state)  # hooks are not submodules or buffers
    rope_ext.unpatch(model)
    assert model.config._attn_implementation == attn
    assert not _programs(model) and not any(m._forward_pre_hooks for m in model.modules())
    assert torch.equal(logits(model, ids), before)


def test_two_models_patched_differently_do_not_interfere():
    a, b, c = tiny_model("llama"), tiny_model("llama"), tiny_model("llama")
    ids = input_ids(3 * L)
    rope_ext.patch(a, "rerope")
    rope_ext.patch(b, "self_extend")
    ra, rb, rc = logits(a, ids), logits(b, ids), logits(c, ids)
    with rope_ext.patched(c, "rerope"):
        assert torch.equal(logits(c, ids), ra)
    assert not torch.allclose(ra, rb) and not torch.allclose(ra, rc)
    assert torch.equal(logits(b, ids), rb) and torch.equal(logits(c, ids), rc)


def test_save_and_reload_restore_a_combination(tmp_path):
    model = tiny_model("qwen2")
    ids = input_ids(3 * L)
    rope_ext.patch(model, [{"method": "yarn", "factor": 4}, {"method": "dca", "local_window": 4}])
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path, dtype=torch.float32)
    methods = rope_ext.get_patch(reloaded)
    assert [m.method for m in methods] == ["yarn", "dca"] and methods[1].local_window == 4
    torch.testing.assert_close(logits(reloaded, ids), expected, rtol=0, atol=1e-5)
    rope_ext.unpatch(reloaded)
    assert reloaded.config._attn_implementation != "rope_ext"


def test_get_patch_resolved_shows_the_values_in_use(tmp_path):
    """``get_patch(model, resolved=True)``: options left at ``None`` replaced by what the hooks derived from L (the
    record keeps them as given, so a reload derives them again), through a reload and a peft wrapper too."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen2")
    rope_ext.patch(model, ["yarn:factor=4", "dca:local_window=4", "logn"])
    given = rope_ext.get_patch(model)
    assert [c.original_max_position_embeddings for c in given] == [None, None, None] and given[1].chunk_size is None
    yarn, dca, logn = rope_ext.get_patch(model, resolved=True)
    assert yarn == rope_ext.methods.YarnConfig(factor=4, original_max_position_embeddings=L)
    assert dca == rope_ext.methods.DualChunkConfig(original_max_position_embeddings=L, chunk_size=3 * L // 4, local_window=4)
    assert {term.config for term in _rules(model)} == {dca}
    assert logn == rope_ext.methods.LogNConfig(original_max_position_embeddings=L)
    model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path, dtype=torch.float32)
    assert rope_ext.get_patch(reloaded) == given
    assert rope_ext.get_patch(reloaded, resolved=True) == (yarn, dca, logn)
    wrapped = get_peft_model(reloaded, LoraConfig(r=2, target_modules=["q_proj"]))
    assert rope_ext.get_patch(wrapped, resolved=True) == (yarn, dca, logn)
    with rope_ext.patched(tiny_model("llama"), "pi:factor=2+self_extend", original_max_position_embeddings=32) as other:
        pi, self_extend = rope_ext.get_patch(other, resolved=True)
        assert pi == rope_ext.methods.PIConfig(factor=2)  # pi has no L
        assert (self_extend.original_max_position_embeddings, self_extend.W, self_extend.G) == (32, 4, 8)
    assert rope_ext.get_patch(other, resolved=True) is None
    with pytest.raises(TypeError, match="resolved must be True or False, got 'yes'"):
        rope_ext.get_patch(model, resolved="yes")


def test_get_patch_resolved_leaves_an_l_that_differs_between_layer_types():
    """Gemma 3 layer types with different L (a checkpoint's scaled full layers): no one L to state, so it stays
    ``None``, and patching an identical model with the resolved config gives the same logits."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def make():
        config = Gemma3TextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
        config.rope_parameters["full_attention"] = {
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "original_max_position_embeddings": 32,
        }
        torch.manual_seed(0)
        return Gemma3ForCausalLM(config).eval()

    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    both = {"layer_types": ["full_attention", "sliding_attention"], "replace_scaling": True}
    model = make()
    rope_ext.patch(model, "yarn:factor=4", **both)
    resolved = rope_ext.get_patch(model, resolved=True)
    assert resolved.original_max_position_embeddings is None
    again = make()
    rope_ext.patch(again, resolved, **both)
    assert torch.equal(logits(again, ids), logits(model, ids))
    with rope_ext.patched(make(), "yarn:factor=4", layer_types=["sliding_attention"]) as sliding:
        assert rope_ext.get_patch(sliding, resolved=True).original_max_position_embeddings == 64


def test_peft_wrapped_model_and_bf16_cast():
    """A peft-wrapped patched model gives the patched logits; cast to bfloat16, the fast path lies within twice the
    bfloat16 reference's own distance from the float32 reference (bf16's noise, measured), and that bound is far
    below the method's effect (the unpatched model's distance from the same reference), so a bf16 path that lost the
    method would fail."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama")
    for module in model.modules():  # sharper attention: tiny random models attend almost uniformly, and ReRoPE would
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):  # move their logits by about bf16's noise
            module.scaling *= 16.0
    ids = input_ids(2 * L)
    unpatched = logits(model, ids)
    rope_ext.patch(model, "rerope")
    expected = logits(model, ids)
    with reference():
        exact = logits(model, ids)  # float32 model, attention in float64
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    torch.testing.assert_close(wrapped(input_ids=ids).logits.detach(), expected, rtol=0, atol=1e-5)
    wrapped.to(torch.bfloat16)
    with torch.no_grad():
        out = wrapped(input_ids=ids).logits.float()
        with reference():
            noise = (wrapped(input_ids=ids).logits.float() - exact).abs().max().item()
    bound, effect = 2 * noise, (unpatched - exact).abs().max().item()
    assert 0 < bound < effect / 4, (bound, effect)  # (measured: bound 7e-3, effect 9e-2)
    assert torch.isfinite(out).all()
    error = (out - exact).abs().max().item()
    assert error <= bound, f"bf16 fast path {error:.2e} from the fp32 reference; bf16 reference {noise:.2e}"
    rope_ext.unpatch(wrapped)


def test_gradients_flow_through_the_patched_attention():
    model = tiny_model("llama")
    model.train()
    rope_ext.patch(model, "self_extend", G=4)
    ids = input_ids(2 * L)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item()) and model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("method,options", [("dca", {"chunk_size": 12, "local_window": 4}), ("self_extend", {"W": 6, "G": 2}),
                                            ("string", {"S": 8, "W": 3})])
def test_cached_chunks_with_gradients_on_queries_only_backpropagate(method, options):
    """Keys needing no gradient (LoRA on q/v of a model whose key heads are not repeated) while the queries do:
    no rotated-key copy is kept (autograd holds the keys it multiplied; a kept copy is extended in place by the
    next chunk), and the gradients equal those of one forward over the whole sequence."""
    from transformers import AutoModelForCausalLM, DynamicCache

    config = tiny_config("llama")
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("q_proj" in name)
    rope_ext.patch(model, method, **options)
    ids = input_ids(3 * L)
    cache, total = DynamicCache(config=model.config), 0
    for chunk in ids.split(L, dim=1):
        total = total + model(input_ids=chunk, past_key_values=cache, use_cache=True).logits.square().sum()
    total.backward()
    chunked = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert not any(vars(layer).get(ROTATED_ATTR) for layer in cache.layers)
    model.zero_grad()
    model(input_ids=ids).logits.square().sum().backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(chunked[name], parameter.grad, rtol=1e-4, atol=1e-4)


def test_a_float64_model_is_computed_in_float64():
    """Scores, softmax and merging follow a float64 model (not float32): identity settings give the unpatched
    logits to float64 precision, prefill and decode."""
    model = tiny_model("llama").double()
    ids = input_ids(L - 2)
    before = logits(model, ids)
    with rope_ext.patched(model, "rerope", w=L - 1), torch.no_grad():
        during = logits(model, ids)
        generated = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert during.dtype == torch.float64
    torch.testing.assert_close(during, before, rtol=0, atol=1e-12)
    with torch.no_grad():
        plain = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    torch.testing.assert_close(torch.stack(generated.scores), torch.stack(plain.scores), rtol=0, atol=1e-12)


def test_sliding_layers_sharing_the_rotary_decode_past_their_window():
    """Qwen2 with sliding and full layers and one rotary embedding: the sliding layers are rotated by the hook
    (plain attention) and their cache keeps only the last keys; decoding a left-padded batch past the window
    equals the full forward, and identity settings equal the unpatched model step by step."""
    from transformers import AutoModelForCausalLM, DynamicCache

    config = tiny_config("qwen2")
    config.use_sliding_window, config.sliding_window = True, 24
    config.layer_types = ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = input_ids(40, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def decoded():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :30], attention_mask=mask[:, :30], past_key_values=cache)
            steps = [model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits[:, -1]
                     for t in range(30, 40)]
        assert type(cache.layers[1]).__name__ == "DynamicSlidingWindowLayer" and cache.layers[1].keys.shape[2] < 39
        return torch.stack(steps, 1)

    before = decoded()
    with rope_ext.patched(model, "dca", chunk_size=L, local_window=1):
        torch.testing.assert_close(decoded(), before, rtol=0, atol=1e-5)
    with rope_ext.patched(model, "dca", chunk_size=12, local_window=4):
        with torch.no_grad():
            full = model(input_ids=ids, attention_mask=mask).logits[:, 30:]
        torch.testing.assert_close(decoded()[mask[:, -1] > 0], full[mask[:, -1] > 0], rtol=0, atol=1e-5)


def test_gemma3_sliding_layers_are_left_alone_by_default():
    model = tiny_model("gemma3")
    rope_ext.patch(model, "rerope")
    by_type = {program.layer_type: program for program in _programs(model)}
    assert by_type["full_attention"].position_rule.config.method == "rerope"
    assert not by_type["sliding_attention"].terms  # rotated by the original module: plain attention
    rope_ext.unpatch(model)
    ids = input_ids(20)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=r"\['sliding_attention'\] use sliding-window .* \['full_attention'\]"):
        rope_ext.patch(model, "rerope", layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"full-attention ones: \['full_attention'\]"):
        rope_ext.patch(model, "rerope", layer_types=["sliding_attention"])
    assert torch.equal(logits(model, ids), before)


# --- bad values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,options,message",
    [
        ("rerope", {"w": 0}, "w must be an int >= 1"),
        ("rerope", {"w": L}, "valid: 1..63"),
        ("leaky_rerope", {"k": 0.5}, "k .* >= 1"),
        ("self_extend", {"G": 0}, "G must be an int >= 1"),
        ("self_extend", {"W": 100}, "below the original context"),
        ("string", {"S": 10, "W": 20}, "W=20 must be below S=10"),
        ("string", {"S": 1}, "S must be an int >= 2"),
        ("dca", {"chunk_size": 100}, "exceeds the original context"),
        ("dca", {"local_window": 48}, "local_window=48 must be below chunk_size"),
        ("dca", {"scale_queries": "yes"}, "scale_queries must be True or False"),
        ("dynamic_ntk", {"factor": 2, "cache_consistent": 1}, "cache_consistent must be True or False"),
        ("rerope", {"window": 8}, "unknown option"),
    ],
)
def test_bad_values_raise_with_the_valid_range(method, options, message):
    model = tiny_model("llama")
    ids = input_ids(10)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, method, **options)
    assert rope_ext.get_patch(model) is None and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), before)


def test_derived_options_fit_the_ones_given():
    model = tiny_model("llama")
    rope_ext.patch(model, "dca", chunk_size=4)  # local_window defaults below it
    terms = _rules(model)
    assert terms and all(t.config.local_window == 3 and t.config.chunk_size == 4 for t in terms)
    rope_ext.unpatch(model)


def test_output_attentions_warns_that_no_weights_come_back(caplog):
    model = tiny_model("llama")
    with rope_ext.patched(model, "rerope"):
        with caplog.at_level("WARNING"):
            out = model(input_ids(20), output_attentions=True)
    assert not out.attentions and "does not return attention weights" in caplog.text


def test_two_attention_methods_are_refused_but_logn_combines():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="both 'position_rule' methods"):
        rope_ext.patch(model, ["rerope", "dca"])
    rope_ext.patch(model, ["dca", "logn", {"method": "yarn", "factor": 2}])
    assert [m.method for m in rope_ext.get_patch(model)] == ["yarn", "dca", "logn"]  # frequency, attention, scale
    rope_ext.unpatch(model)


def test_patch_takes_method_specs_as_the_cli_writes_them():
    """``patch(model, ["yarn:factor=4", "dca"])`` (the issue's example), ``"dca:local_window=4+yarn:factor=4"`` and
    a spec plus keyword options build the same configs as dicts; bad specs name what is valid."""
    model = tiny_model("qwen2")
    ids = input_ids(3 * L)
    rope_ext.patch(model, [{"method": "yarn", "factor": 4}, {"method": "dca", "local_window": 4}])
    expected, configs = logits(model, ids), rope_ext.get_patch(model)
    rope_ext.unpatch(model)
    for spec in (["yarn:factor=4", "dca:local_window=4"], "yarn:factor=4+dca:local_window=4", ["yarn:factor=4+dca:local_window=4"]):
        with rope_ext.patched(model, spec):
            assert rope_ext.get_patch(model) == configs
            assert torch.equal(logits(model, ids), expected)
    with rope_ext.patched(model, "dca:local_window=4", chunk_size=12):
        assert rope_ext.get_patch(model) == rope_ext.methods.DualChunkConfig(chunk_size=12, local_window=4)
    # keyword options go to the one method that has them; a combination's configs come frequency first
    for spec, options in [("dca+yarn", {"factor": 4, "local_window": 4}), (["yarn"], {"factor": 4}),
                          (["dca:local_window=4", "yarn:factor=4"], {}), ("yarn:factor=4+dca", {"local_window": 4})]:
        with rope_ext.patched(model, spec, **options):
            assert rope_ext.get_patch(model) == (configs if spec != ["yarn"] else configs[0])
    with rope_ext.patched(model, "logn+dca+yarn", factor=4, original_max_position_embeddings=32):  # a model fact
        assert [c.original_max_position_embeddings for c in rope_ext.get_patch(model)] == [32, 32, 32]
        assert {(term.original, term.config.chunk_size) for term in _rules(model)} == {(32, 24)}  # DCA's L too
    # without a frequency method the attention method states L itself (not the model's, silently)
    stated = {"original_max_position_embeddings": 32}
    for spec, options in [("dca+logn", stated), ("dca:original_max_position_embeddings=32", {})]:
        with rope_ext.patched(model, spec, **options):
            terms = _rules(model)
            assert {(term.original, term.config.original, term.config.chunk_size) for term in terms} == {(L, 32, 24)}
            dca = rope_ext.get_patch(model)
            dca = dca[0] if isinstance(dca, tuple) else dca
            assert dca.original_max_position_embeddings == 32
            i = torch.arange(100.0)  # the query scaling counts from the stated L
            expected = rope_ext.methods.DualChunkConfig().query_scale(i, 32)
            for term in terms:
                assert torch.equal(term.config.query_scale(i, term.original), expected)
    for spec, options, message in [
        ("dca:local_window=4", {"local_window": 5}, "local_window given both"),
        ("yarn:factor=4+alibi", {"factor": 2.0}, r"factor is ambiguous: an option of several of the methods combined "
                                                  r"\(yarn: factor, .*; alibi: .*factor"),
        # (DCA's switch was `mscale` before 0.2: the keyword now goes to YaRN alone, which needs its pair)
        ("yarn:factor=4+dca", {"mscale": 1.0}, "yarn: set both mscale and mscale_all_dim, or neither"),
        ("yarn:factor=4+dca", {"nosuch": 1}, "nosuch is an option of none of the methods combined"),
        ("dca+yarn:factor=4", {"factor": 2}, "factor given both"),
        ([{"method": "yarn", "factor": 2}, "dca"], {"factor": 4}, "factor given both"),
        ("self_extend:G=4,W=16", {}, r"options are separated by ':' \(e.g. self_extend:G=4:W=16\)"),
        ("yarn:factor=4+nosuch", {}, "valid methods: .*dca"),
        ("yarn:factor", {}, "malformed method option"),
        ("rerope+dca", {}, "both 'position_rule' methods"),
    ]:
        with pytest.raises(ValueError, match=message):
            rope_ext.patch(model, spec, **options)
        assert rope_ext.get_patch(model) is None
    with pytest.raises(ValueError, match="combines 2 methods"):
        rope_ext.methods.make_config("yarn:factor=4+dca")


def test_stated_length_is_checked_against_the_model():
    """An attention method's (or logn's) own L above the model config's is refused as a frequency method's is,
    leaving the model as it was; a shared keyword L passes by ``pi`` (which refuses any L); ``string`` needs L >= 3."""
    model = tiny_model("llama")
    ids = input_ids(L + 8)
    before = logits(model, ids)
    too_long = {"original_max_position_embeddings": 4 * L}
    for spec in ("rerope", "leaky_rerope", "self_extend", "string", "dca", "logn", "yarn:factor=2+dca", "dca+logn"):
        with pytest.raises(ValueError, match=rf"original_max_position_embeddings={4 * L} exceeds the model's original "
                                             rf"context {L} \(from its config\); valid: 2..{L}"):
            rope_ext.patch(model, spec, **too_long)
        assert rope_ext.get_patch(model) is None and model.config._attn_implementation == "sdpa"
        assert torch.equal(logits(model, ids), before)
    with rope_ext.patched(model, "pi:factor=2+dca+logn", original_max_position_embeddings=32):
        pi, dca, logn = rope_ext.get_patch(model)
        assert (pi.original_max_position_embeddings, dca.original_max_position_embeddings) == (None, 32)
        assert logn.original_max_position_embeddings == 32
        assert {term.config.chunk_size for term in _rules(model)} == {24}
    with pytest.raises(ValueError, match="pi: original_max_position_embeddings has no effect"):
        rope_ext.patch(model, "pi:factor=2:original_max_position_embeddings=32+dca")
    with pytest.raises(ValueError, match=r"string: S must be 2..the original context L - 1, so the original context L "
                                         r"must be >= 3; got 2"):
        rope_ext.patch(model, "string", original_max_position_embeddings=2)
    assert rope_ext.get_patch(model) is None
    assert torch.equal(logits(model, ids), before)


def test_all_sliding_model_is_refused():
    model = tiny_model("mistral")
    model.config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding-window"):
        rope_ext.patch(model, "rerope")
    assert model.config._attn_implementation == "sdpa"


def _layers(family, layers, **config):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    cfg.num_hidden_layers = layers
    for name, value in config.items():
        setattr(cfg, name, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_layers_without_rope_are_left_alone(small_tiles):
    """SmolLM3 applies no rotary embedding in its ``no_rope_layers`` (NoPE): the attention hook must not rotate
    their queries and keys (a window past the sequence gives the unpatched logits; fast == reference); EXAONE 4's
    hybrid model, NoPE full layers and sliding ones, has no layer for an attention method and says why."""
    model = _layers("smollm3", 4, no_rope_layers=[1, 1, 1, 0], layer_types=["full_attention"] * 4)
    ids = input_ids(2 * L + 9)
    unpatched = logits(model, ids[:, : L - 4])
    with rope_ext.patched(model, "rerope", w=L - 1):  # a window past the sequence
        assert [p.position_rule is None for p in _programs(model)] == [False, False, False, True]
        torch.testing.assert_close(logits(model, ids[:, : L - 4]), unpatched, rtol=0, atol=2e-5)
    with rope_ext.patched(model, "self_extend", G=4, W=8):
        fast = logits(model, ids)
        with reference():
            torch.testing.assert_close(fast, logits(model, ids), rtol=0, atol=2e-5)
    hybrid = _layers("exaone4", 4, sliding_window=32, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    with pytest.raises(ValueError, match=r"exaone4: 1 of its 4 layers use no positional encoding \(NoPE\) and the "
                                         "others sliding-window attention"):
        rope_ext.patch(hybrid, "dca")
    assert rope_ext.get_patch(hybrid) is None
    nope = _layers("smollm3", 2, no_rope_layers=[0, 0], layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match=r"smollm3: all 2 of its layers use no positional encoding \(NoPE\): no layer"):
        rope_ext.patch(nope, "rerope")


def test_static_cache_and_softcapping_are_refused_clearly():
    model = tiny_model("llama")
    rope_ext.patch(model, "rerope")
    with pytest.raises(ValueError, match="static .*cache"):
        model.generate(input_ids(100), max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    ids = input_ids(20)
    with pytest.raises(ValueError, match=r"increasing position_ids >= 0 per row .* Packed sequences"):
        model(input_ids=ids, position_ids=torch.cat([torch.arange(10), torch.arange(10)])[None])
    positions = torch.arange(20)[None]  # checked once per forward, not per layer: an in-place edit is seen
    model(input_ids=ids, position_ids=positions)
    positions[0, 10:] -= 10
    with pytest.raises(ValueError, match="increasing position_ids"):
        model(input_ids=ids, position_ids=positions)
    rope_ext.unpatch(model)
    gemma2 = tiny_model("gemma2")
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        rope_ext.patch(gemma2, "rerope")
    assert rope_ext.get_patch(gemma2) is None


def test_patched_tolerates_a_body_that_unpatches():
    model = tiny_model("llama")
    with rope_ext.patched(model, "dca"):
        rope_ext.unpatch(model)
    assert rope_ext.get_patch(model) is None
