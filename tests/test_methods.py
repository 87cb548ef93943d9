"""Pure-math tests: each method's defining property, identity settings, validation and its reference."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rope_ext.methods import (
    DualChunkConfig,
    MethodConfig,
    RotarySpec,
    YarnConfig,
    get_method_class,
    list_methods,
    make_config,
    make_configs,
    register_method,
    undocumented,
    unregister_method,
)

#: the frequency methods (the attention-rewrite ones are tested in test_attention.py)
FREQUENCY_METHODS = [m for m in list_methods() if get_method_class(m).hook == "frequency"]
from rope_ext.methods.frequency import (
    DynamicFrequencyConfig,
    FrequencyConfig,
    default_inv_freq,
    dynamic_scale,
    ntk_base,
)
from rope_ext.methods.options import meaning_of, option, positive

SPEC = RotarySpec(base=10000.0, dim=64, original_max_position_embeddings=2048)
LONG_FACTOR = [1.0 + i / 8 for i in range(32)]


def config_for(method: str, factor: float = 4.0, **extra) -> MethodConfig:
    if method == "longrope":
        extra.setdefault("long_factor", [factor] * 32)
    return make_config(method, factor=factor, **extra)


def identity_config(method: str) -> MethodConfig:
    if method == "longrope":
        return make_config(method, factor=1.0, long_factor=[1.0] * 32)
    return make_config(method, factor=1.0)


def hf_config(**rope) -> LlamaConfig:
    """A Llama config whose RoPE matches SPEC, with transformers' own scaling ``rope``."""
    return LlamaConfig(
        hidden_size=64 * 4,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=SPEC.original_max_position_embeddings,
        rope_parameters={"rope_theta": SPEC.base, **rope},
    )


@pytest.mark.parametrize("method", FREQUENCY_METHODS)
def test_identity_setting_keeps_default_frequencies(method):
    lengths = [None, 1000, SPEC.original_max_position_embeddings]
    if method not in ("dynamic_ntk", "dynamic_yarn", "longrope"):
        lengths.append(50_000)  # static methods at factor 1 are the identity at every length
    for seq_len in lengths:
        inv_freq, attention_factor = identity_config(method).frequencies(SPEC, seq_len)
        assert torch.equal(inv_freq, default_inv_freq(SPEC.base, SPEC.dim)), (method, seq_len)
        assert attention_factor == 1.0


@pytest.mark.parametrize("method", ["dynamic_ntk", "dynamic_yarn", "longrope"])
def test_length_dependent_methods_are_identity_inside_original_window(method):
    config = config_for(method, 8.0)
    # LongRoPE scales attention by sqrt(1 + ln s / ln L) at every length (transformers does too); the others by 1
    expected_factor = math.sqrt(1 + math.log(8.0) / math.log(SPEC.original_max_position_embeddings))
    if method != "longrope":
        expected_factor = 1.0
    for seq_len in (1, 100, SPEC.original_max_position_embeddings):
        inv_freq, attention_factor = config.frequencies(SPEC, seq_len)
        assert torch.equal(inv_freq, default_inv_freq(SPEC.base, SPEC.dim))
        assert attention_factor == pytest.approx(expected_factor, rel=1e-12)
    scaled, _ = config.frequencies(SPEC, 4 * SPEC.original_max_position_embeddings)
    assert not torch.equal(scaled, default_inv_freq(SPEC.base, SPEC.dim))


def test_pi_divides_positions_by_factor():
    config = make_config("pi", factor=4.0)
    inv_freq, _ = config.frequencies(SPEC)
    positions = torch.arange(0, 8192, 7, dtype=torch.float32)
    scaled_angles = positions[:, None] * inv_freq
    reference_angles = (positions / 4.0)[:, None] * default_inv_freq(SPEC.base, SPEC.dim)
    torch.testing.assert_close(scaled_angles, reference_angles, rtol=1e-6, atol=1e-5)


