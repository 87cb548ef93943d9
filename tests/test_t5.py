"""T5 (and mT5, UMT5): the bucket methods ``t5_bucket_scale`` and ``t5_bucket_extend`` on tiny models built from
configs. The reference for every bucket is transformers' own ``T5Attention._relative_position_bucket``; the
hand-computed points are written out with the formula they come from."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, MT5Config, T5Config, UMT5Config
from transformers.models.t5.modeling_t5 import T5Attention
from tiny import VOCAB
from tiny import input_ids as ids

import rope_ext
from rope_ext.methods import T5BucketExtendConfig, T5BucketScaleConfig, make_config, t5_bucket

T5_BUCKETS = T5Attention._relative_position_bucket
CONFIGS = {"t5": T5Config, "mt5": MT5Config, "umt5": UMT5Config}


def tiny_t5(family: str = "t5", seed: int = 0, **overrides):
    options = dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )
    config = CONFIGS[family](**(options | overrides))
    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    with torch.no_grad():  # (a tiny model's bias table starts near zero: make the buckets matter)
        for module in model.modules():
            if getattr(module, "has_relative_attention_bias", False):
                module.relative_attention_bias.weight.normal_(0, 1.0)
    return model


def forward(model, encoder_ids, decoder_ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=encoder_ids, decoder_input_ids=decoder_ids, **kwargs).logits


DISTANCES = torch.arange(-5000, 5001)


# --- the bucket functions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (64, 256), (16, 32), (32, 20)])
def test_the_plain_buckets_are_transformers_on_every_distance(bidirectional, num_buckets, max_distance):
    expected = T5_BUCKETS(DISTANCES, bidirectional, num_buckets, max_distance)
    assert torch.equal(t5_bucket(DISTANCES, bidirectional, num_buckets, max_distance), expected)
    for config in (T5BucketScaleConfig(factor=1), T5BucketExtendConfig(factor=1)):  # identity settings
        assert torch.equal(config.bucket(DISTANCES, bidirectional, num_buckets, max_distance), expected)


@pytest.mark.parametrize("factor", [1.5, 2, 4, 7.3])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_scaling_buckets_the_distance_divided_by_the_factor(factor, bidirectional):
    scaled = torch.sign(DISTANCES) * torch.div(DISTANCES.abs() * 10, int(factor * 10), rounding_mode="floor")
    expected = T5_BUCKETS(scaled, bidirectional, 32, 128)
    assert torch.equal(T5BucketScaleConfig(factor=factor).bucket(DISTANCES, bidirectional, 32, 128), expected)


def test_hand_computed_buckets():
    """t5's 32 buckets, max_distance 128. Encoder: 16 per direction, 8 exact, bucket 8 + trunc(ln(r/8)/ln(16)*8);
    keys after the query + 16. Decoder: 32, 16 exact, 16 + trunc(ln(r/16)/ln(8)*16)."""
    scale, extend = T5BucketScaleConfig(factor=4), T5BucketExtendConfig(factor=8)
    rel = torch.tensor([-100, 100, -7, 7, -200, 200, -1000, 1000])
    # scale x4: r = 25 -> 8 + trunc(3.288) = 11; r = 1 -> 1; r = 50 -> 8 + trunc(5.288) = 13;
    # r = 250 -> 8 + trunc(9.93) = 17, capped at 15
    assert scale.bucket(rel, True, 32, 128).tolist() == [11, 27, 1, 17, 13, 29, 15, 31]
    # decoder, r = 25 -> 16 + trunc(ln(25/16)/ln(8)*16 = 3.434) = 19; keys after the query count as distance 0
    assert scale.bucket(torch.tensor([-100, 100, -1000]), False, 32, 128).tolist() == [19, 0, 16 + 15]
    # extend x8: 6 more buckets per direction (8 ln 8 / ln 16 = 6), 22 each: r = 200 -> 8 + trunc(9.288) = 17,
    # r = 1000 -> 8 + trunc(13.93) = 21 (the new last); keys after the query from 22 on;
    # r = 100 -> 8 + trunc(7.288) = 15
    assert extend.bucket(rel, True, 32, 128).tolist() == [15, 37, 7, 29, 17, 39, 21, 43]
    # decoder: 16 more (16 ln 8 / ln 8), 48: r = 200 -> 16 + trunc(ln(12.5)/ln(8)*16 = 19.43) = 35; r = 1000 ->
    # 16 + trunc(31.82) = 47
    assert extend.bucket(torch.tensor([-200, -1000, -100000]), False, 32, 128).tolist() == [35, 47, 47]
    # (T5's own puts all of them in its last bucket)
    assert T5_BUCKETS(torch.tensor([-200, -1000]), True, 32, 128).tolist() == [15, 15]


@pytest.mark.parametrize(
    ("factor", "bidirectional", "rows"),
    [(1, True, 16), (2, True, 18), (4, True, 20), (8, True, 22), (5, True, 21), (8, False, 48), (2, False, 38)],
)
def test_the_grown_table_has_the_buckets_of_the_same_width(factor, bidirectional, rows):
    """Per direction n + ceil((n - e) ln(factor) / ln(D / e)): encoder 16 + ceil(2 log2(factor)) (8 / ln(16) = 2 /
    ln 2), decoder 32 + ceil(16 log8(factor)); 5x: 16 + ceil(4.64) = 21; decoder 2x: 32 + ceil(5.33) = 38."""
    config = T5BucketExtendConfig(factor=factor)
    assert config.per_direction(bidirectional, 32, 128) == rows
    # the last bucket starts about factor x as far as t5's own: 8 * 16^(7/8) = 90.5 -> 91 (encoder),
    # 16 * 8^(15/16) = 112.4 -> 113 (decoder)
    distance = torch.arange(0, 100000)
    first = int((config.bucket(-distance, bidirectional, 32, 128) == rows - 1).nonzero()[0])
    own = int((T5_BUCKETS(-distance, bidirectional, 32, 128) == (15 if bidirectional else 31)).nonzero()[0])
    assert own == (91 if bidirectional else 113)
    assert factor * own * 0.99 <= first < factor * own * 1.5


def test_the_grown_table_keeps_every_trained_row_and_copies_the_last():
    weight = torch.randn(32, 4)
    table = T5BucketExtendConfig(factor=8).table(weight, True, 32, 128)  # 22 per direction
    assert table.shape == (44, 4)
    assert torch.equal(table[:16], weight[:16]) and torch.equal(table[22:38], weight[16:32])
    assert torch.equal(table[16:22], weight[15].expand(6, 4)) and torch.equal(table[38:], weight[31].expand(6, 4))
    decoder = T5BucketExtendConfig(factor=8).table(weight, False, 32, 128)
    assert decoder.shape == (48, 4) and torch.equal(decoder[:32], weight)
    assert torch.equal(decoder[32:], weight[31].expand(16, 4))


@pytest.mark.parametrize("method", ["t5_bucket_scale", "t5_bucket_extend"])
@pytest.mark.parametrize("options", [{"factor": 0.5}, {"factor": 0}, {"factor": -2}, {"factor": float("nan")}, {}])
def test_bad_factors_are_refused(method, options):
    with pytest.raises(ValueError, match=rf"{method}: factor (must be|is required)"):
        make_config(method, **options)


# --- on models ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["t5", "mt5", "umt5"])
def test_identity_settings_give_the_original_logits_and_unpatch_is_bit_exact(family):
    model = tiny_t5(family)
    encoder_ids, decoder_ids = ids(300), ids(200, seed=2)
    base = forward(model, encoder_ids, decoder_ids)
    for spec in ("t5_bucket_scale:factor=1", "t5_bucket_extend:factor=1", "t5_bucket_extend:factor=8"):
        with rope_ext.patched(model, spec):  # (extend: the new rows start as the last trained one's copies)
            assert torch.equal(forward(model, encoder_ids, decoder_ids), base), spec
    rope_ext.patch(model, "t5_bucket_scale:factor=4")
    assert not torch.allclose(forward(model, encoder_ids, decoder_ids), base, atol=1e-3)
    rope_ext.unpatch(model)
    assert torch.equal(forward(model, encoder_ids, decoder_ids), base)
    assert all("compute_bias" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_the_patched_bias_is_transformers_bias_on_divided_distances(family):
    """Every table module's bias, encoder and decoder, against the table read at transformers' buckets of
    ``sign(rel) floor(|rel| / 4)``, with a cached prefix too (decoder: queries 150..159 over 160 keys)."""
    model = tiny_t5(family)
    rope_ext.patch(model, "t5_bucket_scale:factor=4")
    modules = [m for m in model.modules() if getattr(m, "has_relative_attention_bias", False)]
    assert len(modules) == (2 if family == "t5" else 4)
    for module in modules:
        q, k, past = (10, 160, 150) if module.is_decoder else (120, 120, 0)
        rel = torch.arange(k)[None] - (torch.arange(q)[:, None] + past)
        scaled = torch.sign(rel) * torch.div(rel.abs(), 4, rounding_mode="floor")
        buckets = T5_BUCKETS(scaled, not module.is_decoder, 32, 128)
        expected = module.relative_attention_bias.weight[buckets].permute(2, 0, 1)[None]
        assert torch.equal(module.compute_bias(q, k, past_seen_tokens=past).dense(), expected)


@pytest.mark.parametrize(("spec", "new_tokens"), [("t5_bucket_scale:factor=2", 6), ("t5_bucket_extend:factor=8", 130)])
def test_generation_with_the_cache_equals_the_full_forward(spec, new_tokens):
    """Extend with a trained (random) grown table, decoding past the decoder's old reach (113)."""
    model = tiny_t5()
    encoder_ids = ids(260)
    rope_ext.patch(model, spec)
    container = getattr(model, "rope_ext", None)
    with torch.no_grad():
        if container is not None:
            container.t5_bucket_extend.tables[1].weight.normal_()
        out = model.generate(encoder_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    full = forward(model, encoder_ids, out.sequences[:, :-1])
    for step, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits, full[:, step], rtol=0, atol=1e-5)


