"""vLLM's and SGLang's rotation from a config (rope_ext.serving.engines.vllm, .sglang): against the formulas written
out here, against transformers 5's ROPE_INIT_FUNCTIONS where the engines agree with it, and each known mismatch."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rope_ext.serving.engines import sglang, vllm

POSITIONS = torch.tensor([0, 1, 7, 100, 2047, 2048, 5000, 8191])
TOL = 1e-3  # float32 angles up to 8191 rad against float64 references
TOL_F32 = 1e-5  # the same float32 frequencies on both sides


def _config(rope=None, legacy=False, theta=1e4, **top):
    """A Llama text config: head_dim 64, trained 8192 (``top`` overrides); ``rope`` in ``rope_parameters`` with
    ``rope_theta``, or with ``legacy`` in ``rope_scaling`` (``type``) with a top-level ``rope_theta``."""
    config = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 2, "max_position_embeddings": 8192}
    config.update(top)
    if rope is None:
        config["rope_theta"] = theta
    elif legacy:
        rope = dict(rope)
        config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        config["rope_theta"] = theta
    else:
        config["rope_parameters"] = {"rope_theta": theta, **rope}
    return config


def _reference(inv_freq, positions=POSITIONS, scale=1.0):
    """``cos``/``sin`` of ``p f_i`` times ``scale`` in float64."""
    angles = positions.double()[:, None] * torch.as_tensor(inv_freq, dtype=torch.float64)[None, :]
    return angles.cos() * scale, angles.sin() * scale


def _float32(inv_freq, positions=POSITIONS, scale=1.0):
    """``cos``/``sin`` of float32 ``p f_i`` times ``scale``: a float32 cache row built from ``inv_freq``."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return (angles.cos() * scale).double(), (angles.sin() * scale).double()


def _hf(config, kind, seq_len=None):
    """transformers 5's ``(inv_freq, attention_factor)`` for ``config`` (a dict as above)."""
    keys = ("hidden_size", "num_attention_heads", "max_position_embeddings", "rope_parameters", "rope_scaling",
            "rope_theta", "partial_rotary_factor", "original_max_position_embeddings")
    return ROPE_INIT_FUNCTIONS[kind](LlamaConfig(**{k: config[k] for k in keys if k in config}), "cpu", seq_len)


def _close(rotation, cos, sin, atol=TOL):
    assert torch.allclose(rotation.cos, cos, atol=atol, rtol=0)
    assert torch.allclose(rotation.sin, sin, atol=atol, rtol=0)