def test_ntk_keeps_highest_frequency_and_divides_lowest_by_factor():
    factor = 8.0
    inv_freq, attention_factor = make_config("ntk", factor=factor).frequencies(SPEC)
    default = default_inv_freq(SPEC.base, SPEC.dim)
    assert inv_freq[0] == default[0] == 1.0
    # lowest frequency of the extended base is the lowest of the old one divided by ~factor
    lowest_ratio = default[-1] / inv_freq[-1]
    assert lowest_ratio.item() == pytest.approx(factor, rel=1e-4)
    assert torch.all(inv_freq <= default)
    assert attention_factor == 1.0


@pytest.mark.parametrize("method", ["yarn", "ntk_by_parts", "llama3"])
def test_high_frequencies_untouched_low_frequencies_interpolated(method):
    factor = 16.0
    inv_freq, _ = config_for(method, factor).frequencies(SPEC)
    default = default_inv_freq(SPEC.base, SPEC.dim)
    wavelength = 2 * math.pi / default
    fast = wavelength < SPEC.original_max_position_embeddings / 32  # > 32 turns in the window
    slow = wavelength > SPEC.original_max_position_embeddings  # < 1 turn in the window
    assert fast.any() and slow.any()
    assert torch.equal(inv_freq[fast], default[fast])
    torch.testing.assert_close(inv_freq[slow], default[slow] / factor)
    assert torch.all(inv_freq <= default) and torch.all(inv_freq >= default / factor * (1 - 1e-6))


def test_yarn_attention_temperature():
    assert make_config("yarn", factor=4.0).frequencies(SPEC)[1] == pytest.approx(0.1 * math.log(4) + 1)
    assert make_config("ntk_by_parts", factor=4.0).frequencies(SPEC)[1] == 1.0
    assert make_config("yarn", factor=4.0, attention_factor=1.3).frequencies(SPEC)[1] == 1.3
    both = make_config("yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0).frequencies(SPEC)[1]
    assert both == pytest.approx(1.0)


def test_dynamic_scale_follows_length():
    assert dynamic_scale(1.0, 4096, 2048) == 2.0
    assert dynamic_scale(2.0, 4096, 2048) == 3.0
    assert dynamic_scale(2.0, 1024, 2048) == 1.0


def test_longrope_switches_factor_lists_and_scales_attention():
    config = make_config("longrope", factor=4.0, long_factor=LONG_FACTOR, short_factor=[1.0] * 32)
    short, attention = config.frequencies(SPEC, SPEC.original_max_position_embeddings)
    long, _ = config.frequencies(SPEC, SPEC.original_max_position_embeddings + 1)
    default = default_inv_freq(SPEC.base, SPEC.dim)
    torch.testing.assert_close(short, default)
    torch.testing.assert_close(long, default / torch.tensor(LONG_FACTOR))
    assert attention == pytest.approx(math.sqrt(1 + math.log(4) / math.log(2048)))


# --- agreement with transformers' built-in functions (the references) ---------------------------------


def _native(rope: dict, seq_len: int | None = None):
    config = hf_config(**rope)
    if config.rope_parameters["rope_type"] == "default":  # (computed by the rotary module in transformers 5)
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=seq_len)


@pytest.mark.parametrize("factor", [1.5, 2.0, 4.0, 16.0])
def test_frequencies_match_transformers_builtins(factor):
    original = SPEC.original_max_position_embeddings
    cases = [
        ("pi", {}, {"rope_type": "linear", "factor": factor}, None),
        ("yarn", {}, {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}, None),
        (
            "yarn",
            {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
            {
                "rope_type": "yarn",
                "factor": factor,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
                "original_max_position_embeddings": original,
            },
            None,
        ),
        (
            "ntk_by_parts",
            {},
            {"rope_type": "yarn", "factor": factor, "attention_factor": 1.0, "original_max_position_embeddings": original},
            None,
        ),
        (
            "llama3",
            {},
            {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": original,
            },
            None,
        ),
        ("dynamic_ntk", {}, {"rope_type": "dynamic", "factor": factor}, 3 * original),
        (
            "longrope",
            {"long_factor": LONG_FACTOR},
            {
                "rope_type": "longrope",
                "factor": factor,
                "long_factor": LONG_FACTOR,
                "short_factor": [1.0] * 32,
                "original_max_position_embeddings": original,
            },
            3 * original,
        ),
    ]
    for method, options, rope, seq_len in cases:
        ours, our_attention = make_config(method, factor=factor, **options).frequencies(SPEC, seq_len)
        theirs, their_attention = _native(rope, seq_len)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0, msg=method)
        assert our_attention == pytest.approx(their_attention, rel=1e-12), method


