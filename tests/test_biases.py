"""Additive biases (ALiBi, KERPLE, Sandwich, FIRE), xPos, and GPT-2's learned table read past its rows
(abs_interp, abs_hierarchical, sinusoidal): the formulas against hand-computed values, the blockwise paths against
the plain reference, and the patched models as users run them (GPT-2 and RoPE families built from configs)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, tiny_model

import rope_ext
from rope_ext.attention.program import kernel_override
from rope_ext.attention.reference import program_reference
from rope_ext.methods import make_config
from rope_ext.methods.absolute import sinusoids
from rope_ext.methods.biases import FireBias, KerpleBias, alibi_slopes, distances
from rope_ext.methods.xpos import xpos_zeta

L = ORIGINAL_CONTEXT
BIASES = ["alibi", "alibi:factor=2", "kerple", "kerple:form=power", "sandwich", "fire"]
TABLES = ["abs_interp:factor=4", "abs_hierarchical", "sinusoidal"]


def gpt2(seed: int = 0, positions: int = L):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=positions, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def opt(seed: int = 0, positions: int = L):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    config = OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64, vocab_size=128,
                       word_embed_proj_dim=32, max_position_embeddings=positions, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    return OPTForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "opt": opt, "llama": lambda: tiny_model("llama")}
TABLE_FAMILIES = ["gpt2", "opt"]


# --- formulas, against numbers computed by hand ---------------------------------------------------------------


def test_alibi_slopes_at_8_and_12_heads():
    assert alibi_slopes(8) == [2.0 ** -k for k in range(1, 9)]
    # 12 heads: the 8-head slopes, then every other slope of 16 heads (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5)
    expected = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    assert alibi_slopes(12) == pytest.approx(expected, rel=1e-12)
    assert alibi_slopes(1) == [2.0 ** -8]


@pytest.mark.parametrize("heads", [1, 3, 4, 6, 9, 12, 16, 24, 32])
def test_alibi_slopes_equal_blooms(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, 3)
    alibi = build_alibi_tensor(mask, heads, torch.float64)  # [heads, 1, 3]: slope_h * key position
    torch.testing.assert_close(torch.tensor(alibi_slopes(heads), dtype=torch.float64), alibi[:, 0, 1], rtol=1e-6, atol=0)


def test_alibi_bias_and_its_slope_interpolation():
    i, j = torch.tensor([5.0, 9.0]), torch.tensor([2.0, 5.0, 9.0])
    bias = make_config("alibi").module(8)(i, j)  # [8, 2, 3]
    assert bias.shape == (8, 2, 3)
    assert bias[0].tolist() == [[-1.5, 0.0, -2.0], [-3.5, -2.0, 0.0]]  # slope 1/2: -(1/2)|i - j|
    assert bias[2, 1, 0].item() == pytest.approx(-7 / 8)
    halved = make_config("alibi:factor=2").module(8)(i, j)
    torch.testing.assert_close(halved, bias / 2, rtol=0, atol=0)
    given = make_config("alibi", slopes=[1.0, 0.25]).module(2)(i, j)
    assert given[1, 0, 0].item() == -0.75


def test_alibis_key_only_form_differs_from_the_bias_by_a_constant_per_query():
    """For causal pairs, -m (i - j) = m (j - c) - m (i - c): the kernel adds m (j - c) alone (a per-query constant
    does not change the softmax); the other biases have no such form."""
    module = make_config("alibi").module(8)
    i, j = torch.arange(20.0, 30.0), torch.arange(0.0, 30.0)
    full = module(i, j)  # [8, 10, 30]
    key = module.key_bias(torch.tensor(20.0), j)  # [8, 1, 30]
    assert key.shape == (8, 1, 30)
    difference = (full - key).masked_fill(j[None, None] > i[None, :, None], 0.0)
    expected = -torch.tensor(alibi_slopes(8))[:, None] * (i - 20.0)[None]  # g(i) = -m (i - c)
    torch.testing.assert_close(difference[:, :, :20], expected[:, :, None].expand(8, 10, 20), rtol=0, atol=1e-5)
    from rope_ext.installers.bias import PositionBias

    assert PositionBias(make_config("alibi"), fixed=module).has_key_bias
    assert not PositionBias(make_config("kerple"), owned=object()).has_key_bias
    assert not PositionBias(make_config("sandwich"), fixed=make_config("sandwich").module(8, head_dim=16)).has_key_bias


def test_kerple_log_and_power_at_known_r1_r2():
    i, j = torch.tensor([3.0]), torch.tensor([0.0, 3.0])
    log = KerpleBias("log", torch.tensor([1.5]), torch.tensor([0.5]), eps=1e-2)(i, j)
    assert log[0, 0, 0].item() == pytest.approx(-1.5 * math.log(1 + 0.5 * 3), rel=1e-6)  # -1.3744
    assert log[0, 0, 1].item() == 0.0
    power = KerpleBias("power", torch.tensor([1.5]), torch.tensor([1.5]), eps=1e-2)(i, j)
    assert power[0, 0, 0].item() == pytest.approx(-1.5 * 3 ** 1.5, rel=1e-6)  # -7.7942
    clamped = KerpleBias("power", torch.tensor([1.0]), torch.tensor([3.0]), eps=1e-2)(i, j)
    assert clamped[0, 0, 0].item() == pytest.approx(-(3.0 ** 2), rel=1e-6)  # r2 <= 2
    low = KerpleBias("log", torch.tensor([-1.0]), torch.tensor([0.5]), eps=1e-2)(i, j)
    assert low[0, 0, 0].item() == pytest.approx(-0.01 * math.log(2.5), rel=1e-6)  # r1 >= eps


def test_kerple_clamp_passes_the_gradient_through():
    r1 = torch.nn.Parameter(torch.tensor([-1.0]))
    module = KerpleBias("log", torch.tensor([-1.0]), torch.tensor([0.5]), eps=1e-2)
    module.r1 = r1
    module(torch.tensor([3.0]), torch.tensor([0.0])).sum().backward()
    assert r1.grad.item() == pytest.approx(-math.log(2.5), rel=1e-6)


def test_sandwich_at_hand_computed_points():
    """NeMo's formula by hand: (sum_{k=1..d'/2} cos(d / 10000^(2k/d')) - d'/2) / (8 h / H)."""
    i = torch.tensor([0.0, 1.0, 10.0, 100.0])
    bias = make_config("sandwich").module(8, head_dim=64)(i, torch.tensor([0.0]))  # [8, 4, 1]
    assert bias[0, :, 0].tolist() == pytest.approx([0.0, -0.623471, -9.109300, -13.987700], abs=2e-6)
    assert bias[7, 2, 0].item() == pytest.approx(-1.138663, abs=2e-6)
    wider = make_config("sandwich:dim=128").module(12, head_dim=64)(i[1:2], torch.tensor([0.0]))
    assert wider[0, 0, 0].item() == pytest.approx(-2.169928, abs=2e-6)


def test_fire_bias_at_hand_computed_points():
    generator = torch.Generator().manual_seed(0)
    fire = FireBias(heads=1, width=1, c=0.1, threshold=512.0, eps=1e-6, generator=generator)
    with torch.no_grad():  # f = relu: the bias is the normalised distance itself
        fire.mlp[0].weight.fill_(1.0)
        fire.mlp[0].bias.zero_()
        fire.mlp[2].weight.fill_(1.0)
        fire.mlp[2].bias.zero_()
    near = fire(torch.tensor([10.0]), torch.tensor([5.0]))[0, 0, 0].item()
    assert near == pytest.approx(math.log(1 + 0.1 * 5) / (math.log(1 + 0.1 * 512) + 1e-6), rel=1e-5)  # 0.10252
    far = fire(torch.tensor([1000.0]), torch.tensor([0.0]))[0, 0, 0].item()
    assert far == pytest.approx(math.log(1 + 100) / (math.log(1 + 100) + 1e-6), rel=1e-5)  # max(i, L) = i
    assert fire(torch.tensor([7.0]), torch.tensor([7.0]))[0, 0, 0].item() == 0.0


def test_sinusoids_and_the_table_methods_at_hand_computed_points():
    assert sinusoids(torch.tensor([0]), 4).tolist() == [[0.0, 1.0, 0.0, 1.0]]
    expected = [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)]  # 10000^(2/4) = 100
    assert sinusoids(torch.tensor([1]), 4)[0].tolist() == pytest.approx(expected, rel=1e-6)
    table = torch.tensor([[0.0], [10.0], [30.0]])
    interp = make_config("abs_interp:factor=2")
    assert interp.embed(table, torch.tensor([0, 1, 2, 3, 4])).flatten().tolist() == [0.0, 5.0, 10.0, 20.0, 30.0]
    with pytest.raises(ValueError, match="position 5 is past the 5 positions"):
        interp.embed(table, torch.tensor([5]))
    hierarchical = make_config("abs_hierarchical")  # alpha 0.4: u = (p - 0.4 p0) / 0.6
    table = torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.float64)
    u = [1.0, (2 - 0.4) / 0.6, (4 - 0.4) / 0.6]
    got = hierarchical.embed(table, torch.tensor([0, 1, 2, 4, 5, 7, 8])).flatten().tolist()
    assert got == pytest.approx([1.0, 2.0, 4.0, u[1], 0.4 * u[1] + 0.6 * u[2], 0.4 * u[2] + 0.6 * u[1], u[2]], rel=1e-12)
    with pytest.raises(ValueError, match="position 9 is past the 9 positions"):
        hierarchical.embed(table, torch.tensor([9]))


def test_distances_are_absolute():
    assert distances(torch.tensor([2.0]), torch.tensor([0.0, 5.0])).tolist() == [[2.0, 3.0]]


# --- patched models ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
@pytest.mark.parametrize("method", BIASES)
def test_blockwise_bias_equals_the_plain_reference_with_padding_and_jumps(family, method, monkeypatch):
    from rope_ext.attention import kernels, plain

    monkeypatch.setattr(kernels, "TILE", 16)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 41)
    monkeypatch.setattr(plain, "KEY_BIAS_FAR_BLOCK", 40)  # (ALiBi's inference path: far blocks, squares of 16)
    monkeypatch.setattr(plain, "KEY_BIAS_BLOCK", 16)
    model = MODELS[family]()
    ids = input_ids(3 * L, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    jumps = torch.cat([torch.arange(50), torch.arange(50, 3 * L) + 300])[None]  # (PoSE-like ids)
    base = logits(model, ids[:, :L])
    with rope_ext.patched(model, method):
        runs = [{}, {"attention_mask": mask}, {"position_ids": jumps}]
        fast = [logits(model, ids, **kwargs) for kwargs in runs]
        with kernel_override(program_reference):
            reference = [logits(model, ids, **kwargs) for kwargs in runs]
        assert (fast[0][:, :L] - base).abs().max() > 1e-3  # the bias replaced the positions
    for got, expected in zip(fast, reference):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    assert torch.equal(logits(model, ids[:, :L]), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibis_blockwise_path_is_as_precise_as_the_materialised_bias(dtype):
    """The key-only form adds ``m (j - c)``: a value that grows with the distance to ``c`` and, near a row's largest
    scores, loses digits (bf16 keeps 8 bits: at ``c`` 256 queries back the old path's error was 1.76). Against
    float64, the inference path's error stays within the materialised bias's own through SDPA in the same dtype,
    over several far blocks and squares; so does the training path's (256-query blocks, ``c`` their first: the
    flash op takes the bias in float32 whatever the call's dtype, where a bf16 bias lost a whole unit, error 1.45)."""
    import torch.nn.functional as F

    from rope_ext.attention import plain
    from rope_ext.attention.program import AttentionProgram, Call
    from rope_ext.installers.bias import PositionBias

    torch.manual_seed(0)
    heads, n, d = 9, 2500, 64
    module = make_config("alibi").module(heads)
    program = AttentionProgram(terms=[PositionBias(make_config("alibi"), fixed=module)])
    q, k, v = ((torch.randn(1, heads, n, d) * 2).to(dtype) for _ in range(3))
    scale = d**-0.5
    positions = torch.arange(n, dtype=torch.float32)
    later = torch.ones(n, n, dtype=torch.bool).triu(1)
    bias = (-torch.tensor(alibi_slopes(heads), dtype=torch.float64)[:, None, None]
            * (positions[:, None] - positions[None]).double()).masked_fill(later, float("-inf"))  # [h, n, n]
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale + bias
    exact = torch.softmax(scores, -1) @ v.double()
    materialised = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(dtype), scale=scale)
    bound = 1.1 * (materialised.double() - exact).abs().max()
    blockwise = plain.run_plain(Call(program, q, k, v, scale))
    assert (blockwise.double() - exact).abs().max() <= bound
    recorded = plain.run_plain(Call(program, q.clone().requires_grad_(), k, v, scale))  # (training: 256-query blocks)
    # (float32: values up to m x 256 near the diagonal cost about twice the materialised error, 3.4e-5 against 1.8e-5)
    assert (recorded.detach().double() - exact).abs().max() <= bound * (2 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("method", ["alibi", "sandwich", "fire"])
def test_the_benchmarks_materialised_bias_equals_the_blockwise_path(method):
    from rope_ext.attention.reference import materialised_bias_kernel

    model = gpt2()
    ids = input_ids(3 * L, batch=2)
    with rope_ext.patched(model, method):
        fast = logits(model, ids)
        with kernel_override(materialised_bias_kernel):
            whole = logits(model, ids)
            with pytest.raises(ValueError, match="materialised_bias_kernel runs bias terms alone on unpadded rows"):
                model(ids, attention_mask=torch.ones_like(ids).index_fill(1, torch.tensor([0]), 0))
    torch.testing.assert_close(fast, whole, rtol=0, atol=2e-5)


@pytest.mark.parametrize(("family", "method"), [("gpt2", m) for m in BIASES[:1] + BIASES[2:] + TABLES]
                         + [("opt", m) for m in ["alibi", "fire", *TABLES]]
                         + [("llama", m) for m in BIASES[:1] + BIASES[2:]])
def test_patch_unpatch_is_bit_exact_and_cached_generation_equals_the_full_forward(family, method):
    model = MODELS[family]()
    prompt = input_ids(L - 10)  # (GPT-2 unpatched reads its table up to L; the generation crosses it)
    base = logits(model, prompt)
    with rope_ext.patched(model, method):
        out = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = logits(model, out.sequences)
    steps = torch.stack(out.logits, 1)
    torch.testing.assert_close(steps, full[:, prompt.shape[1] - 1 : -1], rtol=0, atol=5e-5)
    assert torch.equal(logits(model, prompt), base)


@pytest.mark.parametrize("family", TABLE_FAMILIES)
@pytest.mark.parametrize("method", ["alibi", "fire", "abs_interp:factor=4"])
def test_a_left_padded_row_equals_the_row_alone(family, method):
    model = MODELS[family]()
    long, short = input_ids(2 * L + 10, seed=8), input_ids(L + 20, seed=9)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                   return_dict_in_generate=True)
    with rope_ext.patched(model, method):
        batch = torch.stack(model.generate(ids, attention_mask=mask, **options).logits, 1)
        alone = [torch.stack(model.generate(row, **options).logits, 1) for row in (long, short)]
    torch.testing.assert_close(batch, torch.cat(alone), rtol=0, atol=5e-5)


@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_a_learned_table_runs_past_its_rows_only_once_patched(family):
    model = MODELS[family]()
    ids = input_ids(4 * L - 8)  # (abs_interp:factor=4 reaches 4 x 63 + 1 = 253 positions)
    with pytest.raises(IndexError):
        model(ids)
    for method in [*BIASES, *TABLES]:
        with rope_ext.patched(model, method):
            assert torch.isfinite(logits(model, ids)).all()
    with rope_ext.patched(model, "abs_interp:factor=2"):  # reaches 2 x 63 + 1 = 127 positions
        with pytest.raises(ValueError, match="abs_interp: position 247 is past the 127 positions"):
            model(ids)


@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_identity_settings_give_the_original_model(family):
    model = MODELS[family]()
    ids = input_ids(L, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # (OPT reads its row 1 at padding)
    base = [logits(model, ids), logits(model, ids, attention_mask=mask)]
    for method in ("abs_interp:factor=1", "abs_hierarchical"):
        with rope_ext.patched(model, method):  # the first rows are the table's own
            assert torch.equal(logits(model, ids), base[0])
            assert torch.equal(logits(model, ids, attention_mask=mask), base[1])
    table = model.transformer.wpe.weight if family == "gpt2" else model.model.decoder.embed_positions.weight
    assert table.shape == ((L if family == "gpt2" else L + 2), 32)


@pytest.mark.parametrize(("family", "method"), [(f, m) for f in ("gpt2", "llama") for m in ("kerple", "fire")]
                         + [("opt", "kerple")])
def test_learnable_biases_train_save_and_reload(family, method, tmp_path):
    model = MODELS[family]()
    ids = input_ids(2 * L)
    rope_ext.patch(model, method)
    owned = {name: p for name, p in model.named_parameters() if name.startswith("rope_ext.")}
    assert owned and any(name.startswith(f"rope_ext.{method}.layers.1.") for name in owned)
    trainable = [p for p in owned.values() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
        optimizer.step()
        optimizer.zero_grad()
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    torch.testing.assert_close(logits(restored, ids), expected, rtol=0, atol=0)
    if family == "gpt2":
        assert restored.transformer.wpe.weight.shape == (L, 32)  # the table keeps its key and shape


@pytest.mark.parametrize("method", ["kerple", "fire"])
def test_a_learnable_bias_alone_trains_on_a_frozen_model_with_the_references_gradients(method):
    """Only the bias's parameters need gradients (the model frozen): the blockwise kernel records its calls for
    them too (the flash op has no derivative for its mask), and their gradients equal the plain formula's, on
    plain and padded rows."""
    model = gpt2()
    rope_ext.patch(model, method)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("rope_ext."))
    ids = input_ids(2 * L, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    grads = []
    for override in (contextlib.nullcontext(), kernel_override(program_reference)):
        with override:
            model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    fast, reference = grads
    assert fast.keys() == reference.keys() and all(name.startswith("rope_ext.") for name in fast) and fast
    for name in fast:  # (relative to the largest entry; some are ~0 by symmetry)
        error, scale = (fast[name] - reference[name]).abs().max().item(), reference[name].abs().max().item()
        assert error <= 1e-4 * scale + 1e-8, f"{name}: {error:.2e} off, its largest gradient {scale:.2e}"


def test_two_patches_with_one_seed_start_from_the_same_parameters():
    first, second = gpt2(), gpt2()
    rope_ext.patch(first, "fire")
    rope_ext.patch(second, "fire")
    for (name, a), (_, b) in zip(first.rope_ext.named_parameters(), second.rope_ext.named_parameters()):
        assert torch.equal(a, b), name
    third = rope_ext.patch(gpt2(), "fire:seed=1")
    assert not torch.equal(third.rope_ext.fire.layers[0].mlp[0].weight, first.rope_ext.fire.layers[0].mlp[0].weight)


def test_a_table_method_saves_and_reloads_with_the_table_unchanged(tmp_path):
    model = gpt2()
    ids = input_ids(3 * L)
    rope_ext.patch(model, "abs_hierarchical:alpha=0.3")
    expected = logits(model, ids)
    assert "transformer.wpe.weight" in model.state_dict()
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert restored.config.n_positions == L
    torch.testing.assert_close(logits(restored, ids), expected, rtol=0, atol=0)


# --- xPos ---------------------------------------------------------------------------------------------------------


def test_xpos_zeta_and_factors_by_hand():
    # (2i + 0.4 r) / (1.4 r) for r = 8: 3.2/11.2, 5.2/11.2, 7.2/11.2, 9.2/11.2
    assert xpos_zeta(8).tolist() == pytest.approx([0.2857142857, 0.4642857143, 0.6428571429, 0.8214285714], rel=1e-9)
    factors = make_config("xpos").factors(torch.tensor([512.0, -1024.0]), 8)
    assert factors[0].tolist() == pytest.approx(xpos_zeta(8).tolist(), rel=1e-6)
    assert factors[1, 0].item() == pytest.approx((11.2 / 3.2) ** 2, rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gemma3"])
@pytest.mark.parametrize("method", ["xpos:scale_base=32", "xpos:scale_base=16+yarn:factor=4"])
def test_xpos_fast_path_equals_the_relative_reference(family, method, monkeypatch):
    """The fast path scales per query block (absolute offsets); the reference multiplies each pair's score by
    zeta^((i - j)/B) in float64: they share no offset arithmetic."""
    from rope_ext.attention import kernels

    monkeypatch.setattr(kernels, "TILE", 16)
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 41)
    model = tiny_model(family)
    ids = input_ids(3 * L, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    jumps = torch.cat([torch.arange(50), torch.arange(50, 3 * L) + 300])[None]
    base = logits(model, ids)
    with rope_ext.patched(model, method):
        runs = [{}, {"attention_mask": mask}, {"position_ids": jumps}]
        fast = [logits(model, ids, **kwargs) for kwargs in runs]
        with kernel_override(program_reference):
            reference = [logits(model, ids, **kwargs) for kwargs in runs]
        assert (fast[0] - base).abs().max() > 1e-3
    for got, expected in zip(fast, reference):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    assert torch.equal(logits(model, ids), base)


def test_xpos_stays_finite_where_absolute_factors_overflow(monkeypatch):
    """scale_base 4 at 640 tokens: zeta_0^(-j/B) = 3.5^160 is past float32's range; per block it never is, even when
    the kernel's own block is the whole sequence (as on CUDA): xPos caps it (safe_block)."""
    from rope_ext.attention import kernels

    monkeypatch.setattr(kernels, "QUERY_BLOCK", 10**6)
    assert make_config("xpos:scale_base=4").safe_block(16) == int(8 * 4 / math.log(1.4 / 0.4))  # 25
    assert not math.isfinite(torch.tensor(3.5, dtype=torch.float32).pow(160).item())
    model = tiny_model("llama")
    ids = input_ids(10 * L)
    with rope_ext.patched(model, "xpos:scale_base=4"):
        fast = logits(model, ids)
        with kernel_override(program_reference):
            reference = logits(model, ids)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)


def test_xpos_cached_generation_equals_the_full_forward():
    model = tiny_model("llama")
    prompt = input_ids(L + 20)
    base = logits(model, prompt)
    with rope_ext.patched(model, "xpos:scale_base=64"):
        out = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = logits(model, out.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, prompt.shape[1] - 1 : -1], rtol=0, atol=5e-5)
    assert torch.equal(logits(model, prompt), base)


# --- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("alibi:factor=0.5", r"alibi: factor must be a number >= 1 and <= 1e6 \(.*\), got 0.5; a factor below 1 would steepen"),
        ("alibi:slopes=[0.5,-0.1]", r"alibi: every slope must be a finite number in \(0.0, inf\)"),
        ("kerple:form=cubic", "kerple: form must be one of log, power"),
        ("fire:width=0", "fire: width must be an int >= 1"),
        ("sandwich:dim=7", "sandwich: dim must be an even int >= 2"),
        ("abs_interp:factor=0.5", "abs_interp: factor must be a number >= 1"),
        ("abs_hierarchical:alpha=1", r"abs_hierarchical: alpha must be a number in \(0, 1\)"),
        ("sinusoidal:scale=-1", "sinusoidal: scale must be a finite number > 0"),
        ("xpos:gamma=0", "xpos: gamma must be a finite number > 0"),
    ],
)
def test_bad_values_are_refused_naming_the_valid_range(spec, message):
    with pytest.raises(ValueError, match=message):
        make_config(spec)


