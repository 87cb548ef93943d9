"""The CUDA paths of the attention-rewrite methods: the flash op's window against its mask, regions in one windowed
call, the efficient op (float32), and whole tiny models (fast == reference, padded batches, cached decoding) in
float32 and bfloat16; the additive biases (ALiBi's far blocks and causal squares, KERPLE, Sandwich, FIRE) and T5's
strided relative bias against float64, and training's recorded backward against the reference's gradients. Skipped
without a CUDA device (CI has none); run where one is: ``python -m pytest tests/test_cuda.py``.

``ROPE_EXT_TEST_DEVICE=cpu`` runs the whole-model cases on the CPU instead (their bounds and their separation from
the unpatched model, without the checks of which CUDA op ran): how the bounds were checked before a GPU run."""

from __future__ import annotations

import contextlib
import os

import conformance
import pytest
import torch
from conformance import model_types
from test_attention import FAMILIES, IDS, METHODS, L, _PathSpy, reference
from test_eval import _cli, tiny_checkpoint  # noqa: F401  (the fixture: a tiny Llama saved with a tokenizer)
from tiny import input_ids, tiny_model

import rope_ext
from rope_ext.attention import dispatch, flex, kernels
from rope_ext.families.base import find_family

#: where the whole-model cases run: CUDA, or the CPU to check their bounds (``ROPE_EXT_TEST_DEVICE=cpu``)
CUDA = os.environ.get("ROPE_EXT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
ON_CUDA = CUDA == "cuda"
#: the cases that call the CUDA ops themselves
cuda_ops = pytest.mark.skipif(not ON_CUDA, reason="calls CUDA's attention ops")
#: (n, q0, near, far, key_offset, keys): bands, clipped key ranges (queries that see no key, keys ending before
#: the last query's bound: a right window), a lower region, one query (decode)
REGIONS = [
    (300, 0, 0, 63, 0, 300), (300, 100, 0, 63, 40, 360), (300, 0, 64, None, 0, 236), (97, 0, 0, 9, 0, 40),
    (120, 80, 3, 40, 0, 170), (120, 80, 0, 31, 150, 50), (1, 499, 0, 63, 436, 64), (1, 499, 64, None, 0, 436),
    (200, 0, 0, 0, 0, 200), (256, 0, 0, None, 0, 256),
]


def _masked_softmax(q, k, v, scale, allowed):
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return (torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v), lse


@cuda_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_window_is_the_window_mask(dtype):
    """``aten._flash_attention_forward``'s window sizes select exactly ``window_mask``'s pairs (bottom-right
    alignment, fewer keys than queries, a right window, GQA heads as they are)."""
    torch.manual_seed(0)
    for n, m, left, right in [(300, 300, 63, 0), (300, 700, -1, 0), (97, 40, 0, 9), (120, 170, 20, 17), (1, 64, 63, 0),
                              (200, 200, 0, 0), (64, 500, -1, -1)]:
        q = torch.randn(2, 9, n, 64, device=CUDA, dtype=dtype)
        k, v = torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype), torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype)
        allowed = dispatch.window_mask(n, m, left, right, CUDA)
        seen = allowed.any(-1)
        out, lse = dispatch._flash_cuda(q, k, v, 0.125, left=left, right=right)
        expected, expected_lse = _masked_softmax(q, k, v, 0.125, allowed)
        torch.testing.assert_close(out[:, :, seen].double(), expected[:, :, seen], rtol=0, atol=1e-2)
        torch.testing.assert_close(lse[:, :, seen].double(), expected_lse[:, :, seen], rtol=0, atol=1e-4)


@cuda_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_attention_dispatch_is_exact(dtype):
    """``window_attention`` sends unmasked and square causal windows to cuDNN (Hopper and later, as SDPA does),
    other windows to the flash op: each against its mask."""
    torch.manual_seed(0)
    cases = [(300, 300, -1, 0), (64, 500, -1, -1), (200, 500, -1, 0), (300, 300, 63, 0), (1, 500, -1, 0)]
    for n, m, left, right in cases:
        q = torch.randn(2, 9, n, 64, device=CUDA, dtype=dtype)
        k, v = torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype), torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype)
        out, lse = dispatch.window_attention(q, k, v, 0.125, left, right)
        expected, expected_lse = _masked_softmax(q, k, v, 0.125, dispatch.window_mask(n, m, left, right, CUDA))
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2)
        torch.testing.assert_close(lse.double(), expected_lse, rtol=0, atol=1e-4)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert dispatch._use_cudnn(q, k, v)