@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_ntk_is_default_rope_with_the_ntk_base(factor):
    ours, _ = make_config("ntk", factor=factor).frequencies(SPEC)
    config = hf_config()
    config.rope_parameters["rope_theta"] = ntk_base(SPEC.base, SPEC.dim, factor)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seq_len", [3000, 8192, 20000])
def test_dynamic_yarn_is_yarn_at_the_current_scale(seq_len):
    original = SPEC.original_max_position_embeddings
    ours, our_attention = make_config("dynamic_yarn").frequencies(SPEC, seq_len)
    scale = seq_len / original
    theirs, their_attention = _native(
        {"rope_type": "yarn", "factor": scale, "original_max_position_embeddings": original}
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert our_attention == pytest.approx(their_attention)


# --- configs: validation, round trip, parsing ----------------------------------------------------------


@pytest.mark.parametrize("method", FREQUENCY_METHODS)
def test_config_round_trips_through_dict(method):
    config = config_for(method, 3.0)
    data = config.to_dict()
    assert data["method"] == method
    assert MethodConfig.from_dict(data) == config
    import json

    assert MethodConfig.from_dict(json.loads(json.dumps(data))) == config


@pytest.mark.parametrize("method", FREQUENCY_METHODS)
@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), float("inf")])
def test_bad_factor_is_rejected_with_valid_range(method, factor):
    with pytest.raises(ValueError, match=r"factor must be a number >= 1 and <= 1e6 \(the context is extended factor times"):
        config_for(method, factor)


def test_unknown_method_lists_valid_methods():
    with pytest.raises(ValueError, match=r"unknown method 'yarnn'; valid methods: abs_hierarchical, abs_interp, alibi, dca, deberta_bucket_scale, deberta_bucket_stretch, dynamic_ntk, .*yarn"):
        make_config("yarnn")


def test_unknown_option_lists_valid_options():
    with pytest.raises(ValueError, match=r"yarn: unknown option\(s\) betafast; valid options: factor, "):
        make_config("yarn", factor=2.0, betafast=3)


@pytest.mark.parametrize("method", ["yarn", "ntk_by_parts", "dynamic_yarn"])
def test_beta_fast_must_exceed_beta_slow(method):
    with pytest.raises(ValueError, match=r"beta_fast must be > beta_slow"):
        make_config(method, factor=2.0, beta_fast=1.0, beta_slow=2.0)