def _yarn_freqs(dim, base, factor, original, truncate=True):
    """YaRN (Peng et al. 2023, eq. 17-19): ramp ends d(b) = d ln(L / (2 pi b)) / (2 ln base) at b = 32 and 1."""
    def d(rotations):
        return dim * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(base))
    low, high = d(32), d(1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    freqs = []
    for i in range(dim // 2):
        keep = 1 - min(1.0, max(0.0, (i - low) / (high - low)))
        theta = base ** (-2 * i / dim)
        freqs.append(theta * keep + theta / factor * (1 - keep))
    return freqs


def test_default_and_partial_rotary_factor():
    rotation = vllm.rotation(_config(theta=1e4), POSITIONS)
    _close(rotation, *_reference([1e4 ** (-2 * i / 64) for i in range(32)]))
    assert rotation.ignored == [] and rotation.max_length == 8192 and rotation.softmax_scale is None
    unstated = {k: v for k, v in _config().items() if k != "rope_theta"}  # transformers 5's default_theta
    for engine in (vllm, sglang):
        _close(engine.rotation(unstated, POSITIONS), rotation.cos, rotation.sin, atol=0)
    partial = vllm.rotation(_config({"rope_type": "default", "partial_rotary_factor": 0.5}), POSITIONS)
    assert partial.cos.shape == (len(POSITIONS), 16)
    _close(partial, *_reference([1e4 ** (-2 * i / 32) for i in range(16)]))
    assert sglang.rotation(_config(partial_rotary_factor=0.25), POSITIONS).cos.shape == (len(POSITIONS), 8)


def test_linear_divides_positions():
    config = _config({"rope_type": "linear", "factor": 4.0})
    rotation = vllm.rotation(config, POSITIONS)
    _close(rotation, *_reference([1e4 ** (-2 * i / 64) / 4 for i in range(32)]))
    inv, _ = _hf(config, "linear")
    _close(rotation, *_reference(inv.double()))
    assert rotation.max_length == 4 * 8192
    _close(sglang.rotation(config, POSITIONS), rotation.cos, rotation.sin, atol=0)


def test_ntk_is_su_fixed_and_mixed():
    fixed = vllm.rotation(_config({"rope_type": "ntk", "factor": 4.0}), POSITIONS)
    _close(fixed, *_reference([(4e4) ** (-2 * i / 64) / 4 ** (2 / 64) for i in range(32)]))
    mixed = vllm.rotation(_config({"rope_type": "ntk", "factor": 4.0, "mixed_b": 0.5}), POSITIONS)
    a = math.log(4.0) / 32 ** 0.5
    _close(mixed, *_reference([1e4 ** (-2 * i / 64) / math.exp(a * (i + 1) ** 0.5) for i in range(32)]))
    with pytest.raises(ValueError, match="yarn"):
        sglang.rotation(_config({"rope_type": "ntk", "factor": 4.0}), POSITIONS)


def test_dynamic_is_static_ntk_at_max_length():
    config = _config({"rope_type": "dynamic", "factor": 4.0})
    rotation = vllm.rotation(config, POSITIONS)
    base = 1e4 * (4 * 4 - 4 + 1) ** (64 / 62)
    _close(rotation, *_reference([base ** (-2 * i / 64) for i in range(32)]))
    at_max, _ = _hf(config, "dynamic", seq_len=4 * 8192)
    _close(rotation, *_float32(at_max), atol=1e-4)
    short, _ = _hf(config, "dynamic", seq_len=100)
    assert (rotation.cos - _reference(short.double())[0]).abs().max() > 0.1
    assert any("static NTK" in note for note in rotation.notes) and rotation.max_length == 4 * 8192
    alpha = vllm.rotation(_config({"rope_type": "dynamic", "alpha": 2.0, "factor": 4.0}), POSITIONS)
    _close(alpha, *_reference([(1e4 * 2 ** (64 / 62)) ** (-2 * i / 64) for i in range(32)]))
    assert alpha.ignored == ["rope_parameters.factor: alpha is stated: DynamicNTKAlphaRotaryEmbedding uses alpha only"]


def _yarn_config(**rope):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, **rope}
    return _config(rope, theta=1e5, max_position_embeddings=32768)


def test_yarn_against_formula_and_transformers():
    config = _yarn_config()
    rotation = vllm.rotation(config, POSITIONS)
    mscale = 0.1 * math.log(4) + 1
    _close(rotation, *_reference(_yarn_freqs(64, 1e5, 4.0, 8192), scale=mscale))
    inv, attention = _hf(config, "yarn")
    assert attention == pytest.approx(mscale)
    _close(rotation, *_float32(inv, scale=attention), atol=TOL_F32)
    assert rotation.ignored == [] and rotation.max_length == 4 * 8192
    _close(sglang.rotation(config, POSITIONS), rotation.cos, rotation.sin, atol=0)


def test_yarn_attention_factor_is_dropped():
    config = _yarn_config(attention_factor=1.0)
    _, attention = _hf(config, "yarn")
    assert attention == 1.0
    for engine in (vllm, sglang):
        rotation = engine.rotation(config, POSITIONS)
        assert rotation.cos[0, 0] == pytest.approx(0.1 * math.log(4) + 1, abs=1e-6)
        assert [line.split(":")[0] for line in rotation.ignored] == ["rope_parameters.attention_factor"]


def test_yarn_mscale_pair_read_by_sglang_only():
    config = _yarn_config(factor=16.0, mscale=1.0, mscale_all_dim=1.0)
    _, attention = _hf(config, "yarn")
    assert attention == pytest.approx(1.0)
    served = vllm.rotation(config, POSITIONS)
    assert served.cos[0, 0] == pytest.approx(0.1 * math.log(16) + 1, abs=1e-6)
    assert {line.split(":")[0] for line in served.ignored} == {"rope_parameters.mscale",
                                                                 "rope_parameters.mscale_all_dim"}
    other = sglang.rotation(_yarn_config(factor=16.0, mscale=1.0, mscale_all_dim=0.5), POSITIONS)
    assert other.cos[0, 0] == pytest.approx((0.1 * math.log(16) + 1) / (0.05 * math.log(16) + 1), abs=1e-6)
    assert sglang.rotation(config, POSITIONS).ignored == []


def test_yarn_truncate_and_vllm_only_keys():
    config = _yarn_config(truncate=False)
    rotation = vllm.rotation(config, POSITIONS)
    inv, attention = _hf(config, "yarn")
    _close(rotation, *_float32(inv, scale=attention), atol=TOL_F32)
    _close(rotation, *_reference(_yarn_freqs(64, 1e5, 4.0, 8192, truncate=False), scale=attention))
    assert (rotation.cos - vllm.rotation(_yarn_config(), POSITIONS).cos).abs().max() > 1e-3
    plain = vllm.rotation(_yarn_config(attn_factor=2.0, apply_yarn_scaling=False), POSITIONS)
    assert plain.cos[0, 0] == pytest.approx(2.0)
    extrapolated = vllm.rotation(_yarn_config(extrapolation_factor=0.0), POSITIONS)
    _close(extrapolated, *_reference([1e5 ** (-2 * i / 64) / 4 for i in range(32)], scale=0.1 * math.log(4) + 1))
    assert "apply_yarn_scaling" in sglang.rotation(_yarn_config(apply_yarn_scaling=False), POSITIONS).ignored[0]


def _deepseek(**rope):
    rope = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, **rope}
    return _config(rope, model_type="deepseek_v3", qk_rope_head_dim=64, qk_nope_head_dim=128,
                   max_position_embeddings=163840)


