"""``rope-ext export`` and ``rope-ext doctor`` (rope_ext.serving): what each target is given for each method, checked
against the engines' readers (tests/test_engines_*.py pin those), the folders written, and plain transformers loading
an export as rope_ext computes it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, tiny_model

import rope_ext
from rope_ext.cli import main
from rope_ext.runs.specs import parse_method_spec
from rope_ext.serving.doctor import MISMATCH, WARNING, diagnose
from rope_ext.serving.engines import vllm
from rope_ext.serving.export import export
from rope_ext.serving.plan import APPROXIMATE, EXACT, MAPPED, REFUSED, target_plan

#: the default model's rotary (SmolLM2-135M: head_dim 64, theta 1e5, L 8192)
SMOL = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "head_dim": 64,
        "max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}


def plan(spec: str, target: str, config: dict = SMOL, **kwargs):
    return target_plan(config, tuple(parse_method_spec(spec)) if spec else (), target, **kwargs)


# --- the plans --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,expected", [
    ("pi:factor=4", {"transformers": EXACT, "vllm": EXACT, "sglang": EXACT, "llama.cpp": EXACT}),
    ("ntk:factor=4", {"transformers": EXACT, "vllm": EXACT, "sglang": EXACT, "llama.cpp": EXACT}),
    ("yarn:factor=4", {"transformers": EXACT, "vllm": EXACT, "sglang": EXACT, "llama.cpp": EXACT}),
    ("yarn:factor=4:attention_factor=1.3", {"transformers": EXACT, "vllm": EXACT, "sglang": EXACT,
                                            "llama.cpp": EXACT}),
    ("ntk_by_parts:factor=4", {"transformers": EXACT, "vllm": EXACT, "sglang": EXACT, "llama.cpp": EXACT}),
    ("yarn:factor=4:truncate=false", {"transformers": EXACT, "llama.cpp": REFUSED}),
    ("llama3:factor=8", {"transformers": EXACT, "vllm": EXACT, "sglang": EXACT, "llama.cpp": EXACT}),
    ("dynamic_ntk:factor=4", {"transformers": EXACT, "vllm": APPROXIMATE, "sglang": APPROXIMATE,
                              "llama.cpp": REFUSED}),
    ("dynamic_yarn:factor=4", {"transformers": REFUSED, "vllm": REFUSED, "llama.cpp": REFUSED}),
    ("rerope", {"transformers": REFUSED, "vllm": REFUSED, "sglang": REFUSED, "llama.cpp": REFUSED}),
    ("alibi", {"transformers": REFUSED, "vllm": REFUSED, "llama.cpp": REFUSED}),
    ("dca", {"transformers": REFUSED, "vllm": REFUSED, "llama.cpp": REFUSED}),  # (Llama: vLLM reads it for Qwen)
    ("self_extend", {"transformers": REFUSED, "vllm": REFUSED, "llama.cpp": MAPPED}),
    ("yarn:factor=4+dca", {"transformers": REFUSED, "vllm": REFUSED, "llama.cpp": REFUSED}),
    ("", {"transformers": EXACT, "vllm": EXACT, "llama.cpp": EXACT}),
])
def test_each_method_gets_its_status_per_target(spec, expected):
    for target, status in expected.items():
        got = plan(spec, target)
        assert got.status == status, (target, got.reason)
        assert got.reason
        if status == EXACT and spec:
            assert got.difference == 0.0 and got.max_length is not None


def test_static_ntk_is_written_as_its_new_base_everywhere():
    """bloc97's NTK is exactly a base change: b s^(d / (d - 2)) with d the rotary dimension (64)."""
    theta = 100000.0 * 4.0 ** (64 / 62)
    got = plan("ntk:factor=4", "vllm")
    assert got.config["rope_parameters"] == {"rope_type": "default", "rope_theta": pytest.approx(theta, rel=1e-15)}
    assert got.config["max_position_embeddings"] == 4 * 8192
    keys = plan("ntk:factor=4", "llama.cpp").gguf
    assert keys["llama.rope.freq_base"] == pytest.approx(theta, rel=1e-7) and keys["llama.context_length"] == 32768