@pytest.mark.parametrize(
    ("family", "methods", "message"),
    [
        ("gpt2", "yarn:factor=4", r"method 'yarn' needs a 'frequency' hook, which family 'gpt2' does not support; "
                                  r"methods for gpt2: abs_hierarchical, abs_interp, alibi, fire, kerple, s2_attn, sandwich, sinusoidal$"),
        ("llama", "abs_interp", "method 'abs_interp' needs an 'absolute' hook, which family 'llama' does not support"),
        ("llama", "alibi+yarn:factor=4", r"alibi cannot be combined with yarn \('frequency' methods: .*yarn\): alibi "
                                         r"replaces the model's position encoding, and yarn is a position encoding itself; "
                                         r"alibi combines with 'query_scale' methods \(logn, temperature\)$"),
        ("llama", "alibi+dca", r"alibi cannot be combined with dca \('position_rule' methods: dca, "),
        ("gpt2", "alibi+abs_interp", r"alibi cannot be combined with abs_interp \('absolute' methods: .*combines with "
                                     r"nothing on this model$"),
        ("gpt2", "alibi:slopes=[0.5,0.25]", "alibi: 2 slopes given for a model with 4 attention heads"),
        ("llama", "xpos+dca", r"xpos cannot be combined with dca \('position_rule' methods: .*\): xpos scales plain RoPE, "
                              r"and dca remaps the positions; xpos combines with 'frequency' methods \(.*\) and "
                              r"'query_scale' methods \(logn, temperature\)$"),
        ("llama", "xpos+alibi", r"alibi cannot be combined with xpos \('pair_scale' methods: xpos\)"),
        ("gpt2", "xpos", "method 'xpos' needs a 'pair_scale' hook, which family 'gpt2' does not support"),
        # a method that cannot fit is refused as such, before its missing options
        ("gpt2", "yarn", "method 'yarn' needs a 'frequency' hook, which family 'gpt2' does not support"),
        ("opt", "alibi+longrope", "method 'longrope' needs a 'frequency' hook, which family 'opt' does not support"),
    ],
)
def test_methods_that_do_not_fit_are_refused_and_the_model_untouched(family, methods, message):
    model = MODELS[family]()
    ids = input_ids(L)
    base = logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, methods)
    assert rope_ext.get_patch(model) is None
    assert torch.equal(logits(model, ids), base)
    assert model.state_dict().keys() == state.keys()