def test_an_odd_bucket_count_grows_and_starts_as_the_original():
    model = tiny_t5(relative_attention_num_buckets=33)  # encoder 16 per direction (33 // 2), decoder 33
    encoder_ids, decoder_ids = ids(300), ids(150, seed=2)
    base = forward(model, encoder_ids, decoder_ids)
    with rope_ext.patched(model, "t5_bucket_extend:factor=8") as patched:
        # (decoder: 33 - 16 = 17 log buckets over ln 8, 17 more for 8x)
        assert [t.weight.shape[0] for t in patched.rope_ext.t5_bucket_extend.tables] == [2 * 22, 33 + 17]
        assert torch.equal(forward(model, encoder_ids, decoder_ids), base)


def test_a_padded_batch_row_equals_the_row_alone():
    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_extend:factor=4")
    with torch.no_grad():  # (a trained table: the new rows differ from the copies)
        model.rope_ext.t5_bucket_extend.tables[0].weight.normal_()
    long, short = ids(220), ids(150, seed=3)
    batch = torch.zeros(2, 220, dtype=torch.long)
    batch[0], batch[1, :150] = long[0], short[0]
    mask = (torch.arange(220)[None] < torch.tensor([[220], [150]])).long()
    decoder_ids = ids(20, batch=2, seed=4)
    padded = forward(model, batch, decoder_ids, attention_mask=mask)
    torch.testing.assert_close(padded[1:], forward(model, short, decoder_ids[1:]), rtol=0, atol=1e-5)
    torch.testing.assert_close(padded[:1], forward(model, long, decoder_ids[:1]), rtol=0, atol=1e-5)