def test_yarn_attention_factor_is_restated_for_the_engines_that_drop_it():
    """vLLM and SGLang drop YaRN's attention_factor and multiply 0.1 ln s + 1 by their attn_factor: the export
    gives attn_factor = A / (0.1 ln 4 + 1), and their reader then computes rope_ext's magnitude A."""
    got = plan("yarn:factor=4:attention_factor=1.3", "vllm")
    params = got.config["rope_parameters"]
    assert params["attn_factor"] == pytest.approx(1.3 / (0.1 * math.log(4) + 1), rel=1e-12)
    assert params["attention_factor"] == 1.3  # (kept for transformers)
    rotation = vllm.rotation({**SMOL, **got.config}, torch.tensor([0]), max_model_len=32768)
    assert float(torch.hypot(rotation.cos, rotation.sin).max()) == pytest.approx(1.3, rel=1e-6)
    assert "attn_factor" not in plan("yarn:factor=4:attention_factor=1.3", "transformers").config["rope_parameters"]


def test_the_legacy_layout_states_the_same_rotation():
    got = plan("yarn:factor=4", "vllm", layout="rope_scaling")
    assert got.status == EXACT and "rope_parameters" not in got.config
    scaling = got.config["rope_scaling"]
    assert scaling["type"] == scaling["rope_type"] == "yarn" and "rope_theta" not in scaling
    assert got.config["rope_theta"] == 100000.0
    with pytest.raises(ValueError, match="unknown layout 'flat'; layouts: rope_parameters, rope_scaling"):
        plan("yarn:factor=4", "vllm", layout="flat")


def test_dca_is_mapped_where_the_engine_reads_it_and_refused_elsewhere():
    qwen = {**SMOL, "model_type": "qwen2"}
    got = plan("dca", "vllm", qwen)
    assert got.status == MAPPED
    # rope_ext's defaults: chunk_size 3L/4, local_window L/8 (vLLM's chunk_size and local_size, same convention)
    assert got.config["dual_chunk_attention_config"] == {
        "chunk_size": 6144, "local_size": 1024}
    refused = plan("dca", "vllm")
    assert "qwen2, qwen2_moe, qwen3, qwen3_moe, not llama" in refused.reason and "yarn:factor=S" in refused.alternative


def test_self_extend_is_served_by_llama_cpp_group_attention():
    got = plan("self_extend:G=4:W=512", "llama.cpp")
    assert got.status == MAPPED and got.flags[:4] == ["--grp-attn-n", "4", "--grp-attn-w", "512"]
    assert got.max_length == 4 * (8192 - 512 + 512 // 4)  # where grouped positions reach L


def test_an_unknown_target_names_the_targets():
    with pytest.raises(ValueError, match="unknown target 'tgi'; targets: transformers, vllm, sglang, llama.cpp"):
        plan("yarn:factor=4", "tgi")


# --- the folders ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(path)
    return path


@pytest.mark.parametrize("spec", ["yarn:factor=4", "ntk:factor=4", "pi:factor=2", "llama3:factor=4",
                                  "yarn:factor=4:attention_factor=1.2"])
def test_plain_transformers_loads_a_transformers_export_as_rope_ext_computes_it(tmp_path, tiny_folder, spec):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    record = export(str(tiny_folder), out, "transformers", methods=spec)
    config = json.loads((out / "config.json").read_text())
    assert "rope_ext" not in config and record["plan"]["status"] == EXACT
    ids = input_ids(3 * ORIGINAL_CONTEXT)
    expected = logits(rope_ext.patch(tiny_model("llama"), spec), ids)
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(plain, ids), expected, rtol=0, atol=2e-5)
    assert json.loads((out / "export.json").read_text()) == record