def test_evaluation_leaves_out_lengths_past_the_table_naming_what_reaches_them():
    from rope_ext.eval.run import check_methods
    from rope_ext.methods import make_configs

    model = gpt2()
    methods = {"none": [], "abs_interp:factor=2": list(make_configs("abs_interp:factor=2")), "alibi": [make_config("alibi")]}
    assert check_methods(model, {"none": []}, lengths=[L]) == {}
    with pytest.raises(ValueError, match=r"method 'none': this model's learned position table reaches 64 positions, "
                                         r"and the shortest length asked is 128; read it further with abs_interp"):
        check_methods(model, methods, lengths=[2 * L])
    with pytest.raises(ValueError, match=r"reaches 64 positions, and the shortest length asked is 65;"):
        check_methods(model, {"none": []}, lengths=[L + 1])  # (one past the table: refused)
    # a method short of the longest length but reaching the shortest: its longer lengths are left out of the run
    assert check_methods(model, methods, lengths=[L, 2 * L]) == {"none": L, "abs_interp:factor=2": 2 * L - 1}
    assert check_methods(model, {k: v for k, v in methods.items() if k != "none"}, lengths=[2 * L - 1]) == {}
    with pytest.raises(ValueError, match="method 'abs_interp:factor=2': .* reaches 127 positions"):
        check_methods(model, {"abs_interp:factor=2": methods["abs_interp:factor=2"]}, lengths=[200])
    assert check_methods(model, {"alibi": methods["alibi"]}, lengths=[10 ** 6]) == {}