def test_a_grown_table_trains_saves_and_reloads(tmp_path):
    model = tiny_t5()
    encoder_ids, decoder_ids = ids(300), ids(40, seed=2)
    rope_ext.patch(model, "t5_bucket_extend:factor=8")
    tables = model.rope_ext.t5_bucket_extend.tables
    assert [t.weight.shape for t in tables] == [(44, 4), (48, 4)]
    assert rope_ext.summary(model).splitlines() == [
        "rope_ext patch: t5_bucket_extend:factor=8",
        "  encoder.block.0.layer.0.SelfAttention.compute_bias: t5_bucket_extend(factor=8) buckets, a grown table of 22 "
        "buckets per direction",
        "  decoder.block.0.layer.0.SelfAttention.compute_bias: t5_bucket_extend(factor=8) buckets, a grown table of 48 "
        "buckets per direction",
        "  attention layers 0-1 (encoder self-attention: bidirectional relative bias, block by block)",
        "  attention layers 0-1 (decoder self-attention: causal relative bias, block by block)",
        "  attention layers 0-1 (cross-attention: plain (no positions))",
        "  parameters owned: 368 (368 trainable) under 'rope_ext.'",
    ]
    # a step of training moves the grown rows (distances past the old reach occur in 300 tokens)
    model.train()
    optimizer = torch.optim.SGD(model.rope_ext.parameters(), lr=1.0)
    loss = model(input_ids=encoder_ids, decoder_input_ids=decoder_ids, labels=decoder_ids).loss
    loss.backward()
    assert tables[0].weight.grad[16:22].abs().sum() > 0 and tables[0].weight.grad[38:].abs().sum() > 0
    optimizer.step()
    model.eval()
    expected = forward(model, encoder_ids, decoder_ids)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert type(restored) is type(model) and rope_ext.get_patch(restored) == rope_ext.get_patch(model)
    assert torch.equal(forward(restored, encoder_ids, decoder_ids), expected)
    with pytest.raises(RuntimeError, match=r"trained since patching \(t5_bucket_extend.tables.0.weight"):
        rope_ext.unpatch(model)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("yarn:factor=4",
         r"method 'yarn' needs a 'frequency' hook, which family 't5' does not support; methods for t5: "
         r"alibi, kerple, sandwich, t5_bucket_extend, t5_bucket_scale$"),
        ("dca", r"family 't5' does not support; methods for t5: alibi, kerple, sandwich, t5_bucket_extend"),
        ("fire", r"method 'fire' does not fit t5: its attention adds one bias of the distance j - i to every query .* "
                 r"and fire's depends on the query's position too; methods for t5: alibi, kerple, sandwich, "
                 r"t5_bucket_extend, t5_bucket_scale$"),
        ("alibi+t5_bucket_scale:factor=2", r"alibi cannot be combined with t5_bucket_scale \('bucket' methods: "
                                           r"t5_bucket_extend, t5_bucket_scale\): alibi replaces the model's position "
                                           r"encoding.*combines with nothing on this model$"),
        ("t5_bucket_scale:factor=0.5", r"t5_bucket_scale: factor must be a number >= 1"),
        ("t5_bucket_extend:num_buckets=64",
         r"t5_bucket_extend: unknown option\(s\) num_buckets; valid options: factor$"),
    ],
)
def test_bad_input_is_refused_and_the_model_untouched(spec, message):
    model = tiny_t5()
    encoder_ids, decoder_ids = ids(150), ids(20, seed=2)
    base = forward(model, encoder_ids, decoder_ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, spec)
    assert rope_ext.get_patch(model) is None and model.state_dict().keys() == state.keys()
    assert torch.equal(forward(model, encoder_ids, decoder_ids), base)