@cuda_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("windowed", [None, False], ids=["default", "pieces"])
def test_regions_on_cuda_are_exact(dtype, windowed):
    """Every region as one windowed flash call (half precision, the default there) or as pieces over the flash /
    efficient ops (float32), against one masked softmax in float64 of the same inputs."""
    torch.manual_seed(0)
    atol = 2e-5 if dtype == torch.float32 else 1e-2
    for n, q0, near, far, key_offset, keys in REGIONS:
        q = torch.randn(2, 9, n, 64, device=CUDA, dtype=dtype)
        k = torch.randn(2, 3, keys, 64, device=CUDA, dtype=dtype)
        v = torch.randn(2, 3, keys, 64, device=CUDA, dtype=dtype)
        acc = kernels.Accumulator(torch.zeros(2, 9, n + 2, 64, device=CUDA, dtype=dtype), 64)
        kernels.region(acc, q, k, v, 0.125, q0, near, far, key_offset, 64, out_offset=2, windowed=windowed)
        i = torch.arange(q0, q0 + n, device=CUDA)[:, None]
        j = torch.arange(key_offset, key_offset + keys, device=CUDA)[None]
        allowed = (j <= i - near) & (j >= (i - far if far is not None else -1))
        expected, expected_lse = _masked_softmax(q, k, v, 0.125, allowed)
        torch.testing.assert_close(acc.out[:, :, 2:].double(), expected, rtol=0, atol=atol)
        seen = allowed.any(-1)
        assert torch.isneginf(acc.lse[:, :, 2:][:, :, ~seen]).all()
        torch.testing.assert_close(acc.lse[:, :, 2:][:, :, seen].double(), expected_lse[:, :, seen], rtol=0, atol=1e-4)


