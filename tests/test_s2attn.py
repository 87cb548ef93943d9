"""S2-Attn (LongLoRA's shifted sparse attention, method ``s2_attn``, hook kind ``wrapper``): the term against
references written here from LongLoRA's code (its flash-attention path's groups as masks; its roll recipe without
flash attention, which differs only where it leaks), the shift pinned by hand, training-only behaviour on tiny
models (eval and unpatch give the unpatched logits, a one-group patch is full attention, gradients flow, PoSE ids
work), and every refusal with its message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny import FAMILY_MODEL_TYPES, input_ids, logits, tiny_model

import rope_ext
from rope_ext.attention.program import AttentionProgram, Call, kernel_override
from rope_ext.attention.reference import program_reference
from rope_ext.attention.shifted import ShiftedGroups
from rope_ext.methods import HOOK_WRAPPER, MethodConfig, S2AttnConfig, make_configs, s2_group_size
from rope_ext.methods.base import HOOK_ORDER

SHAPES = [(9, 3), (4, 2), (4, 4), (4, 1), (6, 2), (1, 1)]  # (query heads, key heads): misaligned and aligned splits


def term_output(q, k, v, *, ratio=0.25, shift=True, training=True, dropout=0.0, inner=None) -> torch.Tensor:
    """The term around the plain kernel (or ``inner``), as a patched layer runs it."""
    program = AttentionProgram()
    term = ShiftedGroups(S2AttnConfig(group_size_ratio=ratio, shift=shift))
    program.add(term)
    call = Call(program, q, k, v, q.shape[-1] ** -0.5, dropout=dropout, module=SimpleNamespace(training=training))
    return program.run(call) if inner is None else term.wrap(call, inner)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """LongLoRA's ``repeat_kv``: key head ``j`` serves query heads ``j * r .. j * r + r - 1``."""
    b, hk, n, d = x.shape
    return x[:, :, None].expand(b, hk, heads // hk, n, d).reshape(b, heads, n, d)


def group_ids(n: int, g: int, shifted: bool) -> torch.Tensor:
    """Each token's group, from group starts as LongLoRA's flash path writes its ``cu_seqlens``: ``0, g, 2g...``;
    shifted: ``0, g/2, g/2 + g, ...`` (the last group ends at ``n``)."""
    starts = list(range(0, n, g)) if not shifted else [0] + list(range(g // 2, n, g))
    ids = torch.zeros(n, dtype=torch.long)
    for number, start in enumerate(starts):
        ids[start:] = number
    return ids


def grouped_reference(q, k, v, ratio, shift=True) -> torch.Tensor:
    """Causal softmax attention in float64 with an explicit mask per head: ``j <= i`` within one group."""
    b, h, n, d = q.shape
    g = int(n * ratio)
    k, v = repeat_kv(k, h).double(), repeat_kv(v, h).double()
    scores = q.double() @ k.transpose(-1, -2) / d**0.5  # [b, h, n, n]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    masks = []
    for head in range(h):
        ids = group_ids(n, g, shifted=shift and head >= h // 2)
        masks.append((j <= i) & (ids[:, None] == ids[None]))
    scores = scores.masked_fill(~torch.stack(masks)[None], float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype)


def roll_recipe(q, k, v, ratio) -> torch.Tensor:
    """LongLoRA's ``forward_noflashattn``, step by step: repeat_kv, roll the second half of the heads by
    ``-group_size // 2``, cut into groups, causal softmax per group, reassemble, roll back by ``group_size // 2``."""
    b, h, n, d = q.shape
    g = int(n * ratio)
    k, v = repeat_kv(k, h), repeat_kv(v, h)

    def shift(x):
        x = x.clone().double()
        x[:, h // 2 :] = x[:, h // 2 :].roll(-g // 2, dims=2)
        return x.transpose(1, 2).reshape(b * (n // g), g, h, d).transpose(1, 2)

    qs, ks, vs = shift(q), shift(k), shift(v)
    scores = qs @ ks.transpose(2, 3) / d**0.5  # [b * G, h, g, g]
    causal = torch.ones(g, g, dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vs
    out = out.transpose(1, 2).reshape(b, n, h, d)
    out[:, :, h // 2 :] = out[:, :, h // 2 :].roll(g // 2, dims=1)
    return out.transpose(1, 2).to(q.dtype)


def random_qkv(h, hk, n=32, d=8, b=2, seed=0, grad=False):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, n, d, generator=generator) for heads in (h, hk, hk))
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


# --- the term against the references ----------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.25, 0.125])
@pytest.mark.parametrize(("h", "hk"), SHAPES, ids=[f"h{h}-hk{hk}" for h, hk in SHAPES])
def test_the_term_equals_the_grouped_reference(h, hk, ratio):
    q, k, v = random_qkv(h, hk)
    torch.testing.assert_close(term_output(q, k, v, ratio=ratio), grouped_reference(q, k, v, ratio), rtol=0, atol=2e-6)
    torch.testing.assert_close(
        term_output(q, k, v, ratio=ratio, shift=False), grouped_reference(q, k, v, ratio, shift=False), rtol=0, atol=2e-6
    )


@pytest.mark.parametrize(("h", "hk"), [(9, 3), (4, 2), (8, 2)])
def test_the_term_is_the_roll_recipe_but_for_the_tokens_it_leaks_to(h, hk):
    """LongLoRA's roll (without flash attention) lets the shifted heads' first g/2 tokens see the last g/2 tokens;
    everywhere else the term gives what the roll gives, and there it gives the flash path's groups (no future)."""
    q, k, v = random_qkv(h, hk, n=32)
    g = 8  # 32 * 0.25
    out, rolled = term_output(q, k, v), roll_recipe(q, k, v, 0.25)
    leaked = torch.zeros_like(out, dtype=torch.bool)
    leaked[:, h // 2 :, : g // 2] = True
    torch.testing.assert_close(out[~leaked], rolled[~leaked], rtol=0, atol=2e-6)
    assert (out[leaked] - rolled[leaked]).abs().min() > 1e-4  # every leaked output differs


def test_the_shift_by_hand():
    """n = 8, ratio 1/4: groups of g = 2, the second head's shifted by 1. Zero queries attend evenly over the keys
    they may see and one-hot values name them: each output row is the mean of the attended one-hots."""
    n = 8
    q = torch.zeros(1, 2, n, n)
    k = torch.randn(1, 1, n, n)
    v = torch.eye(n)[None, None]  # value of key t: e_t
    attended = {
        0: [[0], [0, 1], [2], [2, 3], [4], [4, 5], [6], [6, 7]],  # groups {0,1} {2,3} {4,5} {6,7}
        1: [[0], [1], [1, 2], [3], [3, 4], [5], [5, 6], [7]],  # groups {0} {1,2} {3,4} {5,6} {7}
    }
    for kv in (k, k.expand(1, 2, n, n)):  # one key head (repeated: the split is not between key heads), or two
        out = term_output(q, kv, v.expand(1, kv.shape[1], n, n))
        for head, rows in attended.items():
            for token, keys in enumerate(rows):
                expected = torch.zeros(n)
                expected[keys] = 1 / len(keys)
                torch.testing.assert_close(out[0, head, token], expected, rtol=0, atol=1e-6)


def test_one_group_and_eval_mode_are_full_attention():
    q, k, v = random_qkv(4, 2)
    full = grouped_reference(q, k, v, 1.0, shift=False)  # one group of 32: plain causal attention
    torch.testing.assert_close(term_output(q, k, v, ratio=1.0), full, rtol=0, atol=2e-6)
    torch.testing.assert_close(term_output(q, k, v, training=False), full, rtol=0, atol=2e-6)


def test_gradients_through_the_term_equal_the_reference_gradients():
    q, k, v = random_qkv(9, 3, grad=True)
    weights = torch.randn(2, 9, 32, 8, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((term_output(q, k, v) * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((grouped_reference(q, k, v, 0.25) * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_dropout_and_the_scale_reach_every_grouped_call():
    seen = []

    def inner(call):
        seen.append((call.dropout, call.scale, call.rows, call.position_ids, call.link, tuple(call.q.shape)))
        return torch.zeros(*call.q.shape[:-1], call.v.shape[-1])

    q, k, v = random_qkv(4, 2)
    term_output(q, k, v, dropout=0.3, inner=inner)
    assert [s[:5] for s in seen] == [(0.3, 8**-0.5, None, None, None)] * 2
    assert [s[5] for s in seen] == [(8, 4, 8, 8), (2, 2, 4, 8)]  # b * G groups of g = 8; the shifted heads' first g/2


# --- the method on a model ----------------------------------------------------------------------------------


def test_eval_mode_and_unpatch_give_the_unpatched_logits():
    model = tiny_model("llama")
    ids = input_ids(64, batch=2)
    base = logits(model, ids)
    model.train()
    base_train = logits(model, ids)
    model.eval()
    rope_ext.patch(model, "s2_attn")
    torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=1e-5)  # inference: full attention
    model.train()
    assert (logits(model, ids) - base_train).abs().max() > 1e-3  # training: groups
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, ids), base_train)
    model.eval()
    assert torch.equal(logits(model, ids), base)


#: families refused, and why: no attention site (Falcon), softcapping (Gemma 2), every tiny layer sliding (EXAONE 4)
REFUSED = {
    "falcon": "'s2_attn' needs a 'wrapper' hook",
    "gemma2": "attn_logit_softcapping",
    "exaone4": "every layer of this model uses sliding-window attention",
}


@pytest.mark.parametrize("family", sorted(FAMILY_MODEL_TYPES))
def test_every_family_trains_in_groups_infers_in_full_and_unpatches_exactly(family):
    model = tiny_model(family)
    ids = input_ids(64, batch=2)
    if family in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[family]):
            rope_ext.patch(model, "s2_attn")
        return

    def train_logits():  # (seeded: some families keep dropout on in training)
        model.train()
        torch.manual_seed(0)
        try:
            return logits(model, ids)
        finally:
            model.eval()

    base, base_train = logits(model, ids), train_logits()
    with rope_ext.patched(model, "s2_attn"):
        torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=1e-5)
        assert (train_logits() - base_train).abs().max() > 1e-3
    assert torch.equal(logits(model, ids), base) and torch.equal(train_logits(), base_train)


def test_one_group_in_training_is_full_attention_and_shift_false_is_groups_alone():
    """ratio 1: the unpatched logits; shift=False: each group of 16 tokens scores as if it were alone."""
    model = tiny_model("llama").train()
    ids = input_ids(64, batch=2)
    base = logits(model, ids)
    alone = torch.cat(
        [logits(model, ids[:, a : a + 16], position_ids=torch.arange(a, a + 16)[None].expand(2, -1)) for a in range(0, 64, 16)],
        dim=1,
    )
    with rope_ext.patched(model, "s2_attn:group_size_ratio=1.0"):
        torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=1e-5)
    with rope_ext.patched(model, "s2_attn:shift=false"):
        torch.testing.assert_close(logits(model, ids), alone, rtol=0, atol=1e-5)


def test_combines_with_yarn():
    model = tiny_model("llama")
    ids = input_ids(4 * 64, batch=2)
    with rope_ext.patched(model, "yarn:factor=4"):
        yarn = logits(model, ids)
        model.train()
        yarn_train = logits(model, ids)
        model.eval()
    with rope_ext.patched(model, "yarn:factor=4+s2_attn:group_size_ratio=1.0"):
        model.train()
        torch.testing.assert_close(logits(model, ids), yarn, rtol=0, atol=1e-5)
        model.eval()
    with rope_ext.patched(model, ["s2_attn", "yarn:factor=4"]):
        assert [c.method for c in rope_ext.get_patch(model)] == ["yarn", "s2_attn"]
        torch.testing.assert_close(logits(model, ids), yarn, rtol=0, atol=1e-5)
        model.train()
        grouped = logits(model, ids)
        assert (grouped - yarn_train).abs().max() > 1e-3
        with kernel_override(program_reference):  # the groups through the plain reference kernel
            torch.testing.assert_close(logits(model, ids), grouped, rtol=0, atol=2e-5)
    model.eval()


def test_combines_with_an_absolute_table_read_past_its_rows():
    """GPT-2 under abs_interp:factor=2+s2_attn is GPT-2 with the interpolated table (by hand: odd rows halfway
    between two) under s2_attn alone: the table is read at the embeddings, before the groups (a new user's trial
    found the pair refused as 'not checked')."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2(rows: int):
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=rows, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(config).eval()

    model, stretched = gpt2(33), gpt2(64)  # (factor 2 reaches 2 x 32 + 1 = 65 positions of 33 rows)
    table = model.transformer.wpe.weight.detach()
    halfway = (table[:-1] + table[1:]) / 2
    with torch.no_grad():
        stretched.load_state_dict({k: v for k, v in model.state_dict().items() if "wpe" not in k}, strict=False)
        stretched.transformer.wpe.weight.copy_(torch.stack([table[:-1], halfway], 1).reshape(-1, 32)[:64])
    ids = input_ids(64, batch=2)
    with rope_ext.patched(stretched, "s2_attn"):
        full = logits(stretched, ids)
        grouped = logits(stretched.train(), ids)
        stretched.eval()
    assert (grouped - full).abs().max() > 1e-3
    base = logits(model, ids[:, :33])
    with rope_ext.patched(model, "abs_interp:factor=2+s2_attn"):
        torch.testing.assert_close(logits(model, ids), full, rtol=0, atol=1e-5)  # inference: full attention
        torch.testing.assert_close(logits(model.train(), ids), grouped, rtol=0, atol=1e-5)
        model.eval()
    assert torch.equal(logits(model, ids[:, :33]), base)


def test_gradients_flow_in_training():
    model = tiny_model("llama")
    ids = input_ids(64, batch=2)
    rope_ext.patch(model, "yarn:factor=4+s2_attn")
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert torch.isfinite(loss) and grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().max() > 0


def test_pose_ids_with_a_jump_and_an_all_ones_mask_train():
    model = tiny_model("llama")
    ids = input_ids(64, batch=2)
    positions = torch.cat([torch.arange(20), torch.arange(44) + 150])[None].expand(2, -1)
    batch = {"input_ids": ids, "position_ids": positions, "attention_mask": torch.ones_like(ids), "labels": ids}
    with rope_ext.patched(model, "yarn:factor=4+s2_attn"):
        model.train()
        loss = model(**batch, use_cache=False).loss
        with torch.no_grad():
            without_jump = model(**{**batch, "position_ids": torch.arange(64)[None].expand(2, -1)}).loss
        model.eval()
    assert torch.isfinite(loss) and abs(float(loss.detach()) - float(without_jump)) > 1e-5  # the ids reach the rotation


def test_sliding_layers_are_left_alone():
    model = tiny_model("gemma3")  # layer 0 sliding, layer 1 full
    with rope_ext.patched(model, "s2_attn"):
        summary = rope_ext.summary(model)
        assert "s2_attn" in summary.split("layer 1")[1] and "layer 0 (sliding_attention: plain)" in summary


def test_saves_and_reloads(tmp_path):
    model = tiny_model("llama")
    rope_ext.patch(model, "yarn:factor=4+s2_attn:group_size_ratio=0.125:shift=false")
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert rope_ext.get_patch(restored) == rope_ext.get_patch(model)
    ids = input_ids(64)
    model.train(), restored.train()
    torch.testing.assert_close(logits(restored, ids), logits(model, ids), rtol=0, atol=0)


# --- the config, and what is refused ---------------------------------------------------------------------------


def test_the_config_round_trips_and_comes_last():
    config = make_configs("s2_attn:group_size_ratio=0.125:shift=false")[0]
    assert config == S2AttnConfig(group_size_ratio=0.125, shift=False) and config.hook == HOOK_WRAPPER == HOOK_ORDER[-1]
    assert MethodConfig.from_dict(config.to_dict()) == config
    assert [c.method for c in make_configs("s2_attn+yarn:factor=2")] == ["yarn", "s2_attn"]


def test_group_sizes_and_the_lengths_that_work():
    assert [s2_group_size(n, 0.25) for n in (4, 8, 10, 64, 4096)] == [1, 2, 2, 16, 1024]
    assert s2_group_size(4096, 1 / 8) == 512 and s2_group_size(49, 1 / 49) == 1  # (49 * (1/49) = 0.999...)
    with pytest.raises(ValueError, match=r"63 tokens does not split into groups of int\(63 \* 0.25\) = 15 tokens.*"
                                         r"every multiple of 4 works; the nearest lengths that work: 60 and 64"):
        s2_group_size(63, 0.25)
    with pytest.raises(ValueError, match=r"3 tokens is too short for groups.*nearest lengths that work: 4"):
        s2_group_size(3, 0.25)
    with pytest.raises(ValueError, match="a ratio 1/G"):
        s2_group_size(21, 0.3)


@pytest.mark.parametrize("value", [0, -0.25, 1.5, float("nan"), "x", True, None])
def test_bad_group_size_ratio(value):
    with pytest.raises(ValueError, match=r"group_size_ratio must be a number in \(0, 1\]"):
        S2AttnConfig(group_size_ratio=value)


def test_bad_shift():
    with pytest.raises(ValueError, match="shift must be True or False"):
        S2AttnConfig(shift="yes")


@pytest.mark.parametrize(
    ("methods", "message"),
    [
        ("s2_attn+dca", r"s2_attn cannot be combined with dca \('position_rule' methods: dca, leaky_rerope, rerope, "
                        r"self_extend, string\): .*positions.*combines with 'frequency' methods \(.*yarn\)$"),
        ("yarn:factor=4+s2_attn+logn", r"s2_attn cannot be combined with logn \('query_scale' methods: logn, temperature\):"),
        ("s2_attn+self_extend+logn", r"s2_attn cannot be combined with self_extend \('position_rule' methods: .*\):"),
        ("dynamic_ntk:factor=2:cache_consistent=true+s2_attn", r"s2_attn cannot be combined with dynamic_ntk \(it rotates "
                                                               r"queries and keys inside attention\): .*cache_consistent=false"),
    ],
)
def test_refused_combinations(methods, message):
    model = tiny_model("llama")
    base = logits(model, input_ids(64))
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, methods)
    assert rope_ext.get_patch(model) is None and torch.equal(logits(model, input_ids(64)), base)


def test_refused_training_inputs():
    model = tiny_model("llama")
    rope_ext.patch(model, "s2_attn")
    model.train()
    with pytest.raises(ValueError, match=r"63 tokens does not split.*nearest lengths that work: 60 and 64"):
        model(input_ids=input_ids(63))
    ids = input_ids(64, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with pytest.raises(ValueError, match="training batches must be unpadded"):
        model(input_ids=ids, attention_mask=mask)
    q, k, v = random_qkv(4, 2, n=32)
    with pytest.raises(ValueError, match=r"continues a KV cache \(8 new queries over 32 keys\).*model.eval\(\)"):
        term_output(q[:, :, -8:], k, v)
    model.eval()
    model(input_ids=input_ids(63), attention_mask=torch.ones(1, 63, dtype=torch.long))  # inference: any input


def test_families_without_an_attention_site_or_full_layers_are_refused():
    from rope_ext.families import get_family

    assert "wrapper" not in get_family("falcon").hooks and "wrapper" in get_family("llama").hooks
    with pytest.raises(ValueError, match=r"'s2_attn' needs a 'wrapper' hook, which family 'falcon' does not support; "
                                         r"methods for falcon: dynamic_ntk, .*yarn$"):
        rope_ext.patch(tiny_model("falcon"), "s2_attn")
    mistral = tiny_model("mistral")
    mistral.config.sliding_window = 32  # every layer sliding
    with pytest.raises(ValueError, match="every layer of this model uses sliding-window attention; s2_attn applies"):
        rope_ext.patch(mistral, "s2_attn")
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        rope_ext.patch(tiny_model("gemma2"), "s2_attn")