# --- what a new user's trial found ----------------------------------------------------------------------------------


def test_a_learned_bias_patched_after_peft_wrapping_is_refused():
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(gpt2(), LoraConfig(r=2, target_modules=["c_attn"]))
    with pytest.raises(ValueError, match=r"kerple brings parameters of its own, and this model is wrapped \(PeftModel\).*"
                                         r"Patch the model before wrapping it, and list 'rope_ext'"):
        rope_ext.patch(wrapped, "kerple")
    assert rope_ext.get_patch(wrapped) is None and not hasattr(wrapped.get_base_model(), "rope_ext")
    rope_ext.patch(wrapped, "alibi")  # (no parameters: nothing to lose)


def test_fires_threshold_stays_fixed_under_peft_modules_to_save():
    from peft import LoraConfig, get_peft_model

    model = rope_ext.patch(gpt2(), "fire")
    assert "rope_ext.fire.layers.0.threshold" in model.state_dict()
    assert not any(name.endswith("threshold") for name, _ in model.named_parameters())
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["rope_ext"]))
    assert not any(name.endswith("threshold") and p.requires_grad for name, p in wrapped.named_parameters())


def test_sandwich_takes_the_head_dimension_of_a_family_without_head_dim():
    model = tiny_model("gpt_neox")
    ids = input_ids(2 * L)
    base = logits(model, ids)
    with rope_ext.patched(model, "sandwich"):
        assert torch.isfinite(logits(model, ids)).all()
    assert torch.equal(logits(model, ids), base)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_is_not_training(dtype):
    model = rope_ext.patch(gpt2(), "kerple")
    model.to(dtype)
    rope_ext.unpatch(model)  # (no "trained since patching": the values are the initial ones, rounded)
    assert not hasattr(model, "rope_ext")