@cuda_ops
@pytest.mark.parametrize("backends", ["efficient", "math"])
def test_regions_follow_the_sdpa_backends_switched_on(backends):
    """With SDPA's flash (and cuDNN) backends switched off, half-precision regions run on the efficient op, or
    with it off too on the plain matmul path; each still exact. (Written after the H100 session: not yet run on a
    GPU.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    allowed_backends = {"efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}[backends]
    torch.manual_seed(0)
    with sdpa_kernel(allowed_backends):
        for n, q0, near, far, key_offset, keys in REGIONS:
            q = torch.randn(1, 9, n, 64, device=CUDA, dtype=torch.bfloat16)
            k = torch.randn(1, 3, keys, 64, device=CUDA, dtype=torch.bfloat16)
            v = torch.randn(1, 3, keys, 64, device=CUDA, dtype=torch.bfloat16)
            assert not dispatch.use_cuda_flash(q, k, v)
            acc = kernels.Accumulator(q, 64)
            kernels.region(acc, q, k, v, 0.125, q0, near, far, key_offset, 64)
            i = torch.arange(q0, q0 + n, device=CUDA)[:, None]
            j = torch.arange(key_offset, key_offset + keys, device=CUDA)[None]
            allowed = (j <= i - near) & (j >= (i - far if far is not None else -1))
            expected, _ = _masked_softmax(q, k, v, 0.125, allowed)
            torch.testing.assert_close(acc.out.double(), expected, rtol=0, atol=1e-2)


#: each attention layer's softmax scale multiplied by this, per family: tiny random models attend almost uniformly, so
#: a method moves their logits by about bf16's rounding (5e-3); sharper attention makes it move them well past the
#: bounds below (measured on CPU, bf16: the unpatched logits at least ~2.5x the bound away for every method here).
#: Gemma 3's bf16 noise grows faster than the methods' effect with sharpness, hence its smaller factor.
SHARPEN = {"gemma3": 4.0}


def _sharpened(model, family):
    for module in model.modules():
        if hasattr(module, "scaling") and hasattr(module, "layer_idx"):
            module.scaling *= SHARPEN.get(family, 32.0)
    return model


class _Ops(_PathSpy):
    """Counts of the attention ops the kernels call (``dispatch._efficient_cuda``: the memory-efficient op;
    ``_flash_cuda`` / ``_dense_cuda``: the flash op and cuDNN; ``_matmul_attention``: the plain fallback) and of the
    plain reference (``reference._softmax_out``), which must not run inside ``fast``."""

    def _spy(self, monkeypatch):
        for name in ("_efficient_cuda", "_flash_cuda", "_dense_cuda", "_matmul_attention"):
            monkeypatch.setattr(dispatch, name, self._counting(name, getattr(dispatch, name)))
        fused = flex.distance_biased  # (a bias of the distance: one compiled flex-attention call; None if it failed)
        monkeypatch.setattr(flex, "distance_biased", lambda *args, **kwargs: self._fused(fused(*args, **kwargs)))

    def _fused(self, out):
        if out is not None:
            self.counts["distance_biased"] = self.counts.get("distance_biased", 0) + 1
        return out

    def check(self, dtype, biased: bool = False):
        """The path each dtype takes on CUDA: float32 on the memory-efficient op; bfloat16 on the flash op or cuDNN
        (Ampere or later), else the efficient op (a call with a bias, ``biased``: on the fused flex call or the
        efficient op; decode's one row on the matmul path of ``SingleQuery``); never the plain matmul fallback."""
        if not ON_CUDA:
            return
        seen = self.counts
        assert not seen.get("_matmul_attention"), seen
        if biased:  # (a bias of the distance on the fused call, others on the efficient op)
            assert seen.get("_efficient_cuda", 0) + seen.get("distance_biased", 0) > 0, seen
        elif dtype == torch.float32 or torch.cuda.get_device_capability() < (8, 0):
            assert seen.get("_efficient_cuda", 0) > 0 and not seen.get("_flash_cuda") and not seen.get("_dense_cuda"), seen
        else:
            assert seen.get("_flash_cuda", 0) + seen.get("_dense_cuda", 0) > 0, seen


def _max_distance(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _exact_fast_and_in_dtype(model, ids, method, options, dtype, ops, check):
    """The logits of ``model`` patched with ``method``: exact (the plain reference on a float64 copy), the fast path
    in ``dtype`` (``check()`` then sees which ops it took), the reference in ``dtype``; then unpatched in ``dtype``."""
    with rope_ext.patched(model, method, **(options or {})), torch.no_grad():
        model.double()
        with reference():
            exact = model(input_ids=ids).logits
        model.to(dtype)
        with ops.fast():
            fast = model(input_ids=ids).logits
        check()
        with reference():
            in_dtype = model(input_ids=ids).logits
    with torch.no_grad():
        unpatched = model(input_ids=ids).logits
    return fast, exact, in_dtype, unpatched


def _within_twice_the_reference(fast, exact, in_dtype, unpatched, dtype, record_property=None, times=2) -> None:
    """``fast`` within twice (``times``) the distance of the reference run in ``dtype`` (``in_dtype``) from the
    ``exact`` logits, a bound the ``unpatched`` model lies beyond; the distances recorded when ``record_property`` is
    given."""
    noise = _max_distance(in_dtype, exact)
    bound = times * noise
    error, off = _max_distance(fast, exact), _max_distance(unpatched, exact)
    if record_property is not None:
        record_property("error", error)
        record_property("reference_noise", noise)
    assert 0 < bound < off, f"{dtype}: bound {bound:.2e} does not separate the unpatched model ({off:.2e})"
    assert error <= bound, f"{dtype} fast path {error:.2e} from the exact logits; {dtype} reference {noise:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,options", METHODS, ids=IDS)
def test_fast_path_matches_reference_on_cuda(family, method, options, dtype, monkeypatch):
    """The fast path in ``dtype`` against the exact logits (the plain reference on a float64 copy of the model): within
    twice the distance of the reference run in ``dtype`` (that dtype's own rounding, measured; no constant slack),
    while the unpatched model in ``dtype`` lies beyond that bound (the bound would catch a method not applied). The
    fast path is seen to take the dtype's CUDA kernels (float32: the efficient op) and never the reference."""
    model = _sharpened(tiny_model(family), family).to(CUDA)
    ids = input_ids(3 * L + 7, batch=2).to(CUDA)
    monkeypatch.setattr(kernels, "TILE", 16)
    ops = _Ops(monkeypatch)
    runs = _exact_fast_and_in_dtype(model, ids, method, options, dtype, ops, lambda: ops.check(dtype))
    _within_twice_the_reference(*runs, dtype)


#: the additive biases on a RoPE model (in place of its rotation)
BIASES = [("alibi", {}), ("alibi", {"factor": 2}), ("kerple", {}), ("kerple", {"form": "power"}), ("sandwich", {}),
          ("fire", {})]
BIAS_IDS = ["alibi", "alibi-x2", "kerple", "kerple-power", "sandwich", "fire"]


@pytest.fixture
def small_bias_blocks(monkeypatch):
    """ALiBi's inference path in far blocks of 40 queries and causal squares of 16 (several of each); other biases'
    blocks of 16 queries."""
    from rope_ext.attention import plain

    monkeypatch.setattr(plain, "KEY_BIAS_FAR_BLOCK", 40)
    monkeypatch.setattr(plain, "KEY_BIAS_BLOCK", 16)
    monkeypatch.setattr(kernels, "TILE", 16)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 41)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,options", BIASES, ids=BIAS_IDS)
