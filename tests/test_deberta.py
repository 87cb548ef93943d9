"""DeBERTa-v2/v3: ``deberta_bucket_scale`` and ``deberta_bucket_stretch`` on tiny models built from configs. The
reference for every position is transformers' own ``make_log_bucket_position``; the hand-computed points are
written out with the formula they come from."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForMaskedLM, DebertaV2Config
from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position
from tiny import VOCAB, logits
from tiny import input_ids as ids

import rope_ext
from rope_ext.methods import DebertaBucketScaleConfig, DebertaBucketStretchConfig, deberta_log_bucket, make_config

DISTANCES = torch.arange(-6000, 6001)


def tiny_deberta(seed: int = 0, **overrides):
    """DeBERTa-v3-like (no absolute table, shared attention keys, log buckets), 16 buckets over 64 positions."""
    options = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        relative_attention=True, position_buckets=16, max_relative_positions=64, pos_att_type=["p2c", "c2p"],
        position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    options.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForMaskedLM.from_config(DebertaV2Config(**options)).eval()
    with torch.no_grad():  # (make the positions matter in a tiny random model)
        if options["relative_attention"]:
            model.deberta.encoder.rel_embeddings.weight.normal_(0, 1.0)
        for layer in model.deberta.encoder.layer:
            layer.attention.self.query_proj.weight.mul_(8)
            layer.attention.self.key_proj.weight.mul_(8)
    return model


@pytest.mark.parametrize(("buckets", "reach"), [(256, 512), (16, 64), (32, 128), (64, 100)])
def test_the_plain_log_buckets_are_transformers_on_every_distance(buckets, reach):
    expected = make_log_bucket_position(DISTANCES, buckets, reach)
    assert torch.equal(deberta_log_bucket(DISTANCES, buckets, reach), expected)
    for config in (DebertaBucketScaleConfig(factor=1), DebertaBucketStretchConfig(factor=1)):  # identity settings
        assert torch.equal(config.positions(DISTANCES, buckets, reach), expected.long())


@pytest.mark.parametrize("factor", [1.5, 2, 4, 7.3])
def test_scaling_buckets_the_distance_divided_by_the_factor(factor):
    scaled = torch.sign(DISTANCES) * torch.div(DISTANCES.abs() * 10, int(factor * 10), rounding_mode="floor")
    expected = make_log_bucket_position(scaled, 256, 512).long()
    assert torch.equal(DebertaBucketScaleConfig(factor=factor).positions(DISTANCES, 256, 512), expected)
    assert torch.equal(DebertaBucketScaleConfig(factor=factor).positions(DISTANCES, -1, 512), scaled)  # no buckets


def test_hand_computed_positions():
    """v3's 256 buckets over 512: mid 128, r > 128 -> sign (128 + ceil(ln(r/128) / ln(511/128) * 127))."""
    rel = torch.tensor([2044, 200, -200, 100, 4000, -3, 7, 800, -800])
    # stretched x4: P' - 1 = 2044: 2044 -> 255; 200 -> 128 + ceil(ln(1.5625)/ln(15.97) * 127 = 20.46) = 149;
    # 4000 -> 128 + ceil(157.77) = 286 (the attention clamps it to 255)
    assert DebertaBucketStretchConfig(factor=4).positions(rel, 256, 512).tolist()[:5] == [255, 149, -149, 100, 286]
    # scaled x4: 800 -> 200 -> 128 + ceil(ln(1.5625)/ln(3.992) * 127 = 40.94) = 169; -3 -> 0, 7 -> 1
    assert DebertaBucketScaleConfig(factor=4).positions(rel, 256, 512).tolist()[5:] == [0, 1, 169, -169]
    # unpatched: 800 -> 128 + ceil(168.12)
    assert make_log_bucket_position(torch.tensor([200, 800]), 256, 512).tolist() == [169, 128 + 169]


@pytest.mark.parametrize("method", ["deberta_bucket_scale", "deberta_bucket_stretch"])
@pytest.mark.parametrize("options", [{"factor": 0.5}, {"factor": 0}, {"factor": float("inf")}, {}])
def test_bad_factors_are_refused(method, options):
    with pytest.raises(ValueError, match=rf"{method}: factor (must be|is required)"):
        make_config(method, **options)


def test_identity_settings_give_the_original_logits_and_unpatch_is_bit_exact():
    model = tiny_deberta()
    input_ids = ids(300)
    base = logits(model, input_ids)
    for spec in ("deberta_bucket_scale:factor=1", "deberta_bucket_stretch:factor=1"):
        with rope_ext.patched(model, spec):
            assert torch.equal(logits(model, input_ids), base), spec
    rope_ext.patch(model, "deberta_bucket_stretch:factor=4")
    assert (logits(model, input_ids) - base).abs().max() > 1e-5
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, input_ids), base)
    assert "get_rel_pos" not in vars(model.deberta.encoder)