def test_llama3_band_order():
    with pytest.raises(ValueError, match=r"high_freq_factor must be > low_freq_factor"):
        make_config("llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)


def test_longrope_needs_long_factor_of_the_right_length():
    with pytest.raises(ValueError, match=r"long_factor is required"):
        make_config("longrope", factor=4.0)
    config = make_config("longrope", factor=4.0, long_factor=[2.0] * 5)
    with pytest.raises(ValueError, match=r"long_factor has 5 entries.*needs exactly 32"):
        config.frequencies(SPEC, 10_000)
    with pytest.raises(ValueError, match=r"every long_factor entry must be a finite number > 0"):
        make_config("longrope", factor=4.0, long_factor=[1.0, -2.0])


def test_bad_original_context_length():
    with pytest.raises(ValueError, match=r"original_max_position_embeddings must be an int >= 2, got 0"):
        make_config("yarn", factor=2.0, original_max_position_embeddings=0)


# --- every option's bad values, with the whole message (mutation testing reads these as the validation's spec) ---


@pytest.mark.parametrize(
    "method,options,message",
    [
        ("yarn", {}, "yarn: factor is required (the context is extended factor times, e.g. yarn:factor=4 for 4x; "
                     "factor 1 is the identity)"),
        ("pi", {"factor": 0.5}, "pi: factor must be a number >= 1 and <= 1e6 (the context is extended factor times; 1 is the "
                                "identity), got 0.5; a factor below 1 would shrink the context"),
        ("pi", {"factor": 2.0, "original_max_position_embeddings": 32},
         "pi: original_max_position_embeddings has no effect (PI divides every position by factor, whatever the "
         "original length); leave it unset"),
        ("longrope", {"factor": 2.0}, "longrope: long_factor is required: a list of rotary_dim / 2 positive floats "
                                      "(one per frequency, e.g. from a LongRoPE search or a Phi-3 config)"),
        ("longrope", {"factor": 2.0, "long_factor": []},
         "longrope: long_factor must be a non-empty list of floats, got []"),
        ("longrope", {"factor": 2.0, "long_factor": 2.0},
         "longrope: long_factor must be a non-empty list of floats, got 2.0"),
        ("longrope", {"factor": 2.0, "long_factor": [1.0], "short_factor": []},
         "longrope: short_factor must be a non-empty list of floats, got []"),
        ("yarn", {"factor": 2.0, "mscale": 1.0}, "yarn: set both mscale and mscale_all_dim, or neither"),
        ("rerope", {"w": 0}, "rerope: w must be an int >= 1, got 0"),
        ("rerope", {"w": True}, "rerope: w must be an int >= 1, got True"),
        ("rerope", {"w": 2.5}, "rerope: w must be an int >= 1, got 2.5"),
        ("string", {"S": 1}, "string: S must be an int >= 2, got 1"),
        ("self_extend", {"G": None}, "self_extend: G must be an int >= 1, got None"),
        ("leaky_rerope", {"k": 0.5}, "leaky_rerope: k (the slope beyond the window) must be a finite number >= 1, "
                                     "got 0.5"),
        ("leaky_rerope", {"k": True}, "leaky_rerope: k (the slope beyond the window) must be a finite number >= 1, got True"),
        ("leaky_rerope", {"k": "2"}, "leaky_rerope: k (the slope beyond the window) must be a finite number >= 1, got '2'"),
        ("leaky_rerope", {"k": float("inf")}, "leaky_rerope: k (the slope beyond the window) must be a finite number >= 1, got inf"),
        ("dca", {"chunk_size": 1}, "dca: chunk_size must be an int >= 2, got 1"),
        ("self_extend", {"W": 0}, "self_extend: W must be an int >= 1, got 0"),
        ("string", {"W": 0}, "string: W must be an int >= 1, got 0"),
        ("dca", {"local_window": 0}, "dca: local_window must be an int >= 1, got 0"),
        ("dca", {"scale_queries": 1}, "dca: scale_queries must be True or False, got 1"),
        ("yarn", {"factor": 2.0, "beta_fast": 0}, "yarn: beta_fast must be a finite number > 0, got 0"),
        ("yarn", {"factor": 2.0, "beta_slow": -1.0}, "yarn: beta_slow must be a finite number > 0, got -1.0"),
        ("yarn", {"factor": 2.0, "truncate": 1}, "yarn: truncate must be True or False, got 1"),
        ("yarn", {"factor": 2.0, "attention_factor": 0}, "yarn: attention_factor must be a finite number > 0, got 0"),
        ("yarn", {"factor": 2.0, "mscale": 0, "mscale_all_dim": 1.0}, "yarn: mscale must be a finite number > 0, got 0"),
        ("yarn", {"factor": 2.0, "mscale": 1.0, "mscale_all_dim": "x"}, "yarn: mscale_all_dim must be a finite number > 0, got 'x'"),
        ("yarn", {"factor": 2.0, "attention_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, "yarn: give attention_factor or mscale/mscale_all_dim, not both"),
        ("llama3", {"factor": 2.0, "low_freq_factor": 0}, "llama3: low_freq_factor must be a finite number > 0, got 0"),
        ("llama3", {"factor": 2.0, "high_freq_factor": float("nan")}, "llama3: high_freq_factor must be a finite number > 0, got nan"),
        ("longrope", {"factor": 2.0, "long_factor": [1.0, 0.0]}, "longrope: every long_factor entry must be a finite number > 0, got 0.0"),
        ("longrope", {"factor": 2.0, "long_factor": [1.0], "attention_factor": -1}, "longrope: attention_factor must be a finite number > 0, got -1"),
        ("dynamic_ntk", {"factor": 2.0, "cache_consistent": "yes"}, "dynamic_ntk: cache_consistent must be True or False, got 'yes'"),
        ("yarn", {"factor": 0}, "yarn: factor must be a number >= 1 and <= 1e6 (the context is extended factor times; 1 is the "
                                "identity), got 0; a factor below 1 would shrink the context"),
        ("yarn", {"factor": 2.0, "original_max_position_embeddings": 1}, "yarn: original_max_position_embeddings must be an int >= 2, got 1"),
    ],
)
def test_bad_option_values_give_the_whole_message(method, options, message):
    with pytest.raises(ValueError) as error:
        make_config(method, **options)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "method,options,original,message",
    [
        ("rerope", {}, 1, "rerope: w must be 1..the original context L - 1, so the original context L must be >= 2; "
                          "got 1"),
        ("rerope", {"w": 8}, 8, "rerope: w=8 must be below the original context L (8); valid: 1..7"),
        ("string", {}, 2, "string: S must be 2..the original context L - 1, so the original context L must be >= 3; "
                          "got 2"),
        ("string", {"W": 21}, 64, "string: W=21 must be below the shift S (21); valid: 1..20"),  # S = L // 3
        ("string", {"S": 4, "W": 4}, 64, "string: W=4 must be below S=4; valid: 1..3"),
        ("leaky_rerope", {"k": 65}, 64, "leaky_rerope: k=65 exceeds the original context L=64; valid: 1..64"),
        ("self_extend", {"W": 8}, 8, "self_extend: W=8 must be below the original context L (8); valid: 1..7"),
        ("self_extend", {"W": 4, "G": 9}, 8, "self_extend: G=9 exceeds the original context L=8; valid: 1..8"),
        ("dca", {"chunk_size": 8, "local_window": 8}, 64, "dca: local_window=8 must be below chunk_size (8); "
                                                          "valid: 1..7"),
    ],
)
def test_options_beyond_the_original_context_give_the_whole_message(method, options, original, message):
    with pytest.raises(ValueError) as error:
        config = make_config(method, **options)
        config.resolved(original)
    assert str(error.value) == message
    if original < 8:  # the limit is L: one more and it resolves
        config.resolved(original + 1)


def test_make_config_takes_each_form_and_names_what_is_wrong():
    """A name with options, a spec, a dict, a config with replacements; each refusal in full."""
    from rope_ext.methods import make_configs

    yarn = make_config("yarn", factor=4.0, beta_fast=16.0)
    assert make_config("yarn:factor=4:beta_fast=16") == yarn == make_config("yarn:factor=4", beta_fast=16.0)
    assert make_config({"method": "yarn", "factor": 4.0}, beta_fast=16.0) == yarn
    assert make_config(make_config("yarn", factor=2.0), factor=4.0, beta_fast=16.0) == yarn
    assert make_config(yarn) is yarn
    assert make_config("yarn", factor=4.0).to_dict()["method"] == "yarn"
    assert make_config("longrope", factor=2.0, long_factor=(1.0, 2.0)).to_dict()["long_factor"] == [1.0, 2.0]
    valid = ", ".join(list_methods())
    cases = [
        (({"factor": 4.0},), {}, f"a method dict needs a 'method' key naming one method, got None; valid methods: {valid}"),
        (({"method": ["yarn"]},), {}, f"a method dict needs a 'method' key naming one method, got ['yarn']; valid methods: {valid}"),
        (({"method": "yarn", "factor": 4.0},), {"factor": 2.0},
         "option(s) factor given both in {'method': 'yarn', 'factor': 4.0} and as keyword arguments"),
        (("yarn:factor=4:beta_fast=16",), {"beta_fast": 8.0, "factor": 2.0},
         "option(s) beta_fast, factor given both in 'yarn:factor=4:beta_fast=16' and as keyword arguments"),
        (("yarn:factor=4+dca",), {}, "'yarn:factor=4+dca' combines 2 methods; pass it to rope_ext.patch or "
                                     "make_configs (one config each)"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError) as error:
            make_config(*args, **kwargs)
        assert str(error.value) == message
    with pytest.raises(TypeError) as error:
        make_config(3)
    assert str(error.value) == ("method must be a name or spec ('yarn:factor=4'), a dict with a 'method' key, a method "
                                f"config or a list of those, not int 3; valid methods: {valid}")
    assert [c.method for c in make_configs("dca+yarn:factor=4")] == ["yarn", "dca"]  # HOOK_ORDER


def test_numpy_and_tensor_options_become_plain_numbers():
    import numpy as np

    from rope_ext.methods.base import plain_value

    def types(value):  # the value's type and, for a list or tuple, its items' types
        return type(value), [type(item) for item in value] if isinstance(value, (list, tuple)) else None

    for value, plain in [(np.int64(8), 8), (torch.tensor(8), 8), (np.float32(0.5), 0.5), (torch.tensor([1, 2]), [1, 2]),
                         (np.array([1.5, 2.0]), [1.5, 2.0]), ([np.int64(1), torch.tensor(2.0)], [1, 2.0]),
                         ((np.int64(1),), (1,)), (True, True), (None, None), ("x", "x")]:
        got = plain_value(value)
        assert got == plain and types(got) == types(plain)
    other = object()
    assert plain_value(other) is other
    config = make_config("rerope", w=np.int64(8))
    assert type(config.w) is int and config.w == 8
    config = make_config("yarn", factor=torch.tensor(4.0), original_max_position_embeddings=np.int32(64))
    assert (type(config.factor), type(config.original_max_position_embeddings)) == (float, int)


@pytest.mark.parametrize(
    "method,options",
    [
        ("pi", {"factor": 3.0}),
        ("ntk_by_parts", {"factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
        ("yarn", {"factor": 4.0}),
        ("yarn", {"factor": 4.0, "attention_factor": 1.3, "beta_fast": 24.0}),
        ("yarn", {"factor": 4.0, "mscale": 0.8, "mscale_all_dim": 0.5}),
        ("llama3", {"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}),
        ("dynamic_ntk", {"factor": 2.0}),
        ("ntk", {"factor": 4.0}),
    ],
)
def test_native_rope_parameters_give_the_same_frequencies_in_transformers(method, options):
    """What a patch saves for plain transformers (``native_rope_parameters``): transformers' own init function on it
    gives this method's frequencies and attention factor (a renamed key, a dropped option or a wrong type fails)."""
    config = make_config(method, **options)
    native = config.native_rope_parameters(SPEC, SPEC.original_max_position_embeddings)
    assert native is not None and all(type(v) in (str, float, int, bool) for v in native.values())
    theirs, their_attention = _native(native)
    seq_len = SPEC.original_max_position_embeddings if method == "dynamic_ntk" else None
    ours, our_attention = config.frequencies(SPEC, seq_len)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert float(our_attention) == pytest.approx(their_attention, rel=1e-6)
    if method == "dynamic_ntk":  # transformers' "dynamic" reads L from max_position_embeddings: equal or none
        assert native == {"rope_type": "dynamic", "factor": 2.0}
        assert config.native_rope_parameters(SPEC, 2 * SPEC.original_max_position_embeddings) is None
    if "mscale" in options:
        assert (native["mscale"], native["mscale_all_dim"]) == (0.8, 0.5)
    if method == "ntk":  # bloc97's base b * s^(d / (d - 2)), d the rotary dimension
        dim, base = SPEC.dim, SPEC.base
        assert native == {"rope_type": "default", "rope_theta": base * 4.0 ** (dim / (dim - 2))}
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# --- every method says what it does, and every option what it sets (what `rope-ext methods NAME` prints) ---------


def undocumented_methods() -> dict[str, list[str]]:
    """Each registered method that leaves something without a description: ``"summary"`` and its options."""
    return {name: missing for name in list_methods() if (missing := undocumented(get_method_class(name)))}


def test_every_registered_method_declares_its_summary_and_each_option_its_meaning():
    assert undocumented_methods() == {}, "declare summary: ClassVar[str] and option(..., meaning=...) on each field"
    for name in list_methods():
        cls = get_method_class(name)
        assert cls.summary == cls.__dict__["summary"] and len(cls.summary.split()) >= 8, name
        assert all(meaning_of(field).strip() for field in dataclasses.fields(cls)), name


def test_a_method_registered_without_a_summary_or_meanings_is_seen():
    @dataclass(frozen=True)
    class Bare(MethodConfig):
        """A docstring is documentation, not the declared summary."""

        method: ClassVar[str] = "toy_bare"
        hook: ClassVar[str] = "toy"

        width: int = 4
        scale: float = option(1.0, positive(), meaning="the toy's scale")

    @dataclass(frozen=True)
    class Yarnish(YarnConfig):  # (its options' meanings are yarn's; its summary would be yarn's, not its own)
        method: ClassVar[str] = "toy_yarnish"

    register_method(Bare)
    register_method(Yarnish)
    try:
        assert undocumented_methods() == {"toy_bare": ["summary", "width"], "toy_yarnish": ["summary"]}
    finally:
        unregister_method("toy_bare")
        unregister_method("toy_yarnish")
    assert undocumented_methods() == {}


def test_the_shared_options_declare_their_meaning_once_on_the_base():
    """``factor`` and ``L`` of the frequency methods, the window rules' ``w``: one declaration on the base class (PI's
    ``L``, which it refuses, and LongRoPE's ``factor``, which sets its attention factor only, say so themselves; the
    dynamic methods' ``factor`` once on their base)."""
    def meaning(cls, name):
        return meaning_of(next(f for f in dataclasses.fields(cls) if f.name == name))

    frequency = [get_method_class(m) for m in FREQUENCY_METHODS]
    static = [cls for cls in frequency if cls.method != "longrope" and not issubclass(cls, DynamicFrequencyConfig)]
    assert {meaning(cls, "factor") for cls in static} == {meaning(FrequencyConfig, "factor")}
    dynamic = [cls for cls in frequency if issubclass(cls, DynamicFrequencyConfig)]  # (how the factor follows l)
    assert dynamic and {meaning(cls, "factor") for cls in dynamic} == {meaning(DynamicFrequencyConfig, "factor")}
    assert "s*l/L - (s - 1)" in meaning(DynamicFrequencyConfig, "factor")
    assert "attention factor only" in meaning(get_method_class("longrope"), "factor")
    assert {meaning(cls, "original_max_position_embeddings") for cls in frequency if cls.method != "pi"} == {
        meaning(FrequencyConfig, "original_max_position_embeddings")}
    assert meaning(get_method_class("pi"), "original_max_position_embeddings").startswith("not used")
    assert meaning(get_method_class("rerope"), "w") == meaning(get_method_class("leaky_rerope"), "w")


def test_a_renamed_option_builds_from_its_old_name_in_specs_dicts_and_saved_configs():
    """DCA's switch was ``mscale`` before 0.2 (YaRN's ``mscale`` is a number): the old name still builds, from a
    spec, a dict, keyword arguments and a saved config's dict; given beside the new name it is refused."""
    off = DualChunkConfig(scale_queries=False)
    assert make_config("dca:mscale=false") == off
    assert make_config({"method": "dca", "mscale": False}) == off
    assert make_config("dca", mscale=False) == off
    assert make_configs("dca+logn", mscale=False)[0] == off
    assert MethodConfig.from_dict({"method": "dca", "chunk_size": None, "local_window": None, "mscale": False,
                                   "original_max_position_embeddings": None}) == off
    assert "mscale" not in off.to_dict() and off.to_dict()["scale_queries"] is False
    with pytest.raises(ValueError, match="dca: mscale is the old name of scale_queries; give scale_queries alone"):
        make_config("dca:mscale=false:scale_queries=true")