def test_biases_on_cuda_match_float64(method, options, dtype, small_bias_blocks, monkeypatch, record_property):
    """A bias in ``dtype`` (on CUDA a bias of the distance alone as one compiled flex-attention call, FIRE's blocks on
    the memory-efficient op, which takes the bias in the call's dtype; elsewhere ALiBi's far blocks and causal
    squares, with its key-only form, and the others' blocks) against the exact logits (the plain reference on a float64 copy of the model): within twice the distance of
    the reference run in ``dtype``, a bound the unpatched model lies beyond. The measured distances are recorded
    (``record_property``: the bf16 bias's precision on CUDA against float64)."""
    model = _sharpened(tiny_model("llama"), "llama").to(CUDA)
    ids = input_ids(3 * L + 7, batch=2).to(CUDA)
    ops = _Ops(monkeypatch)

    def check() -> None:
        ops.check(dtype, biased=True)
        if ON_CUDA:  # (the biases of the distance alone on the fused call, compiled; FIRE's on the efficient op)
            assert (ops.counts.get("distance_biased", 0) > 0) == (method != "fire"), ops.counts

    runs = _exact_fast_and_in_dtype(model, ids, method, options, dtype, ops, check)
    _within_twice_the_reference(*runs, dtype, record_property)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,options", METHODS[:6] + BIASES[:1], ids=IDS[:6] + BIAS_IDS[:1])