def test_deepseek_reaches_deepseek_yarn():
    config = _deepseek(mscale=1.0, mscale_all_dim=0.5, truncate=False)
    rotation = vllm.rotation(config, POSITIONS)
    ratio = (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1)
    _close(rotation, *_reference(_yarn_freqs(64, 1e4, 40.0, 4096), scale=ratio))
    assert rotation.softmax_scale == pytest.approx(192 ** -0.5 * (0.05 * math.log(40) + 1) ** 2)
    assert [line.split(":")[0] for line in rotation.ignored] == ["rope_parameters.truncate"]
    assert rotation.max_length == 40 * 4096
    assert vllm.rotation(_deepseek(apply_yarn_scaling=False), POSITIONS).softmax_scale is None
    assert sglang.rotation(_deepseek(apply_yarn_scaling=False), POSITIONS).softmax_scale is not None
    assert sglang.rotation(config, POSITIONS).max_length == 163840


def test_llama3_matches_transformers():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    config = _config(rope, theta=5e5, max_position_embeddings=131072)
    rotation = vllm.rotation(config, POSITIONS)
    inv, _ = _hf(config, "llama3")
    _close(rotation, *_float32(inv), atol=TOL_F32)
    assert rotation.max_length == 131072
    _close(sglang.rotation(config, POSITIONS), rotation.cos, rotation.sin, atol=0)
    del config["rope_parameters"]["high_freq_factor"]  # SGLang warns and takes 4, vLLM's get_rope needs the key
    missing = sglang.rotation(config, POSITIONS)
    _close(missing, rotation.cos, rotation.sin, atol=0)
    assert any("no high_freq_factor" in note for note in missing.notes)
    with pytest.raises(KeyError):
        vllm.rotation(config, POSITIONS)


def _longrope(**top):
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [1.0 + i / 8 for i in range(32)],
            "factor": 32.0}
    return _config(rope, max_position_embeddings=131072, original_max_position_embeddings=4096, **top)