def test_patching_twice_and_a_bucket_method_on_a_rotary_model_are_refused():
    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_scale:factor=2")
    with pytest.raises(RuntimeError, match=r"already patched with T5BucketScaleConfig\(factor=2\)"):
        rope_ext.patch(model, "t5_bucket_extend:factor=2")
    from tiny import tiny_model

    refused = r"needs a 'bucket' hook, which family 'llama' does not support; methods for llama: alibi, dca, .*fire"
    with pytest.raises(ValueError, match=refused):
        rope_ext.patch(tiny_model("llama"), "t5_bucket_scale:factor=2")


def test_a_grown_table_trains_through_peft_and_a_patched_model_copies(tmp_path):
    """LoRA on q/v with the grown tables in ``modules_to_save`` (peft freezes them otherwise): the tables train,
    the adapter saves and reloads onto a base made by ``rope_ext.from_pretrained``; a deep copy runs alike."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    model = tiny_t5()
    encoder_ids, decoder_ids = ids(300), ids(30, seed=2)
    rope_ext.patch(model, "t5_bucket_extend:factor=8")
    model.save_pretrained(tmp_path / "base")
    copied = copy.deepcopy(model)
    assert torch.equal(forward(copied, encoder_ids, decoder_ids), forward(model, encoder_ids, decoder_ids))
    with torch.no_grad():  # (the copy reads its own tables, not the original's)
        copied.rope_ext.t5_bucket_extend.tables[0].weight.normal_()
    assert not torch.equal(forward(copied, encoder_ids, decoder_ids), forward(model, encoder_ids, decoder_ids))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q", "v"], modules_to_save=["rope_ext"]))
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = peft_model(input_ids=encoder_ids, decoder_input_ids=decoder_ids, labels=decoder_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    trained = peft_model.base_model.model.rope_ext.modules_to_save["default"].t5_bucket_extend.tables[0].weight
    assert not torch.equal(trained[16:22], trained[15].expand(6, 4))  # the new rows moved apart
    expected = forward(peft_model, encoder_ids, decoder_ids)
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(rope_ext.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    torch.testing.assert_close(forward(reloaded, encoder_ids, decoder_ids), expected, rtol=0, atol=1e-6)


def test_a_part_of_a_patched_model_or_a_stack_alone_is_refused():
    """A patch on a part of a patched model would hide from get_patch, save and unpatch of the whole; T5's stacks
    keep their own copy of the config, so a patch of one alone would not be saved."""
    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_scale:factor=2")
    with pytest.raises(RuntimeError, match=r"part of this model \('block.0.layer.0.SelfAttention.compute_bias'\) is "
                                           r"already patched by rope_ext through a model that contains it"):
        rope_ext.patch(model.decoder, "t5_bucket_extend:factor=2")
    with pytest.raises(RuntimeError, match=r"not patched itself, but part of it \('block.0.layer.0.SelfAttention"):
        rope_ext.unpatch(model.encoder)
    rope_ext.unpatch(model)
    with pytest.raises(ValueError, match=r"t5: patch the whole model, not its T5Stack"):
        rope_ext.patch(model.encoder, "t5_bucket_scale:factor=2")
    with pytest.raises(ValueError, match=r"t5: patch the whole model, not its T5Block"):
        rope_ext.patch(model.encoder.block[0], "t5_bucket_scale:factor=2")
    assert rope_ext.get_patch(model) is None


def test_a_reloaded_table_unpatches_without_discarding_and_a_failed_exit_keeps_the_bodys_error(tmp_path):
    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_extend:factor=4")
    with torch.no_grad():
        model.rope_ext.t5_bucket_extend.tables[0].weight.normal_()  # (trained)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    rope_ext.unpatch(restored)  # (its values are the saved ones: nothing trained since it was loaded)
    with pytest.raises(KeyError, match="the body's") as raised:
        with rope_ext.patched(tiny_t5(), "t5_bucket_extend:factor=4") as patched:
            with torch.no_grad():
                patched.rope_ext.t5_bucket_extend.tables[1].weight.add_(1.0)
            raise KeyError("the body's")
    assert any("could not unpatch on the way out; the model is still patched" in n for n in raised.value.__notes__)


def test_a_factor_beyond_int64_is_refused_and_the_largest_runs_as_a_float():
    model = tiny_t5()
    encoder_ids, decoder_ids = ids(100), ids(10, seed=2)
    with pytest.raises(ValueError, match=r"t5_bucket_scale: factor must be a number >= 1 and <= 1e6 .*got 1180591620717411303424$"):
        rope_ext.patch(model, "t5_bucket_scale", factor=2**70)
    assert rope_ext.get_patch(model) is None
    with rope_ext.patched(model, "t5_bucket_scale", factor=10**6):  # (an int) every distance in bucket 0
        largest = forward(model, encoder_ids, decoder_ids)
    with rope_ext.patched(model, "t5_bucket_scale", factor=1e6):
        assert torch.equal(forward(model, encoder_ids, decoder_ids), largest)


# --- the bias block by block (rope_ext.attention.relative) -------------------------------------------------


@pytest.fixture
def small_blocks(monkeypatch):
    """The strided path on every call, in calls of 48 queries and causal squares of 16 (several of each)."""
    from rope_ext.attention import relative

    monkeypatch.setattr(relative, "DENSE_ELEMENTS", 0)
    monkeypatch.setattr(relative, "RELATIVE_BLOCK", 48)
    monkeypatch.setattr(relative, "RELATIVE_SQUARE", 16)
    return relative


def reference_forward(model, encoder_ids, decoder_ids, **kwargs):
    from rope_ext.attention.program import kernel_override
    from rope_ext.attention.reference import relative_reference

    with kernel_override(relative_reference):
        return forward(model, encoder_ids, decoder_ids, **kwargs)


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_the_blockwise_bias_equals_transformers_materialised_one(small_blocks, family):
    """At identity settings the strided path (several blocks and squares, encoder and decoder) gives transformers'
    own logits, where the bias is one [1, heads, q, k] tensor."""
    model = tiny_t5(family)
    encoder_ids, decoder_ids = ids(170), ids(100, seed=2)
    base = forward(model, encoder_ids, decoder_ids)
    with rope_ext.patched(model, "t5_bucket_scale:factor=1"):
        torch.testing.assert_close(forward(model, encoder_ids, decoder_ids), base, rtol=0, atol=2e-5)


@pytest.mark.parametrize("spec", ["t5_bucket_scale:factor=4", "t5_bucket_extend:factor=8"])
def test_the_blockwise_bias_equals_the_reference_with_padding_of_every_kind(small_blocks, spec):
    """Against the bias written out and one float64 softmax: a right-padded row, a left-padded one and one with a
    hole (its keys compacted, the bias by position), in the encoder and in the decoder (its left pads see no key:
    zeros in both)."""
    model = tiny_t5()
    rope_ext.patch(model, spec)
    if "extend" in spec:
        with torch.no_grad():
            for table in model.rope_ext.t5_bucket_extend.tables:
                table.weight.normal_()
    encoder_ids, decoder_ids = ids(150, batch=3), ids(70, batch=3, seed=2)
    mask = torch.ones(3, 150, dtype=torch.long)
    mask[0, 120:], mask[1, :25], mask[2, 60:75] = 0, 0, 0
    decoder_mask = torch.ones(3, 70, dtype=torch.long)
    decoder_mask[0, 50:], decoder_mask[1, :4], decoder_mask[2, 30:33] = 0, 0, 0
    options = dict(attention_mask=mask, decoder_attention_mask=decoder_mask)
    fast = forward(model, encoder_ids, decoder_ids, **options)
    expected = reference_forward(model, encoder_ids, decoder_ids, **options)
    torch.testing.assert_close(fast, expected, rtol=0, atol=2e-5)
    plain = forward(model, encoder_ids, decoder_ids)
    torch.testing.assert_close(plain, reference_forward(model, encoder_ids, decoder_ids), rtol=0, atol=2e-5)


def test_the_strided_path_never_writes_out_a_call_sized_bias(small_blocks, monkeypatch):
    """The bias's values are asked for one distance vector per call (n + m - 1 of them), never for a [q, k] grid,
    and transformers' cross-attention zeros are not made (the marker reaches the module)."""
    from rope_ext.attention.relative import NO_POSITIONS, RelativeBias

    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_scale:factor=2")
    sizes = []
    original = RelativeBias.at

    def spy(self, rel):
        sizes.append(rel.numel())
        return original(self, rel)

    monkeypatch.setattr(RelativeBias, "at", spy)
    monkeypatch.setattr(RelativeBias, "dense", lambda self: pytest.fail("dense() on the fast path"))
    seen = []
    cross = model.decoder.block[0].layer[1].EncDecAttention
    handle = cross.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("position_bias")), with_kwargs=True)
    vectors = []
    values = model.encoder.block[0].layer[0].SelfAttention.compute_bias.values
    monkeypatch.setattr(type(model.encoder.block[0].layer[0].SelfAttention.compute_bias), "values",
                        lambda self, rel: vectors.append(rel.numel()) or values.__func__(self, rel))
    forward(model, ids(200), ids(90, seed=2))
    handle.remove()
    assert sizes == []  # (the squares read their bias from the call's vector too)
    assert sorted(set(vectors)) == [90 + 90 - 1, 200 + 200 - 1]  # (decoder, encoder: once per call)
    assert seen == [NO_POSITIONS]