def test_padded_batch_and_cached_decoding_on_cuda(dtype, method, options, monkeypatch):
    """A left-padded batch row == the row alone, and chunked prefill + decode with the cache == the full forward, in
    both dtypes alike: within twice the noise measured in that dtype (the unpatched model's own padded-vs-alone and
    cached-vs-full distances, and the patched fast path's distance from the plain reference), a bound the method's
    effect on the same logits exceeds; float32 is seen to run on the efficient op."""
    from transformers import DynamicCache

    model = _sharpened(tiny_model("llama"), "llama").to(CUDA, dtype)
    long, short = input_ids(2 * L + 10, seed=3).to(CUDA), input_ids(L + 5, seed=4).to(CUDA)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long, device=CUDA), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0

    def cached(x):
        cache, pieces, start = DynamicCache(config=model.config), [], 0
        for stop in (50, 90, 91, 92, x.shape[1]):
            with torch.no_grad():
                pieces.append(model(input_ids=x[:, start:stop], past_key_values=cache, use_cache=True).logits.float())
            start = stop
        return torch.cat(pieces, 1)

    def full(x, **kwargs):
        with torch.no_grad():
            return model(input_ids=x, **kwargs).logits.float()

    def distances():
        """(padded row vs alone, cached vs full), and the rows alone."""
        batch, alone = full(ids, attention_mask=mask), [full(long), full(short)]
        padded = max(_max_distance(batch[0], alone[0][0]), _max_distance(batch[1, pad:], alone[1][0]))
        return padded, _max_distance(cached(long), alone[0]), alone

    unpatched_padded, unpatched_cached, unpatched_alone = distances()
    ops = _Ops(monkeypatch)
    with rope_ext.patched(model, method, **(options or {})):
        with ops.fast():
            padded, cached_error, alone = distances()
        ops.check(dtype, biased=method == "alibi")
        with reference():
            fast_vs_reference = _max_distance(alone[0], full(long))
    noise = max(unpatched_padded, unpatched_cached, fast_vs_reference)
    bound = 2 * noise
    effect = _max_distance(alone[0], unpatched_alone[0])
    assert 0 < bound < effect, f"{dtype}: bound {bound:.2e} does not separate the unpatched model ({effect:.2e})"
    assert padded <= bound and cached_error <= bound, (padded, cached_error, bound)


@pytest.fixture
def small_relative_blocks(monkeypatch):
    """T5's strided path on every call, in calls of 48 queries and causal squares of 16 (several of each)."""
    from rope_ext.attention import relative

    monkeypatch.setattr(relative, "DENSE_ELEMENTS", 0)
    monkeypatch.setattr(relative, "RELATIVE_BLOCK", 48)
    monkeypatch.setattr(relative, "RELATIVE_SQUARE", 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["t5_bucket_scale:factor=4", "t5_bucket_extend:factor=8"])
def test_t5_relative_bias_on_cuda_matches_float64(spec, dtype, small_relative_blocks, record_property):
    """T5's strided relative bias (encoder, decoder, a right- and a left-padded row) in ``dtype`` against the plain
    reference on a float64 copy: within twice the distance of the reference run in ``dtype``, which the unpatched
    model lies beyond; at identity settings (``factor=1``) the strided path gives transformers' own T5 within the
    same dtype's noise."""
    from test_t5 import forward, reference_forward, tiny_t5

    model = tiny_t5().to(CUDA)
    encoder_ids, decoder_ids = input_ids(150, batch=2).to(CUDA), input_ids(70, batch=2, seed=2).to(CUDA)
    mask = torch.ones(2, 150, dtype=torch.long, device=CUDA)
    mask[0, 120:], mask[1, :25] = 0, 0
    options = dict(attention_mask=mask)
    rope_ext.patch(model, spec)
    if "extend" in spec:  # (a grown table starts as the original's rows: made to matter)
        with torch.no_grad():
            for table in model.rope_ext.t5_bucket_extend.tables:
                table.weight.normal_()
    model.double()
    exact = reference_forward(model, encoder_ids, decoder_ids, **options)
    model.to(dtype)
    fast = forward(model, encoder_ids, decoder_ids, **options)
    in_dtype = reference_forward(model, encoder_ids, decoder_ids, **options)
    rope_ext.unpatch(model, discard_trained=True)
    unpatched = forward(model, encoder_ids, decoder_ids, **options)
    noise = _max_distance(in_dtype, exact)
    error, off = _max_distance(fast, exact), _max_distance(unpatched, exact)
    record_property("error", error)
    record_property("reference_noise", noise)
    assert 0 < 2 * noise < off, f"{dtype}: bound {2 * noise:.2e} does not separate the unpatched model ({off:.2e})"
    assert error <= 2 * noise, f"{dtype} strided path {error:.2e} from the exact logits; {dtype} reference {noise:.2e}"
    with rope_ext.patched(model, "t5_bucket_scale:factor=1"):
        identity = forward(model, encoder_ids, decoder_ids, **options)
    assert _max_distance(identity, unpatched) <= 2 * noise


