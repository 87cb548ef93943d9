"""XLNet: ``xlnet_interp`` and ``xlnet_clamp`` on tiny models built from configs. References: the sinusoid of
distances divided by hand (transformers' own ``positional_embedding``), and transformers' own ``clamp_len`` on a
model built with it."""

from __future__ import annotations

import pytest
import torch
from transformers import XLNetConfig, XLNetLMHeadModel, XLNetModel
from tiny import VOCAB, logits
from tiny import input_ids as ids

import rope_ext
from rope_ext.methods import XlnetClampConfig, make_config


def tiny_xlnet(seed: int = 0, **overrides) -> XLNetLMHeadModel:
    options = dict(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=48, dropout=0.0)
    options.update(overrides)
    torch.manual_seed(seed)
    model = XLNetLMHeadModel(XLNetConfig(**options)).eval()
    with torch.no_grad():  # (make the positions matter in a tiny random model)
        for layer in model.transformer.layer:
            layer.rel_attn.r.mul_(20)
    return model


def expected_encoding(model: XLNetModel, qlen: int, klen: int, divide: float, clamp: int | None = None, bsz: int = 1):
    """The relative encoding of ``klen .. -qlen + 1`` (attn_type bi) at distances divided by ``divide``, clamped."""
    inv_freq = 1 / torch.pow(10000, torch.arange(0, model.d_model, 2.0) / model.d_model)
    distances = torch.arange(klen, -qlen, -1.0) / divide
    if clamp is not None:
        distances = distances.clamp(-clamp, clamp)
    if not model.bi_data:
        return XLNetModel.positional_embedding(distances, inv_freq, bsz)
    backward = torch.arange(-klen, qlen, 1.0) / divide
    if clamp is not None:
        backward = backward.clamp(-clamp, clamp)
    half = bsz // 2
    return torch.cat([XLNetModel.positional_embedding(distances, inv_freq, half),
                      XLNetModel.positional_embedding(backward, inv_freq, half)], dim=1)


@pytest.mark.parametrize("bi_data", [False, True])
@pytest.mark.parametrize(("factor", "own_clamp"), [(4, None), (2.5, None), (4, 30)])
def test_interpolation_embeds_the_divided_distances(bi_data, factor, own_clamp):
    """With a clamp of the model's own, the distances are divided first and clamped after."""
    model = tiny_xlnet(bi_data=bi_data, clamp_len=own_clamp or -1)
    rope_ext.patch(model, f"xlnet_interp:factor={factor}")
    got = model.transformer.relative_positional_encoding(150, 150, bsz=2)
    torch.testing.assert_close(got, expected_encoding(model.transformer, 150, 150, factor, own_clamp, bsz=2),
                               rtol=0, atol=1e-6)
    rope_ext.unpatch(model)
    assert model.transformer.clamp_len == (own_clamp or -1) and "positional_embedding" not in vars(model.transformer)


def test_clamping_is_transformers_clamp_len(tmp_path):
    """Also written into the config (transformers' own field): a plain from_pretrained of the saved model clamps."""
    model = tiny_xlnet()
    reference = tiny_xlnet(clamp_len=40)
    reference.load_state_dict(model.state_dict())
    input_ids = ids(200)
    base = logits(model, input_ids)
    with rope_ext.patched(model, "xlnet_clamp:clamp_len=40"):
        assert torch.equal(logits(model, input_ids), logits(reference, input_ids))
        assert model.config.clamp_len == 40
        line = "  transformer.positional_embedding: xlnet_clamp(clamp_len=40) distances"
        assert rope_ext.summary(model).splitlines()[1] == line
        model.save_pretrained(tmp_path)
        with pytest.raises(RuntimeError, match=r"part of this model \('positional_embedding'\) is already patched"):
            rope_ext.patch(model.transformer, "xlnet_clamp:clamp_len=4")
    assert model.config.clamp_len == -1
    plain = XLNetLMHeadModel.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(plain, input_ids), logits(reference, input_ids))
    assert (logits(reference, input_ids) - base).abs().max() > 1e-5
    assert torch.equal(logits(model, input_ids), base)


def test_identity_settings_save_and_reload(tmp_path):
    model = tiny_xlnet()
    input_ids = ids(240)
    base = logits(model, input_ids)
    with rope_ext.patched(model, "xlnet_interp:factor=1"):
        assert torch.equal(logits(model, input_ids), base)
    with rope_ext.patched(model, "xlnet_clamp:clamp_len=1000"):  # (no distance reaches it)
        assert torch.equal(logits(model, input_ids), base)
    rope_ext.patch(model, "xlnet_interp:factor=3")
    patched = logits(model, input_ids)
    assert (patched - base).abs().max() > 1e-5
    assert rope_ext.summary(model).splitlines()[1] == (
        "  transformer.positional_embedding: xlnet_interp(factor=3) distances"
    )
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert type(restored) is XLNetLMHeadModel and rope_ext.get_patch(restored) == rope_ext.get_patch(model)
    assert torch.equal(logits(restored, input_ids), patched)
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, input_ids), base)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8", None])
def test_bad_clamp_lengths_are_refused(value):
    with pytest.raises(ValueError, match=rf"xlnet_clamp: clamp_len must be an int >= 1 .*got {value!r}"):
        make_config("xlnet_clamp", clamp_len=value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("yarn:factor=2", r"family 'xlnet' does not support; methods for xlnet: xlnet_clamp, xlnet_interp"),
        ("t5_bucket_scale:factor=2", r"needs a 'bucket' hook, which family 'xlnet' does not support"),
        ("xlnet_interp:factor=0.5", r"xlnet_interp: factor must be a number >= 1"),
        ("xlnet_interp:factor=2+xlnet_clamp:clamp_len=8", r"are both 'distance' methods"),
    ],
)
def test_bad_input_is_refused_and_the_model_untouched(spec, message):
    model = tiny_xlnet()
    input_ids = ids(50)
    base = logits(model, input_ids)
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, spec)
    assert rope_ext.get_patch(model) is None and model.transformer.clamp_len == -1
    assert torch.equal(logits(model, input_ids), base)
    rope_ext.patch(model, XlnetClampConfig(clamp_len=8))
    with pytest.raises(RuntimeError, match="already patched"):
        rope_ext.patch(model, "xlnet_interp:factor=2")