def test_longrope_factor_choice():
    config = _longrope()
    mscale = math.sqrt(1 + math.log(32) / math.log(4096))
    short = [1e4 ** (-2 * i / 64) for i in range(32)]
    long = [1e4 ** (-2 * i / 64) / (1 + i / 8) for i in range(32)]
    served = vllm.rotation(config, POSITIONS)
    assert served.max_length == 4096
    _close(served, *_reference(short, scale=mscale))
    extended = vllm.rotation(config, POSITIONS, max_model_len=131072)
    _close(extended, *_reference(long, scale=mscale))
    inv, attention = _hf(config, "longrope", seq_len=101)
    _close(served, *_float32(inv, scale=mscale), atol=TOL_F32)
    assert attention == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert [line.split(":")[0] for line in served.ignored] == ["rope_parameters.factor"]
    batch = torch.tensor([0, 100, 5000])
    _close(sglang.rotation(config, batch), *_reference(long, batch, scale=mscale))
    _close(sglang.rotation(config, batch[:2]), *_reference(short, batch[:2], scale=mscale))
    edge = sglang.rotation(config, torch.tensor([4096]))
    assert edge.cos[0, 5] == pytest.approx(mscale) and edge.sin.abs().max() == 0
    stated = _longrope()
    stated["rope_parameters"]["short_mscale"] = 1.0
    for engine in (vllm, sglang):
        assert engine.rotation(stated, batch[:2]).cos[0, 0] == pytest.approx(1.0)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "attention_factor": 1.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    {"rope_type": "linear", "factor": 2.0},
])
def test_legacy_layout_reads_the_same(rope):
    for engine in (vllm, sglang):
        new = engine.rotation(_config(rope, theta=1e5, max_position_embeddings=32768), POSITIONS)
        old = engine.rotation(_config(rope, legacy=True, theta=1e5, max_position_embeddings=32768), POSITIONS)
        assert torch.equal(new.cos, old.cos) and torch.equal(new.sin, old.sin)
        assert (new.max_length, new.softmax_scale) == (old.max_length, old.softmax_scale)
        assert [line.split(".", 1)[1] for line in new.ignored] == [line.split(".", 1)[1] for line in old.ignored]
        assert all(line.startswith("rope_scaling.") for line in old.ignored)


@pytest.mark.parametrize(("rope", "top", "served_vllm", "served_sglang"), [
    (None, {}, 40960, 40960),
    ({"rope_type": "linear", "factor": 4.0}, {}, 4 * 40960, 4 * 40960),
    ({"rope_type": "dynamic", "factor": 4.0}, {}, 4 * 40960, 4 * 40960),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, {}, 131072, 40960),
    ({"rope_type": "yarn", "factor": 4.0}, {}, 4 * 40960, 40960),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, {}, 40960, 40960),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}, {}, 40960, 40960),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32},
     {"original_max_position_embeddings": 4096}, 4096, 40960),
    (None, {"seq_length": 4096}, 4096, 4096),
])
def test_max_length_per_rope_type(rope, top, served_vllm, served_sglang):
    config = _config(rope, max_position_embeddings=40960, **top)
    assert vllm.rotation(config, POSITIONS[:1]).max_length == served_vllm
    assert sglang.rotation(config, POSITIONS[:1]).max_length == served_sglang


def test_unknown_type_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_yarn.*longrope"):
        vllm.rotation(_config({"rope_type": "nope"}), POSITIONS)
    with pytest.raises(ValueError, match="proportional"):
        sglang.rotation(_config({"rope_type": "nope"}), POSITIONS)


def test_dual_chunk_attention():
    dca = {"chunk_size": 8192, "local_size": 1024, "original_max_position_embeddings": 262144}
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    config = _config(rope, model_type="qwen2", dual_chunk_attention_config=dca, max_position_embeddings=32768)
    positions = torch.tensor([0, 5, 7167, 7168, 7170, 20000])
    for engine in (vllm, sglang):
        rotation = engine.rotation(config, positions)
        _close(rotation, *_reference([1e4 ** (-2 * i / 64) for i in range(32)], positions % 7168))
        keys = {line.split(":")[0] for line in rotation.ignored}
        assert {"rope_parameters.factor", "dual_chunk_attention_config.original_max_position_embeddings"} <= keys
        assert any("chunk_len = chunk_size - local_size = 7168" in note for note in rotation.notes)
    plain = vllm.rotation(_config(rope, dual_chunk_attention_config=dca, max_position_embeddings=32768), positions)
    assert any("dual_chunk_attention_config: read only" in note for note in plain.notes)