def _gradients(model, ids, parameters, **kwargs) -> list[torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids, labels=ids, **kwargs).loss.backward()
    return [p.grad.detach().double().clone() for p in parameters]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,options", [("rerope", {}), ("self_extend", {"G": 4}), ("dca", {}), ("alibi", {}),
                                            ("fire", {})], ids=["rerope", "self_extend", "dca", "alibi", "fire"])
def test_training_gradients_on_cuda_match_float64(method, options, dtype, small_bias_blocks, record_property):
    """A training step's recorded calls (``Recorder``: run as inference does, one backward from the merged
    log-sum-exp) in ``dtype`` on the device, with a padded row, against the plain reference's gradients on a float64
    copy: the first and last layers' projections within twice the distance of the reference's in ``dtype``, which
    the unpatched model's gradients lie beyond, and a learnable bias's own gradients (a sum over every scored pair,
    in another order than the reference's) within the larger of that and the worst-case rounding of such a sum
    (pairs x the dtype's epsilon: on the H200 FIRE's fp32 ones came 1.2e-5 from exact, its reference 2e-6)."""
    model = _sharpened(tiny_model("llama"), "llama").to(CUDA)
    model.train()
    ids = input_ids(2 * L + 9, batch=2).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    layers = model.model.layers
    watched = [layers[0].self_attn.q_proj.weight, layers[0].self_attn.k_proj.weight, layers[-1].self_attn.v_proj.weight]
    with rope_ext.patched(model, method, **options):
        learned = [p for p in model.rope_ext.parameters()] if hasattr(model, "rope_ext") else []
        parameters = watched + learned
        model.double()
        with reference():
            exact = _gradients(model, ids, parameters, attention_mask=mask)
        model.to(dtype)
        fast = _gradients(model, ids, parameters, attention_mask=mask)
        with reference():
            in_dtype = _gradients(model, ids, parameters, attention_mask=mask)
    unpatched = _gradients(model, ids, watched, attention_mask=mask)

    def distance(got, want):  # (relative to each gradient's size: they differ by orders between parameters; a
        # gradient that is zero in exact arithmetic, FIRE's last bias (a shift of every score of a row), left out)
        pairs = [(g, w) for g, w in zip(got, want) if w.abs().max() > 1e-9]
        return max(((g - w).abs().max() / w.abs().max()).item() for g, w in pairs) if pairs else 0.0

    assert all(g.abs().sum() > 0 for g in fast[: len(watched)])
    off = distance(unpatched, exact)
    n = ids.shape[1]
    summed = ids.shape[0] * model.config.num_attention_heads * n * (n + 1) // 2  # (the pairs a bias gradient sums)
    for part in (slice(0, len(watched)), slice(len(watched), None)):  # the projections', then the bias's own
        noise, error = distance(in_dtype[part], exact[part]), distance(fast[part], exact[part])
        record_property("error" if part.start == 0 else "bias_error", error)
        record_property("reference_noise" if part.start == 0 else "bias_reference_noise", noise)
        if part.start == 0:  # (a bias's own gradients have no unpatched counterpart)
            assert 0 < 2 * noise < off, f"{dtype}: bound {2 * noise:.2e} does not separate the unpatched model ({off:.2e})"
            bound = 2 * noise
        else:
            bound = max(2 * noise, summed * torch.finfo(dtype).eps)
        assert error <= bound, f"{dtype} recorded gradients {error:.2e} from the exact ones; reference {noise:.2e}"


# --- every RoPE causal LM of transformers (tests/conformance.py) whose attention rope_ext rewrites ------------------


#: found types whose tiny model ReRoPE moves by less than bf16's rounding, sharpened or not (on the CPU: the unpatched
#: model's bf16 distance from the exact logits about half the bf16 reference's, with softmax scales x4, x8 and x32)
#: (PhiMoE: measured on an H200; Gemma 3n's and Gemma 4's tiny models: bf16 noise about 0.5 on the CPU)
BF16_BELOW_ROUNDING = ("flex_olmo", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text",
                       "hrm_text", "jetmoe", "modernbert-decoder", "phimoe")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", model_types())