def test_generation_with_the_cache_on_the_strided_path_equals_the_full_forward(small_blocks):
    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_scale:factor=2")
    encoder_ids = ids(120, batch=2)
    mask = torch.ones(2, 120, dtype=torch.long)
    mask[1, 90:] = 0
    with torch.no_grad():
        out = model.generate(encoder_ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    full = forward(model, encoder_ids, out.sequences[:, :-1], attention_mask=mask)
    for step, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits, full[:, step], rtol=0, atol=2e-5)


def test_training_gradients_on_the_strided_path_equal_the_references(small_blocks):
    """The recorded calls' backward (bias views of one vector) against autograd through the written-out bias: the
    grown tables', the projections' gradients."""
    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_extend:factor=8")
    with torch.no_grad():
        for table in model.rope_ext.t5_bucket_extend.tables:
            table.weight.normal_()
    encoder_ids, decoder_ids = ids(130), ids(60, seed=2)

    def _loss(model, encoder_ids, decoder_ids):
        return model(input_ids=encoder_ids, decoder_input_ids=decoder_ids, labels=decoder_ids).loss

    model.zero_grad()
    _loss(model, encoder_ids, decoder_ids).backward()
    fast = [p.grad.clone() for p in (*model.rope_ext.parameters(), model.encoder.block[1].layer[0].SelfAttention.q.weight)]
    model.zero_grad()
    from rope_ext.attention.program import kernel_override
    from rope_ext.attention.reference import relative_reference

    with kernel_override(relative_reference):
        _loss(model, encoder_ids, decoder_ids).backward()
    expected = [p.grad.clone() for p in (*model.rope_ext.parameters(), model.encoder.block[1].layer[0].SelfAttention.q.weight)]
    assert all(g.abs().sum() > 0 for g in fast)
    for got, want in zip(fast, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_and_an_eager_model_run_the_blockwise_bias(small_blocks):
    model = tiny_t5()
    encoder_ids, decoder_ids = ids(150), ids(50, seed=2)
    base = forward(model, encoder_ids, decoder_ids)
    eager = AutoModelForSeq2SeqLM.from_config(copy.deepcopy(model.config), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    with rope_ext.patched(eager, "t5_bucket_scale:factor=1"):
        torch.testing.assert_close(forward(eager, encoder_ids, decoder_ids), base, rtol=0, atol=2e-5)
    assert eager.config._attn_implementation == "eager"
    model.to(torch.bfloat16)
    with rope_ext.patched(model, "t5_bucket_scale:factor=1"):
        low = forward(model, encoder_ids, decoder_ids)
        assert low.dtype == torch.bfloat16
        assert (low.float() - base).abs().max() < 0.1 * base.abs().max()


def test_an_implementation_changed_after_patching_is_refused():
    model = tiny_t5()
    rope_ext.patch(model, "t5_bucket_scale:factor=2")
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="its attention implementation was changed"):
        forward(model, ids(20), ids(5, seed=2))


# --- additive biases in place of the buckets ---------------------------------------------------------------

#: ALiBi's slopes for 4 heads: 2^(-8/4 h), h = 1..4
ALIBI_4 = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])


