"""The CUDA paths of the attention-rewrite methods: the flash op's window against its mask, regions in one windowed
call, the efficient op (float32), and whole tiny models (fast == reference, padded batches, cached decoding) in
float32 and bfloat16. Skipped without a CUDA device (CI has none); run where one is:
``python -m pytest tests/test_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from test_attention import FAMILIES, IDS, L, METHODS, reference
from tiny import input_ids, tiny_model

import rope_ext
from rope_ext.attention import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = "cuda"
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_window_is_the_window_mask(dtype):
    """``aten._flash_attention_forward``'s window sizes select exactly ``window_mask``'s pairs (bottom-right
    alignment, fewer keys than queries, a right window, GQA heads as they are)."""
    torch.manual_seed(0)
    for n, m, left, right in [(300, 300, 63, 0), (300, 700, -1, 0), (97, 40, 0, 9), (120, 170, 20, 17), (1, 64, 63, 0),
                              (200, 200, 0, 0), (64, 500, -1, -1)]:
        q = torch.randn(2, 9, n, 64, device=CUDA, dtype=dtype)
        k, v = torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype), torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype)
        allowed = kernels.window_mask(n, m, left, right, CUDA)
        seen = allowed.any(-1)
        out, lse = kernels._flash_cuda(q, k, v, 0.125, left=left, right=right)
        expected, expected_lse = _masked_softmax(q, k, v, 0.125, allowed)
        torch.testing.assert_close(out[:, :, seen].double(), expected[:, :, seen], rtol=0, atol=1e-2)
        torch.testing.assert_close(lse[:, :, seen].double(), expected_lse[:, :, seen], rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_attention_dispatch_is_exact(dtype):
    """``window_attention`` sends unmasked and square causal windows to cuDNN (Hopper and later, as SDPA does),
    other windows to the flash op: each against its mask."""
    torch.manual_seed(0)
    cases = [(300, 300, -1, 0), (64, 500, -1, -1), (200, 500, -1, 0), (300, 300, 63, 0), (1, 500, -1, 0)]
    for n, m, left, right in cases:
        q = torch.randn(2, 9, n, 64, device=CUDA, dtype=dtype)
        k, v = torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype), torch.randn(2, 3, m, 64, device=CUDA, dtype=dtype)
        out, lse = kernels.window_attention(q, k, v, 0.125, left, right)
        expected, expected_lse = _masked_softmax(q, k, v, 0.125, kernels.window_mask(n, m, left, right, CUDA))
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2)
        torch.testing.assert_close(lse.double(), expected_lse, rtol=0, atol=1e-4)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert kernels._use_cudnn(q, k, v)


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
            assert not kernels._use_cuda_flash(q, k, v)
            acc = kernels.Accumulator(q, 64)
            kernels.region(acc, q, k, v, 0.125, q0, near, far, key_offset, 64)
            i = torch.arange(q0, q0 + n, device=CUDA)[:, None]
            j = torch.arange(key_offset, key_offset + keys, device=CUDA)[None]
            allowed = (j <= i - near) & (j >= (i - far if far is not None else -1))
            expected, _ = _masked_softmax(q, k, v, 0.125, allowed)
            torch.testing.assert_close(acc.out.double(), expected, rtol=0, atol=1e-2)


def _noise_bound(model, ids, reference_fp32, **kwargs):
    """How far the reference path in the model's dtype lands from the float32 reference: the dtype's noise."""
    with reference(), torch.no_grad():
        in_dtype = model(input_ids=ids, **kwargs).logits.float()
    return (in_dtype - reference_fp32).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,options", METHODS, ids=IDS)
def test_fast_path_matches_reference_on_cuda(family, method, options, monkeypatch):
    """float32: fast == reference (the efficient op, tiles); bfloat16: the fast path's distance to the float32
    reference is within the dtype's noise (twice the bfloat16 reference's own distance to it, plus 2e-2)."""
    model = tiny_model(family).to(CUDA)
    ids = input_ids(3 * L + 7, batch=2).to(CUDA)
    monkeypatch.setattr(kernels, "TILE", 16)
    with rope_ext.patched(model, method, **(options or {})):
        with torch.no_grad():
            fast = model(input_ids=ids).logits
        with reference(), torch.no_grad():
            expected = model(input_ids=ids).logits
        torch.testing.assert_close(fast, expected, rtol=0, atol=5e-5)
        model.to(torch.bfloat16)
        with torch.no_grad():
            half = model(input_ids=ids).logits.float()
        noise = _noise_bound(model, ids, expected)
    error = (half - expected).abs().max().item()
    assert error <= 2 * noise + 2e-2, f"bf16 fast path {error:.4f} from the fp32 reference; bf16 reference {noise:.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,options", METHODS[:6], ids=IDS[:6])
def test_padded_batch_and_cached_decoding_on_cuda(dtype, method, options):
    """A left-padded batch row == the row alone, and chunked prefill + decode with the cache == the full forward
    (float32 to 5e-5; bfloat16 within twice the unpatched model's own cache-vs-full distance, plus 2e-2)."""
    from transformers import DynamicCache

    model = tiny_model("llama").to(CUDA, dtype)
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

    noise = 0.0 if dtype == torch.float32 else (cached(long) - full(long)).abs().max().item()
    atol = 5e-5 if dtype == torch.float32 else 2 * noise + 2e-2
    with rope_ext.patched(model, method, **(options or {})):
        batch, alone = full(ids, attention_mask=mask), [full(long), full(short)]
        steps = cached(long)
    torch.testing.assert_close(batch[0], alone[0][0], rtol=0, atol=atol)
    torch.testing.assert_close(batch[1, pad:], alone[1][0], rtol=0, atol=atol)
    torch.testing.assert_close(steps, alone[0], rtol=0, atol=atol)