def test_biased_calls_flush_denormals_inside_and_restore_the_thread_setting(monkeypatch):
    from rope_ext.attention import dispatch

    cpu = torch.device("cpu")
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    assert not dispatch._flushing_denormals()
    with dispatch.flushed_denormals(cpu):
        assert dispatch._flushing_denormals()
    assert not dispatch._flushing_denormals()
    torch.set_flush_denormal(True)  # a caller's own setting is kept
    try:
        with dispatch.flushed_denormals(cpu):
            assert dispatch._flushing_denormals()
        assert dispatch._flushing_denormals()
    finally:
        torch.set_flush_denormal(False)
    seen = []
    attention = dispatch.lse_attention

    def spy(*args, **kwargs):
        seen.append(dispatch._flushing_denormals())
        return attention(*args, **kwargs)

    monkeypatch.setattr(dispatch, "lse_attention", spy)
    model = rope_ext.patch(tiny_model("llama"), "alibi")
    logits(model, input_ids(L))
    assert seen and all(seen) and not dispatch._flushing_denormals()


def test_a_gpt2_with_cross_attention_is_refused_and_untouched():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=L,
                                       add_cross_attention=True))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^gpt2: a GPT-2 with cross-attention \(add_cross_attention=True\) is not "):
        rope_ext.patch(model, "alibi")
    assert rope_ext.get_patch(model) is None
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# --- a bias of the distance as one fused call (rope_ext.attention.flex; CUDA's path, run here uncompiled) ---------