def with_bias(model, bias_of_rel):
    """transformers' own T5 (its SDPA path, the bias written out) with every table module's ``compute_bias``
    giving ``bias_of_rel(rel) [heads, q, k]``: the reference for a bias in place of the buckets."""
    for module in model.modules():
        if getattr(module, "has_relative_attention_bias", False):
            def compute_bias(q, k, device=None, past_seen_tokens=0):
                rel = torch.arange(k)[None] - (torch.arange(q)[:, None] + int(past_seen_tokens))
                return bias_of_rel(rel)[None]

            module.compute_bias = compute_bias
    return model


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_alibi_in_place_of_the_buckets_is_transformers_with_minus_slope_times_distance(small_blocks, family):
    """Encoder on both sides, decoder causal, against transformers' own attention with ``-m_h |j - i|`` written out
    (slopes by hand); the table modules' biases, one per table."""
    model = tiny_t5(family)
    reference = with_bias(copy.deepcopy(model), lambda rel: -ALIBI_4[:, None, None] * rel.abs())
    encoder_ids, decoder_ids = ids(130, batch=2), ids(70, batch=2, seed=2)
    mask = torch.ones(2, 130, dtype=torch.long)
    mask[1, 100:] = 0
    rope_ext.patch(model, "alibi")
    for module in (m for m in model.modules() if getattr(m, "has_relative_attention_bias", False)):
        torch.testing.assert_close(module.compute_bias(3, 5).dense()[0], -ALIBI_4[:, None, None] * torch.tensor(
            [[0, 1, 2, 3, 4], [1, 0, 1, 2, 3], [2, 1, 0, 1, 2]], dtype=torch.float32))
    got = forward(model, encoder_ids, decoder_ids, attention_mask=mask)
    torch.testing.assert_close(got, forward(reference, encoder_ids, decoder_ids, attention_mask=mask), rtol=0, atol=2e-5)
    rope_ext.unpatch(model)
    assert torch.equal(forward(model, encoder_ids, decoder_ids), forward(tiny_t5(family), encoder_ids, decoder_ids))