def test_an_export_refuses_before_writing_and_replaces_only_an_export(tmp_path, tiny_folder):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"vllm cannot serve this patch: rerope: vllm has no such attention .*"
                                         r"servable instead: yarn:factor=S"):
        export(str(tiny_folder), out, "vllm", methods="rerope")
    with pytest.raises(ValueError, match=r"cos/sin differ by up to .*pass --allow-approximate to write it anyway, "
                                         r"or export ntk:factor=4 \(static"):
        export(str(tiny_folder), out, "vllm", methods="dynamic_ntk:factor=4")
    assert not out.exists()
    export(str(tiny_folder), out, "vllm", methods="dynamic_ntk:factor=4", allow_approximate=True)
    assert json.loads((out / "export.json").read_text())["plan"]["status"] == APPROXIMATE
    with pytest.raises(ValueError, match="holds an export: pass --overwrite"):
        export(str(tiny_folder), out, "vllm", methods="yarn:factor=4")
    export(str(tiny_folder), out, "vllm", methods="yarn:factor=4", overwrite=True)
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty and holds no export.json"):
        export(str(tiny_folder), mine, "vllm", methods="yarn:factor=4", overwrite=True)
    with pytest.raises(ValueError, match="starts from a GGUF file .*convert_hf_to_gguf.py"):
        export(str(tiny_folder), tmp_path / "g", "llama.cpp", methods="yarn:factor=4")


def test_a_folder_saved_patched_exports_its_patch(tmp_path, tiny_folder):
    from transformers import AutoTokenizer

    saved = tmp_path / "saved"
    rope_ext.patch(tiny_model("llama"), "yarn:factor=2").save_pretrained(saved)
    AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(saved)
    record = export(str(saved), tmp_path / "out", "sglang")
    assert record["methods"][0]["method"] == "yarn" and record["plan"]["max_length"] == 2 * ORIGINAL_CONTEXT
    launch = f"python -m sglang.launch_server --model-path {tmp_path / 'out'}"
    assert record["commands"] == [f"{launch} --context-length {2 * ORIGINAL_CONTEXT}"]
    with pytest.raises(ValueError, match="was saved patched .*leave --methods out"):
        export(str(saved), tmp_path / "other", "sglang", methods="pi:factor=2")


def test_the_default_gguf_round_trips_with_yarn_keys(tmp_path):
    from rope_ext.serving.gguf_io import read_metadata

    out = tmp_path / "gguf"
    record = export("default", out, "llama.cpp", methods="yarn:factor=4")
    (gguf,) = out.glob("*.gguf")
    keys = read_metadata(gguf)
    assert keys["llama.rope.scaling.type"] == "yarn" and keys["llama.rope.scaling.factor"] == pytest.approx(4.0)
    assert keys["llama.rope.scaling.original_context_length"] == 8192 and keys["llama.context_length"] == 32768
    served, overridden = record["commands"]
    assert served == f"llama-server -m {gguf} -c 32768"  # and the original file with its keys overridden:
    assert "-c 32768 --override-kv llama.context_length=int:32768" in overridden
    assert "--override-kv llama.rope.scaling.type=str:yarn --override-kv llama.rope.scaling.factor=float:4.0" in overridden
    assert oct(gguf.stat().st_mode & 0o077) != "0o0"  # (not the private mode of a temporary file)
    findings = diagnose(str(gguf))  # (transformers' GGUF loader reads no scaling key: expected, warned at export)
    assert not [f for f in findings if f.level == MISMATCH]
    assert [line.split(":")[0] for line in record["other_engines"]] == ["transformers"]
    assert "loads this file unscaled" in record["other_engines"][0]
    assert not [f for f in diagnose(str(out)) if f.level == MISMATCH]  # (the folder: its one GGUF)
    with pytest.raises(ValueError, match=r"was written by rope-ext export .*export from the original GGUF"):
        export(str(gguf), tmp_path / "again", "llama.cpp", methods="ntk:factor=2")


def test_llama3_reaches_llama_cpp_as_its_rope_freqs_tensor(tmp_path):
    """llama.cpp serves Llama 3's rotation by dividing each angle by rope_freqs.weight (its converter's tensor): the
    export adds it, computed apart here from Llama 3.1's rule (wavelength bands at L / low and L / high)."""
    from rope_ext.serving.gguf_io import read_metadata, read_rope_factors

    record = export("default", tmp_path / "l3", "llama.cpp", methods="llama3:factor=8")
    (gguf,) = (tmp_path / "l3").glob("*.gguf")
    factors = read_rope_factors(gguf)["rope_freqs.weight"]
    L, low, high, s = 8192, 1.0, 4.0, 8.0
    expected = []
    for i in range(32):
        wavelength = 2 * math.pi * 100000.0 ** (2 * i / 64)
        if wavelength < L / high:
            expected.append(1.0)
        elif wavelength > L / low:
            expected.append(s)
        else:
            smooth = (L / wavelength - low) / (high - low)
            expected.append(1 / ((1 - smooth) / s + smooth))
    assert factors == pytest.approx(expected, rel=1e-5)
    keys = read_metadata(gguf)
    assert keys["llama.rope.scaling.type"] == "none" and keys["llama.context_length"] == 65536
    assert record["plan"]["status"] == EXACT and not [f for f in diagnose(str(gguf)) if f.level == MISMATCH]