def test_every_found_family_that_takes_attention_rewrites_runs_them_on_cuda(model_type, dtype, monkeypatch,
                                                                             record_property):
    """ReRoPE on each found family that takes attention rewrites (its own rotation layout, partial rotary, MLA's
    rotary part, hybrids' attention layers) on CUDA in ``dtype``: the fast path within twice the reference's own
    distance from the exact logits (the plain reference on a float64 copy), a bound the unpatched model lies beyond,
    and never the reference inside the fast path. Which CUDA ops ran is recorded (``record_property``)."""
    from test_conformance import CHECKPOINT_REFUSED, NOT_BUILT, POSITION_FREE, RULE_REFUSED

    if model_type in NOT_BUILT or model_type in RULE_REFUSED or model_type in CHECKPOINT_REFUSED:
        pytest.skip(f"{model_type}: not built here, or the checkpoint refuses rewrites (tests/test_conformance.py)")
    if model_type in POSITION_FREE:
        pytest.skip(f"{model_type}: its tiny model's logits do not depend on positions (tests/test_conformance.py)")
    if dtype == torch.bfloat16 and model_type in BF16_BELOW_ROUNDING:
        pytest.skip(f"{model_type}: ReRoPE moves this tiny model's logits less than bf16 rounds them (float32 runs)")
    model = conformance.tiny_model(model_type)
    if "position_rule" not in find_family(model).support(model).kinds:
        pytest.skip(f"{model_type}: takes no attention rewrite (`rope-ext families` says why)")
    with contextlib.suppress(ValueError):  # (MoE experts as plain matmuls: grouped_mm takes no float64)
        model.set_experts_implementation("eager")
    if dtype == torch.bfloat16:  # (float32 separates as the model is: sharpened, its fast path's rounding grows)
        model = _sharpened(model, model_type)
    model = model.to(CUDA)
    ids = torch.randint(3, conformance.VOCAB, (2, 3 * conformance.ORIGINAL + 7),
                        generator=torch.Generator().manual_seed(0)).to(CUDA)
    options = {"w": 32}  # (ReRoPE keeps a checkpoint's own scaling)
    ops = _Ops(monkeypatch)
    runs = _exact_fast_and_in_dtype(model, ids, "rerope", options, dtype, ops, lambda: None)
    record_property("ops", dict(ops.counts))
    # (float32: the fast path's blockwise merge on CUDA rounds up to 2.006x the reference's own distance, Gemma 3's
    # on an H200, where the noise is 2e-7; four times it still lies far from the unpatched model)
    _within_twice_the_reference(*runs, dtype, record_property, times=4 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_rope_ext_eval_runs_on_the_gpu(device, tmp_path, tiny_checkpoint):
    """``--device cuda`` (and ``auto``: accelerate's device map) places the evaluated model there: its patched logits
    equal the CPU's within float32 noise (a relative 1e-4 of their range), and ``rope-ext eval passkey`` runs there,
    the folder recording the device (perplexity's text files need ``datasets``, which the device machine lacks)."""
    import json

    from transformers import AutoModelForCausalLM

    from rope_ext.cli import main
    from rope_ext.runs.devices import placed

    if not ON_CUDA:
        pytest.skip("runs the evaluation on CUDA")
    checkpoint, _ = tiny_checkpoint
    ids = input_ids(3 * L)
    on_cpu = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    on_gpu = placed(AutoModelForCausalLM.from_pretrained(checkpoint).eval(), device)
    assert next(on_gpu.parameters()).device.type == "cuda"
    for model in (on_cpu, on_gpu):
        rope_ext.patch(model, "yarn:factor=4")
    with torch.no_grad():
        expected, got = on_cpu(ids).logits, on_gpu(ids.to(CUDA)).logits.cpu()
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    out = tmp_path / "passkey"
    assert main(["eval", "passkey", "--model", str(checkpoint), "--lengths", "64", "--depths", "0.5", "--trials", "1",
                 "--methods", "none,yarn:factor=2", "--out", str(out), "--device", device, "--no-plot"]) == 0
    assert json.loads((out / "passkey.json").read_text())["run"]["device"] == device