@pytest.mark.parametrize("spec", ["alibi:factor=2", "sandwich", "kerple"])
def test_a_bias_on_t5_generates_with_the_cache_as_the_full_forward(small_blocks, spec):
    model = tiny_t5()
    rope_ext.patch(model, spec)
    encoder_ids = ids(90)
    with torch.no_grad():
        out = model.generate(encoder_ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    full = forward(model, encoder_ids, out.sequences[:, :-1])
    for step, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits, full[:, step], rtol=0, atol=2e-5)


def test_kerple_on_t5_owns_one_kernel_per_table_that_trains_saves_and_reloads(small_blocks, tmp_path):
    """``-r1 log(1 + r2 |j - i|)`` per head, one (r1, r2) per table module (encoder, decoder), against transformers
    with that bias written out; gradients reach both; save and reload."""
    model = tiny_t5()
    encoder_ids, decoder_ids = ids(110), ids(40, seed=2)
    rope_ext.patch(model, "kerple")
    kernels = model.rope_ext.kerple.layers
    assert len(kernels) == 2
    with torch.no_grad():
        for kernel in kernels:
            kernel.r1.copy_(torch.tensor([0.5, 1.0, 2.0, 4.0]))
            kernel.r2.copy_(torch.tensor([1.0, 0.5, 0.25, 0.125]))
    r1, r2 = torch.tensor([0.5, 1.0, 2.0, 4.0])[:, None, None], torch.tensor([1.0, 0.5, 0.25, 0.125])[:, None, None]
    reference = with_bias(tiny_t5(), lambda rel: -r1 * torch.log1p(r2 * rel.abs()))  # (the same seed: the same weights)
    torch.testing.assert_close(forward(model, encoder_ids, decoder_ids), forward(reference, encoder_ids, decoder_ids),
                               rtol=0, atol=2e-5)
    model.train()
    loss = model(input_ids=encoder_ids, decoder_input_ids=decoder_ids, labels=decoder_ids).loss
    loss.backward()
    assert all(k.r1.grad.abs().sum() > 0 and k.r2.grad.abs().sum() > 0 for k in kernels)
    model.eval()
    expected = forward(model, encoder_ids, decoder_ids)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert torch.equal(forward(restored, encoder_ids, decoder_ids), expected)