@pytest.fixture
def fused_here(monkeypatch):
    """The fused path on the CPU: flex attention's eager implementation, counted."""
    import warnings

    from rope_ext.attention import flex

    monkeypatch.setattr(flex, "COMPILE", False)
    monkeypatch.setattr(flex, "available", lambda q, k, v: True)
    calls = []
    original = flex.distance_biased
    monkeypatch.setattr(flex, "FAILED", set())
    def counted(q, k, v, scale, table=None, form=None):
        calls.append((q.shape, form[0] if form is not None else "table"))
        return original(q, k, v, scale, table, form)

    monkeypatch.setattr(flex, "distance_biased", counted)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield calls


@pytest.mark.parametrize("method", ["alibi", "alibi:factor=2", "kerple", "kerple:form=power", "sandwich", "fire"])
def test_a_bias_of_the_distance_runs_as_one_fused_call_equal_to_the_reference(fused_here, method):
    """On CUDA a bias of the distance alone (ALiBi, KERPLE, Sandwich) is one flex-attention call a layer with the
    bias read from a table by distance: here, uncompiled, against the plain reference on a padded batch and on a
    prefill in chunks over the cache (queries the last keys: the causal offset); cached decoding (one query) keeps
    the blockwise path, and FIRE (its bias depends on the query's position too) never takes the fused one."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = input_ids(3 * L, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    with rope_ext.patched(model, method):
        fast = [logits(model, ids), logits(model, ids, attention_mask=mask)]
        cache, pieces = DynamicCache(config=model.config), []
        for chunk in ids[:, :L + 5].split(L // 2, dim=1):
            pieces.append(logits(model, chunk, past_key_values=cache, use_cache=True))
        with kernel_override(program_reference):
            expected = [logits(model, ids), logits(model, ids, attention_mask=mask), logits(model, ids[:, :L + 5])]
    for got, want in zip([*fast, torch.cat(pieces, 1)], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    layers = model.config.num_hidden_layers
    if method == "fire":
        assert fused_here == []
    else:  # (every layer: the whole batch, each padded row alone, then each chunk; the one-token chunk is decode)
        chunks = [c for c in range(0, L + 5, L // 2) if min(L + 5, c + L // 2) - c > 1]
        assert len(fused_here) == layers * (1 + 2 + len(chunks))
        # ALiBi's bias computed from the distance in the kernel, the others' read from their table
        assert {form for _, form in fused_here} == {"linear" if method.startswith("alibi") else "table"}


@pytest.mark.parametrize(("method", "form"), [("alibi", "linear"), ("alibi:factor=2", "linear")])
def test_a_closed_form_in_the_fused_call_gives_its_table_exactly(fused_here, monkeypatch, method, form):
    """ALiBi's ``-s_h (i - j)`` computed in the kernel is the table's float32 value at every distance: the logits are
    the same bits either way (``flex.CLOSED_FORMS`` off: the table), uncompiled here (a compiled kernel may fuse the
    multiply and subtract: one rounding less)."""
    from rope_ext.attention import flex

    model = tiny_model("llama")
    ids = input_ids(3 * L, batch=2)
    with rope_ext.patched(model, method):
        by_form = logits(model, ids)
        monkeypatch.setattr(flex, "CLOSED_FORMS", False)
        by_table = logits(model, ids)
    half = len(fused_here) // 2
    assert half > 0 and [f for _, f in fused_here] == [form] * half + ["table"] * half
    assert torch.equal(by_form, by_table)


def test_a_failed_compile_sends_that_dtype_and_head_size_to_the_blockwise_path_with_one_warning(monkeypatch):
    """A compile that fails returns ``None`` (the caller's blockwise path runs) and is remembered for its dtype and
    head size and form alone: the table's form is still tried after the slopes' failed, each compiled once."""
    from rope_ext.attention import flex

    compiles = []

    def broken(*args, **kwargs):
        compiles.append(kwargs["score_mod"])
        raise RuntimeError("no valid triton configs")

    monkeypatch.setattr(flex, "FAILED", set())
    monkeypatch.setattr(flex, "_compiled", lambda: broken)
    q = torch.randn(1, 2, 5, 16)
    with pytest.warns(RuntimeWarning, match=r"failed here \(RuntimeError: no valid triton configs\); biases in "
                                            r"float32 with head size 16 \(read from its linear form\) run another way "
                                            r"from now on"):
        assert flex.distance_biased(q, q, q, 0.25, form=("linear", torch.ones(2), None)) is None
    assert flex.FAILED == {(torch.float32, 16, "linear")}
    assert flex.distance_biased(q, q, q, 0.25, form=("linear", torch.ones(2), None)) is None  # (remembered)
    assert len(compiles) == 1
    with pytest.warns(RuntimeWarning, match=r"\(read from a table\)"):  # (the table's form is still tried)
        assert flex.distance_biased(q, q, q, 0.25, table=torch.zeros(2, 5)) is None
    assert flex.FAILED == {(torch.float32, 16, "linear"), (torch.float32, 16, "table")} and len(compiles) == 2
    with pytest.raises(ValueError, match="a bias table or a closed form, one of the two"):
        flex.distance_biased(q, q, q, 0.25)
    with pytest.raises(ValueError, match="unknown closed form 'cubic' of the distance; valid forms: linear"):
        flex.distance_biased(q, q, q, 0.25, form=("cubic", torch.ones(2), None))


def test_the_distance_table_holds_the_bias_at_each_distance():
    """ALiBi's table: ``-slope_h d`` at distance ``d`` (the paper's slopes for 4 heads: 1/4, 1/16, 1/64, 1/256);
    one head's bias is spread over every head."""
    from rope_ext.attention import flex

    module = make_config("alibi").module(4)
    table = flex.distance_table(lambda i, j: module(i, j), 6, torch.device("cpu"), 4)
    slopes = torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256])
    torch.testing.assert_close(table, -slopes[:, None] * torch.arange(6.0)[None], rtol=0, atol=0)
    one = flex.distance_table(lambda i, j: module(i, j)[:1], 6, torch.device("cpu"), 3)
    assert one.shape == (3, 6) and torch.equal(one[2], -torch.arange(6.0) / 4)


def test_layer_types_with_a_bias_are_refused_not_ignored():
    """A bias goes to every layer with positions; ``layer_types`` (the rotary layers of frequency methods and
    attention rewrites) was accepted and ignored, a bogus value included: now one line, the model untouched."""
    from tiny import tiny_model

    model = tiny_model("gemma3")
    ids = torch.randint(3, 100, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
    for layer_types in (["bogus_attention"], ["full_attention"], "full_attention"):
        with pytest.raises(ValueError, match=r"^alibi: layer_types chooses the rotary layers a frequency method or an "
                                             r"attention rewrite patches; .* \(leave layer_types out\)$"):
            rope_ext.patch(model, "alibi", layer_types=layer_types)
        assert rope_ext.get_patch(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