# --- doctor -----------------------------------------------------------------------------------------------------


def write_config(tmp_path, **changes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMOL, **changes}))
    return str(path)


def test_doctor_reports_an_engine_that_drops_a_key_as_a_mismatch_first(tmp_path, capsys):
    rope = {"rope_type": "yarn", "rope_theta": 1e5, "factor": 4.0, "original_max_position_embeddings": 8192,
            "attention_factor": 1.0}
    source = write_config(tmp_path, rope_parameters=rope, max_position_embeddings=32768)
    assert main(["doctor", source]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("MISMATCH") and {"vllm", "sglang"} <= {line.split()[1] for line in lines
                                                                      if line.startswith("MISMATCH")}
    assert any("ignores rope_parameters.attention_factor" in line for line in lines)


def test_doctor_passes_what_every_engine_computes_alike(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 1e5, "factor": 4.0, "original_max_position_embeddings": 8192}
    findings = diagnose(write_config(tmp_path, rope_parameters=rope, max_position_embeddings=32768))
    assert not [f for f in findings if f.level == MISMATCH]
    assert main(["doctor", str(tmp_path / "config.json")]) == 0


def test_doctor_names_the_traps_of_the_config_itself(tmp_path):
    rope = {"type": "linear", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    findings = diagnose(write_config(tmp_path, rope_parameters=None, rope_scaling=rope, rope_theta=1e5,
                                     max_position_embeddings=8192))
    messages = [(f.level, f.message) for f in findings]
    assert any(level == MISMATCH and "type 'linear' and rope_type 'yarn' disagree" in m for level, m in messages)
    assert any(level == WARNING and "transformers #38224" in m and "32768" in m for level, m in messages)


def test_an_export_for_vllm_is_served_alike_by_transformers_and_says_what_each_ignores(tmp_path, tiny_folder):
    out = tmp_path / "out"
    record = export(str(tiny_folder), out, "vllm", methods="yarn:factor=4:attention_factor=1.3")
    findings = diagnose(str(out))
    assert not [f for f in findings if f.level == MISMATCH]  # attention_factor for transformers, attn_factor for vLLM
    assert "transformers: ignores rope_parameters.attn_factor: transformers' yarn does not read it" in \
        record["other_engines"]


def test_the_commands_refuse_bad_input_in_one_line(tmp_path, tiny_folder, capsys):
    for argv, message in [
        (["export", str(tiny_folder), str(tmp_path / "o"), "--target", "vllm", "--methods", "yarn:factr=4"],
         "yarn"),
        (["export", str(tiny_folder), str(tmp_path / "o"), "--target", "vllm", "--methods", "rerope"],
         "vllm cannot serve this patch"),
        (["doctor", str(tmp_path / "missing")], "not a folder, a config.json, a .gguf file"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # (after the weights' loading bar)
        assert message in err and err.startswith("rope-ext: error:"), err
    assert not (tmp_path / "o").exists()


def test_the_committed_export_table_is_the_code_s():
    from pathlib import Path

    from rope_ext.serving.table import END, START, export_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    committed = text[text.index(START) + len(START):text.index(END)]
    assert committed == "\n" + export_table(), "run python scripts/export_table.py --write"


@pytest.mark.parametrize("spec", ["pi:factor=4", "ntk:factor=4", "yarn:factor=4", "yarn:factor=4:attention_factor=1.0",
                                  "ntk_by_parts:factor=4", "llama3:factor=4", "dynamic_ntk:factor=2",
                                  "dynamic_yarn:factor=2", "dca", "rerope", "alibi", "yarn:factor=4+logn"])
def test_doctor_on_what_save_pretrained_writes_reports_no_mismatch_unwarned(tmp_path, spec):
    """A folder saved patched holds transformers' keys (and the rope_ext block): the engines that read them otherwise
    are warnings naming the export that writes their keys, never a mismatch."""
    rope_ext.patch(tiny_model("llama"), spec).save_pretrained(tmp_path)
    findings = diagnose(str(tmp_path))
    assert not [f for f in findings if f.level == MISMATCH], [f.message for f in findings]
    assert any(f.engine == "config" and "a rope_ext block" in f.message for f in findings)
    for finding in findings:
        if finding.level == WARNING and finding.engine != "config" and "another rotation" in finding.message:
            assert f"rope-ext export --target {finding.engine}" in finding.message


@pytest.mark.parametrize("target", ["transformers", "vllm", "sglang"])
@pytest.mark.parametrize("spec", ["pi:factor=4", "ntk:factor=4", "yarn:factor=4", "yarn:factor=4:attention_factor=1.3",
                                  "llama3:factor=4"])
def test_doctor_finds_no_mismatch_on_an_export_for_its_target(tmp_path, tiny_folder, spec, target):
    export(str(tiny_folder), tmp_path / "out", target, methods=spec)
    findings = diagnose(str(tmp_path / "out"))
    assert not [f for f in findings if f.level == MISMATCH], [f.message for f in findings]
    assert not [f for f in findings if f.engine == target and f.level != "ok" and "computes another" in f.message]


def test_doctor_on_the_shipped_example_configs():
    """Qwen2.5's documented YaRN (factor 4 beside max_position_embeddings 32768): the #38224 trap and vLLM's longer
    default context named, no engine computing another rotation; Llama 3.1's llama3 rotation the same in every engine
    (llama.cpp's through the rope_freqs.weight factors its converter writes)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "examples" / "configs"
    qwen = diagnose(str(folder / "qwen2.5-7b-instruct-yarn.json"))
    assert not [f for f in qwen if f.level == MISMATCH]
    assert any("transformers #38224" in f.message and "set max_position_embeddings = 131072" in f.message for f in qwen)
    assert any(f.engine == "context" and "vllm 131072" in f.message for f in qwen)
    llama = diagnose(str(folder / "llama-3.1-8b.json"))
    assert [f for f in llama if f.level != "ok"] == []
    assert {f.engine for f in llama if "the same rotation as transformers" in f.message} == {"vllm", "sglang", "llama.cpp"}


# --- what a new user's trial found ----------------------------------------------------------------------------------


def saved_tiny(path, family="llama", theta=1e6):
    from tiny import tiny_config

    config = tiny_config(family)
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    model = AutoModelForCausalLMFrom(config)
    model.save_pretrained(path)
    return model


def AutoModelForCausalLMFrom(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_an_export_keeps_the_model_s_own_rope_keys_where_it_does_not_restate_them(tmp_path, tiny_folder):
    """No patch, and DCA: the config's rope base stays (a base of 1e6, not transformers' default 1e4)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for family, spec, target in (("llama", "none", "transformers"), ("qwen2", "dca", "vllm")):
        source = tmp_path / family
        model = saved_tiny(source, family)
        AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(source)
        out = tmp_path / f"{family}-out"
        record = export(str(source), out, target, methods=spec)
        config = json.loads((out / "config.json").read_text())
        assert config["rope_parameters"]["rope_theta"] == 1e6, config
        ids = input_ids(ORIGINAL_CONTEXT // 2)
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids), logits(model, ids))
        assert record["source"] == str(source.absolute())  # (absolute: the commands work from anywhere)
        assert not [f for f in diagnose(str(out)) if f.level == MISMATCH]


def test_what_an_engine_s_config_class_or_the_model_cannot_take_is_refused(tmp_path, tiny_folder):
    phi3 = {**SMOL, "model_type": "phi3", "original_max_position_embeddings": 8192}
    for target in ("vllm", "sglang", "transformers"):
        got = plan("yarn:factor=4", target, phi3)
        assert got.status == REFUSED and "config class refuses" in got.reason or "does not take" in got.reason
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_positions": 64}
    assert "has no rotary embedding" in plan("alibi", "vllm", gpt2).reason
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    with pytest.raises(ValueError, match="states no rotary embedding; nothing to compare"):
        diagnose(str(tmp_path / "gpt2.json"))
    for content, message in (("[1, 2]", "not a model config"), ('{"foo": 1}', "not a model config"),
                             ("not json", "not a JSON model config")):
        (tmp_path / "bad.json").write_text(content)
        with pytest.raises(ValueError, match=message):
            diagnose(str(tmp_path / "bad.json"))
    beyond = plan("yarn:factor=4", "vllm", max_length=40000)
    assert beyond.status == REFUSED and "beyond what yarn:factor=4 was made for (32768 = s L)" in beyond.reason
    with pytest.raises(ValueError, match="below the model's original context 8192"):
        plan("yarn:factor=4", "vllm", max_length=4096)
    assert plan("yarn:factor=4", "vllm", max_length=16384).config["max_position_embeddings"] == 32768  # (s L stated)
    with pytest.raises(ValueError, match="is the source, inside it or holds it"):
        export(str(tiny_folder), tiny_folder / "sub", "vllm", methods="yarn:factor=4")
    with pytest.raises(ValueError, match="an export serves one spec"):
        export(str(tiny_folder), tmp_path / "o", "vllm", methods="yarn:factor=4,pi:factor=2")
    assert main(["merge", str(tiny_folder), str(tmp_path / "m"), "--target", "llama.cpp"]) == 2  # (a GGUF: export)


def test_a_model_exported_as_it_is_is_restated_for_the_engine_and_in_the_layout_asked(tmp_path, tiny_folder):
    """A transformers export of yarn with attention_factor 1.0, exported again for vLLM with no patch: vLLM's keys are
    added (attn_factor), so vLLM computes what transformers does; --layout is honoured without a patch too."""
    first = tmp_path / "first"
    export(str(tiny_folder), first, "transformers", methods="yarn:factor=4:attention_factor=1.0")
    record = export(str(first), tmp_path / "again", "vllm", layout="rope_scaling")
    assert record["plan"]["status"] == EXACT
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["rope_scaling"]["attn_factor"] == pytest.approx(1 / (0.1 * math.log(4) + 1))
    assert config["rope_theta"] == 10000.0 and "rope_parameters" not in config
    assert not [f for f in diagnose(str(tmp_path / "again")) if f.level == MISMATCH]


def test_more_bad_values_are_refused_with_their_reason(tmp_path):
    refused = plan("self_extend:G=4:W=512", "llama.cpp", max_length=40000)
    assert refused.status == REFUSED and "beyond what self_extend:G=4:W=512 reaches (31232" in refused.reason
    assert plan("yarn:factor=4", "vllm", max_length=32800).alternative == "yarn:factor=4.00390625"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "rope_parameters": "x"}))
    with pytest.raises(ValueError, match="rope_parameters must be an object"):
        diagnose(str(tmp_path / "config.json"))