def test_umt5_gets_one_learnable_bias_per_table_layer():
    model = tiny_t5("umt5")
    rope_ext.patch(model, "kerple")
    assert len(model.rope_ext.kerple.layers) == 4  # (2 encoder and 2 decoder self-attention layers, each a table)
    assert "  attention layers 0-1 (cross-attention: plain (no positions))" in rope_ext.summary(model).splitlines()


def test_a_method_of_another_family_is_named_before_the_model_is_examined():
    """A DeBERTa whose own config the family refuses (an absolute table too) still hears which methods fit it."""
    from transformers import AutoModelForMaskedLM, DebertaV2Config

    config = DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                             intermediate_size=48, relative_attention=True, position_buckets=16,
                             max_relative_positions=64, position_biased_input=True)
    model = AutoModelForMaskedLM.from_config(config)
    with pytest.raises(ValueError, match=r"needs a 'bucket' hook, which family 'deberta_v2' does not support; methods "
                                         r"for deberta_v2: deberta_bucket_scale, deberta_bucket_stretch$"):
        rope_ext.patch(model, "t5_bucket_scale:factor=2")


def test_the_families_command_lists_the_methods_that_fit():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rope_ext.cli", "families"], capture_output=True, text=True, check=True)
    t5 = next(line for line in out.stdout.splitlines() if line.startswith("t5 "))
    assert t5.split(None, 1)[1] == "hooks: bias, bucket; methods: alibi, kerple, sandwich, t5_bucket_extend, t5_bucket_scale"