@pytest.mark.parametrize("spec", ["deberta_bucket_scale:factor=3", "deberta_bucket_stretch:factor=3"])
def test_both_disentangled_terms_read_the_remapped_positions(spec):
    """The patched model equals the unpatched one given, through the encoder's own ``relative_pos`` argument,
    transformers' buckets of the remapped distances: content-to-position and position-to-content both follow."""
    model = tiny_deberta()
    input_ids = ids(260)
    rel = torch.arange(260)[:, None] - torch.arange(260)[None]
    if "scale" in spec:
        expected = make_log_bucket_position(torch.sign(rel) * torch.div(rel.abs(), 3, rounding_mode="floor"), 16, 64)
    else:
        expected = make_log_bucket_position(rel, 16, 3 * 63 + 1)

    def give_positions(module, args, kwargs):
        kwargs["relative_pos"] = expected.long()[None]
        return args, kwargs

    handle = model.deberta.encoder.register_forward_pre_hook(give_positions, with_kwargs=True)
    reference = logits(model, input_ids)
    handle.remove()
    with rope_ext.patched(model, spec):
        assert torch.equal(logits(model, input_ids), reference)
    for attention_type in (["c2p"], ["p2c"]):  # each term alone moves with the method
        single = tiny_deberta(pos_att_type=attention_type)
        base = logits(single, input_ids)
        with rope_ext.patched(single, spec):
            assert (logits(single, input_ids) - base).abs().max() > 1e-5, attention_type


def test_a_padded_batch_row_equals_the_row_alone_and_save_reload(tmp_path):
    model = tiny_deberta()
    rope_ext.patch(model, "deberta_bucket_stretch:factor=4")
    long, short = ids(220), ids(150, seed=3)
    batch = torch.zeros(2, 220, dtype=torch.long)
    batch[0], batch[1, :150] = long[0], short[0]
    mask = (torch.arange(220)[None] < torch.tensor([[220], [150]])).long()
    padded = logits(model, batch, attention_mask=mask)
    torch.testing.assert_close(padded[1:, :150], logits(model, short), rtol=0, atol=1e-5)
    torch.testing.assert_close(padded[:1], logits(model, long), rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert type(restored) is type(model) and rope_ext.get_patch(restored) == rope_ext.get_patch(model)
    assert torch.equal(logits(restored, long), logits(model, long))


@pytest.mark.parametrize(
    ("overrides", "spec", "message"),
    [
        ({}, "yarn:factor=4", r"family 'deberta_v2' does not support; methods for deberta_v2: deberta_bucket_scale, "
                              r"deberta_bucket_stretch"),
        ({}, "t5_bucket_scale:factor=4", r"needs a 'bucket' hook, which family 'deberta_v2' does not support"),
        ({}, "deberta_bucket_stretch:factor=0.5", r"factor must be a number >= 1"),
        ({"position_buckets": -1}, "deberta_bucket_stretch:factor=4",
         r"deberta_bucket_stretch: this deberta_v2 model has no log buckets \(position_buckets=-1\)"
         r".*use deberta_bucket_scale"),
        ({"position_biased_input": True}, "deberta_bucket_scale:factor=4",
         r"adds an absolute position table too \(position_biased_input=True, 64 rows\)"),
        ({"relative_attention": False}, "deberta_bucket_scale:factor=4", r"has no relative attention"),
    ],
)
def test_bad_input_is_refused_and_the_model_untouched(overrides, spec, message):
    model = tiny_deberta(**overrides)
    input_ids = ids(60)
    base = logits(model, input_ids)
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, spec)
    assert rope_ext.get_patch(model) is None and "get_rel_pos" not in vars(model.deberta.encoder)
    assert torch.equal(logits(model, input_ids), base)


def test_a_deberta_method_on_t5_names_what_fits():
    from test_t5 import tiny_t5

    fits = r"which family 't5' does not support; methods for t5: alibi, kerple, sandwich, t5_bucket_extend"
    with pytest.raises(ValueError, match=fits):
        rope_ext.patch(tiny_t5(), "deberta_bucket_scale:factor=2")


@pytest.mark.parametrize("pos_att_type", [[], None])
def test_a_model_whose_attention_reads_no_positions_is_refused(pos_att_type):
    model = tiny_deberta(pos_att_type=pos_att_type)
    with pytest.raises(ValueError, match=r"deberta_v2: this model's attention reads no relative positions"):
        rope_ext.patch(model, "deberta_bucket_scale:factor=2")


def test_a_part_of_a_patched_deberta_is_refused():
    model = tiny_deberta()
    rope_ext.patch(model, "deberta_bucket_scale:factor=4")
    with pytest.raises(RuntimeError, match=r"part of this model \('encoder.get_rel_pos'\) is already patched"):
        rope_ext.patch(model.deberta, "deberta_bucket_stretch:factor=4")
    assert rope_ext.get_patch(model) == DebertaBucketScaleConfig(factor=4)
    rope_ext.unpatch(model)
    with pytest.raises(ValueError, match=r"deberta_v2: patch the whole model, not its DebertaV2Encoder"):
        rope_ext.patch(model.deberta.encoder, "deberta_bucket_scale:factor=4")