def test_the_rotation_check_flags_a_thousandth_of_magnitude_and_a_long_position_s_drift_but_not_float32():
    """tolerance is float32 rounding (2e-6 + 4e-7 p): an attention factor 0.1% off is caught at position 0, a frequency
    1e-5 off (0.33 rad at 32,767) at the far end, while the same rotation computed in float32 passes."""
    from rope_ext.serving.plan import rotation_gap
    from rope_ext.serving.rotation import Rotation

    positions = torch.tensor([0, 1, 16384, 32767])
    inv_freq = torch.tensor([1.0, 0.3, 0.01, 1e-4], dtype=torch.float64)  # (0.3 x 32,767: float32 errs ~5e-4)
    angles = positions.double()[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    single = (positions.float()[:, None] * inv_freq.float()).double()
    assert rotation_gap(cos, sin, Rotation(single.cos(), single.sin()), positions) == 0.0
    assert rotation_gap(cos, sin, Rotation(cos * 1.001, sin * 1.001), positions) == pytest.approx(0.001, rel=1e-6)
    drifted = positions.double()[:, None] * inv_freq * (1 + 1e-5)
    assert rotation_gap(cos, sin, Rotation(drifted.cos(), drifted.sin()), positions) > 0.3
    assert rotation_gap(cos, sin, Rotation(cos[:, :3], sin[:, :3]), positions) == math.inf
