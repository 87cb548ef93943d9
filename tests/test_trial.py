"""Failures a new user's trial of main found (tiny models), each pinned: silent wrong results first, then
messages and habits; plus the undo log's checks (unpatch restores only what still holds the patch's values)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from tiny import FAMILY_MODEL_TYPES, ORIGINAL_CONTEXT, input_ids, logits, tiny_config, tiny_model

import rope_ext
from rope_ext.attention import kernels
from rope_ext.families import get_family
from rope_ext.installers import PlanBuilder, Sites

L = ORIGINAL_CONTEXT


# --- 1. the attention implementation changed after patching -----------------------------------------------


def test_switching_the_attention_implementation_after_patching_is_refused():
    model = tiny_model("llama")
    ids = input_ids(2 * L)
    base = logits(model, ids)
    rope_ext.patch(model, "dca")
    patched = logits(model, ids)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match=r"attention implementation was changed to 'eager' afterwards.*"
                                           r"set_attn_implementation\('rope_ext'\)"):
        model(input_ids=ids)
    with pytest.raises(RuntimeError, match=r"cannot unpatch exactly.*changed to 'eager' after patching"):
        rope_ext.unpatch(model)
    model.set_attn_implementation("rope_ext")
    assert torch.equal(logits(model, ids), patched)
    rope_ext.unpatch(model)
    assert model.config._attn_implementation == "sdpa" and torch.equal(logits(model, ids), base)


def test_unpatch_refuses_what_was_changed_since_and_changes_nothing():
    """A module wrapped over the patch's replacement, a config value set again: unpatch names it and keeps the
    model as it is (a blind restore would undo the user's change); once undone, unpatch is exact."""
    model = tiny_model("llama")
    ids = input_ids(2 * L)
    base = logits(model, ids)
    rope_ext.patch(model, "yarn:factor=4")
    rotary = model.model.rotary_emb
    model.model.rotary_emb = torch.nn.Sequential()  # something put over it
    with pytest.raises(RuntimeError, match=r"LlamaModel.rotary_emb is a Sequential, not the a RopeExtRotaryEmbedding"):
        rope_ext.unpatch(model)
    assert rope_ext.get_patch(model) is not None
    model.model.rotary_emb = rotary
    model.config.max_position_embeddings = 1000
    with pytest.raises(RuntimeError, match=r"max_position_embeddings is 1000, not the 256 the patch set"):
        rope_ext.unpatch(model)
    model.config.max_position_embeddings = 4 * L
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, ids), base) and model.config.max_position_embeddings == L


@pytest.mark.parametrize("model_type", ["gpt2", "t5", "deberta-v2"])
def test_config_aliases_are_edited_under_their_own_names(model_type):
    """``max_position_embeddings`` (GPT-2: ``n_positions``), ``hidden_size`` (T5: ``d_model``),
    ``num_attention_heads``: an edit lands on the attribute the alias maps to, and reverting restores it exactly
    (no absent-then-AttributeError)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    before = config.to_dict()
    builder = PlanBuilder(Sites(config, {}), {}, frozenset())
    aliases = type(config).attribute_map
    names = [n for n in ("max_position_embeddings", "hidden_size", "num_attention_heads") if hasattr(config, n)]
    for name in names:
        builder.edit_config(config, name, getattr(config, name) * 2)
    builder.plan.apply()
    for name in names:
        assert getattr(config, name) == before[aliases.get(name, name)] * 2
        if name in aliases:
            assert builder.config_edits[names.index(name)].name == aliases[name]
    builder.plan.revert()
    assert config.to_dict() == before


def test_from_pretrained_loads_the_head_class_the_checkpoint_names(tmp_path):
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("llama")
    config.num_labels = 3
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    ids = input_ids(2 * L)
    rope_ext.patch(model, "yarn:factor=4+dca")
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    restored = rope_ext.from_pretrained(tmp_path)
    assert type(restored) is type(model) and rope_ext.get_patch(restored) == rope_ext.get_patch(model)
    assert torch.equal(logits(restored, ids), expected)


def test_an_attention_method_may_state_the_length_a_frequency_method_extends_to():
    """DCA with chunks of 2L on yarn:factor=2 (ChunkLlama on a model extended to 2L): L = 2L is accepted only with
    a frequency method that reaches it; inside one chunk the model is yarn's, past it DCA acts."""
    model = tiny_model("llama")
    spec = f"yarn:factor=2+dca:chunk_size={2 * L}:original_max_position_embeddings={2 * L}"
    short, long = input_ids(3 * L // 2), input_ids(3 * L)  # DCA's chunk s = 2L - 2L/8 = 112 > 96
    with rope_ext.patched(model, "yarn:factor=2"):
        yarn_short, yarn_long = logits(model, short), logits(model, long)
    with rope_ext.patched(model, spec) as patched:
        dca = rope_ext.get_patch(patched, resolved=True)[1]
        assert (dca.chunk_size, dca.local_window, dca.original_max_position_embeddings) == (2 * L, 2 * L // 8, 2 * L)
        torch.testing.assert_close(logits(model, short), yarn_short, rtol=0, atol=2e-5)
        assert (logits(model, long) - yarn_long).abs().max() > 1e-3
    for bad, message in [
        (f"yarn:factor=2+dca:original_max_position_embeddings={2 * L + 1}",
         rf"dca: original_max_position_embeddings={2 * L + 1} exceeds the context {2 * L} that yarn:factor=2 handles; "
         rf"valid: 2..{2 * L}"),
        (f"dca:original_max_position_embeddings={2 * L}",
         rf"exceeds the model's original context {L} \(from its config\); valid: 2..{L}"),
        (f"dynamic_ntk:factor=2+dca:original_max_position_embeddings={2 * L}",
         rf"exceeds the model's original context {L} \(from its config\); valid: 2..{L}"),
        # (a rotation that reaches less than the checkpoint: yarn x1.5 from L/2 handles 3L/4)
        (f"yarn:factor=1.5:original_max_position_embeddings={L // 2}+dca:original_max_position_embeddings={L}",
         rf"dca: original_max_position_embeddings={L} exceeds the context {3 * L // 4} that yarn:factor=1.5 handles"),
    ]:
        with pytest.raises(ValueError, match=message):
            rope_ext.patch(model, bad)
        assert rope_ext.get_patch(model) is None


# --- 4. a checkpoint that already scales RoPE: attention methods take its window as L ---------------------


def test_an_attention_method_on_a_scaled_checkpoint_takes_its_extended_window():
    """llama3 x4 (original 64, window 256): the rotation stays the checkpoint's, L is its window (256); stating
    L = 256 is accepted, above it refused; a frequency method still needs replace_scaling and starts from 64."""
    scaled = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": L}
    config = tiny_config("llama", rope_parameters=scaled)
    config.max_position_embeddings = 4 * L
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = input_ids(3 * L)
    base = logits(model, ids)
    with rope_ext.patched(model, "dca") as patched:
        assert rope_ext.get_patch(patched, resolved=True).original_max_position_embeddings == 4 * L
        torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=2e-5)  # 192 tokens: inside one chunk
    with rope_ext.patched(model, "dca", original_max_position_embeddings=4 * L):
        pass
    with pytest.raises(ValueError, match=rf"exceeds the model's original context {4 * L}"):
        rope_ext.patch(model, "dca", original_max_position_embeddings=8 * L)
    with pytest.raises(ValueError, match="already uses RoPE scaling"):
        rope_ext.patch(model, "yarn:factor=2+dca")
    with rope_ext.patched(model, "yarn:factor=2+dca", replace_scaling=True) as both:
        yarn, dca = rope_ext.get_patch(both, resolved=True)
        assert yarn.original_max_position_embeddings == L and dca.original_max_position_embeddings == L


# --- 6. a frequency method without its factor ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["pi", "ntk", "ntk_by_parts", "yarn", "llama3"])
def test_static_frequency_methods_require_their_factor(method):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"{method}: factor is required .*{method}:factor=4"):
        rope_ext.patch(model, method)
    with pytest.raises(ValueError, match="factor is required"):
        rope_ext.patch(model, f"{method}+dca")
    assert rope_ext.get_patch(model) is None
    assert rope_ext.methods.make_config("dynamic_ntk").factor == 1.0  # (dynamic: 1 still scales past L)


# --- 9. messages and habits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [np.int64(8), torch.tensor(8), np.int32(8)], ids=["np.int64", "0-d tensor", "np.int32"])
def test_numpy_and_tensor_scalars_are_taken_as_numbers(value, tmp_path):
    model = tiny_model("llama")
    rope_ext.patch(model, "rerope", w=value)
    config = rope_ext.get_patch(model)
    assert config.w == 8 and type(config.w) is int
    rope_ext.unpatch(model)
    assert rope_ext.methods.make_config("yarn", factor=np.float32(2.5)).factor == 2.5
    assert type(rope_ext.methods.make_config("yarn", factor=torch.tensor(2.0)).factor) is float
    assert rope_ext.methods.LongRopeConfig(long_factor=np.array([1.0, 2.0])).long_factor == (1.0, 2.0)
    with pytest.raises(ValueError, match="w must be an int >= 1"):
        rope_ext.patch(model, "rerope", w=torch.tensor([8, 9]))


def test_a_static_cache_is_refused_at_patch_time():
    model = tiny_model("llama")
    model.generation_config.cache_implementation = "static"
    with pytest.raises(ValueError, match=r"generation_config asks for a 'static' cache.*cache_implementation = None"):
        rope_ext.patch(model, "dca")
    assert rope_ext.get_patch(model) is None
    rope_ext.patch(model, "yarn:factor=2")  # (the rotary module alone: any cache)
    rope_ext.unpatch(model)


def test_attention_dropout_trains_instead_of_being_refused():
    """Dropout on the attention weights (training mode): each region's weights are dropped and the regions merge
    by their undropped log-sum-exp, which is dropout on the final probabilities; its mean over many draws is
    the output without dropout."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    plain = kernels.Accumulator(q, 8)
    kernels.region(plain, q, k, v, 0.3, 0, 0, 2, 0, 4)
    kernels.region(plain, q, k, v, 0.3, 0, 3, None, 0, 4)
    draws = []
    for _ in range(4000):
        acc = kernels.Accumulator(q, 8, dropout=0.3)
        kernels.region(acc, q, k, v, 0.3, 0, 0, 2, 0, 4)
        kernels.region(acc, q, k, v, 0.3, 0, 3, None, 0, 4)
        draws.append(acc.out)
    draws = torch.stack(draws)
    assert not torch.equal(draws[0], draws[1])
    torch.testing.assert_close(draws.mean(0), plain.out, rtol=0, atol=0.05)
    config = tiny_config("llama")
    config.attention_dropout = 0.5
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    rope_ext.patch(model, "self_extend:G=4")
    ids = input_ids(2 * L)
    model.train()
    first, second = model(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    assert not torch.equal(first.logits, second.logits)
    first.loss.backward()
    model.eval()
    assert torch.equal(logits(model, ids), logits(model, ids))


def test_the_missing_hook_message_reads_well():
    falcon = tiny_model("falcon")
    with pytest.raises(ValueError, match="'dca' needs a 'position_rule' hook"):
        rope_ext.patch(falcon, "dca")


# --- 10. what a user missed ------------------------------------------------------------------------------------


def test_summary_and_repr_show_what_is_patched():
    model = tiny_model("gemma3")
    assert rope_ext.summary(model) == "not patched by rope_ext"
    rope_ext.patch(model, "yarn:factor=4+dca+logn")
    text = rope_ext.summary(model)
    assert text.splitlines()[0] == (
        f"rope_ext patch: yarn:factor=4:original_max_position_embeddings={L} + "
        f"dca:chunk_size={3 * L // 4}:local_window={L // 8}:original_max_position_embeddings={L} + "
        f"logn:original_max_position_embeddings={L}"
    )
    assert "model.rotary_emb: RopeExtRotaryEmbedding(method=yarn, layer_types=['full_attention'], rotated in attention)" in text
    assert "attention layer 1 (full_attention: dca(" in text and "+ dca scale + logn scale)" in text
    assert "attention layer 0 (sliding_attention: plain)" in text
    assert "rope_ext: dca(" in repr(model)
    rope_ext.unpatch(model)
    assert "rope_ext" not in repr(model)


def test_a_sequence_beyond_the_methods_range_warns_once_and_transformers_reminder_is_silenced(caplog):
    model = tiny_model("llama")
    rope_ext.patch(model, "string")  # remapped distances stay below L up to L + S - W tokens
    limit = L + L // 3 - min(128, L // 16)
    with caplog.at_level(logging.WARNING, logger="rope_ext"):
        logits(model, input_ids(limit))
        assert "beyond what string was made for" not in caplog.text
        logits(model, input_ids(limit + 1))
        logits(model, input_ids(limit + 2))
    assert caplog.text.count(f"beyond what string was made for ({limit} tokens") == 1
    rope_ext.unpatch(model)
    with rope_ext.patched(model, "yarn:factor=2"), caplog.at_level(logging.WARNING, logger="rope_ext"):
        logits(model, input_ids(2 * L + 1))
    assert f"beyond what yarn was made for ({2 * L} tokens" in caplog.text
    from rope_ext.guards import REMINDERS as _REMINDERS

    reminder = logging.LogRecord("x", logging.WARNING, "", 0, "This is a friendly reminder - the current text generation "
                                 f"call has exceeded the model's predefined maximum length ({L}). Depending on", None, None)
    with rope_ext.patched(model, "dca"):
        assert _REMINDERS in logging.getLogger("transformers.generation.stopping_criteria").filters
        assert not _REMINDERS.filter(reminder)
    import gc

    gc.collect()  # (models other tests patched and dropped: weakly held, gone once collected)
    assert _REMINDERS.filter(reminder)  # unpatched: transformers' reminder is back
    with rope_ext.patched(model, "yarn:factor=2"):  # max_position_embeddings says 2L: the reminder is right there
        assert _REMINDERS.filter(reminder) and model not in _REMINDERS.lengths


def test_every_registered_family_has_a_tiny_model_and_is_patched():
    # (gpt2 and opt, learned tables and no rotary module, have their own tiny models in test_biases.py; t5, mt5, umt5,
    # deberta_v2 and xlnet in test_t5.py, test_deberta.py and test_xlnet.py)
    others = {"gpt2", "opt", "t5", "mt5", "umt5", "deberta_v2", "xlnet"}
    kept = {name for name in rope_ext.list_families() if not get_family(name).discovered}  # (test_conformance.py)
    assert set(FAMILY_MODEL_TYPES) | others == kept


@pytest.mark.parametrize("family", ["olmo3", "ministral", "hunyuan_v1_dense"])
def test_families_the_trial_found_refused_are_supported(family):
    model = tiny_model(family)
    ids = input_ids(3 * L)
    base = logits(model, ids)
    methods = ("yarn:factor=4", "logn") if family == "hunyuan_v1_dense" else ("yarn:factor=4", "dca", "rerope+logn")
    for method in methods:
        with rope_ext.patched(model, method):
            assert (logits(model, ids) - base).abs().max() > 1e-4
        assert torch.equal(logits(model, ids), base)


@pytest.mark.parametrize(
    ("family", "reason"),
    [("glm4", "pair layout of its own"), ("ernie4_5", "pair layout of its own"),
     ("hunyuan_v1_dense", "transforms queries and keys after rotating them")],
)
def test_families_whose_rotation_cannot_move_into_attention_refuse_position_rules(family, reason):
    """GLM-4 and ERNIE 4.5 pair dims their own way in apply_rotary_pos_emb, HunYuan norms q and k after RoPE:
    rotating at attention time would silently change the model, so position rules (and cache-consistent dynamic
    methods) are refused, naming what fits (the family's support, or the plan for an option); frequency methods and
    logn still work."""
    model = tiny_model(family)
    fits = rf"(frequency methods and logn work|methods for {family}: .*logn, .*yarn$)"
    for method in ("rerope", "dca", "dynamic_ntk:factor=2:cache_consistent=true"):
        with pytest.raises(ValueError, match=rf"{family}: .*{reason}.*{fits}"):
            rope_ext.patch(model, method)
        assert rope_ext.get_patch(model) is None and model.config._attn_implementation == "sdpa"
    for method in ("yarn:factor=2", "logn"):
        with rope_ext.patched(model, method):
            pass


_PAIRS = r": its attention applies rotary positions in a pair layout of its own \(not HF's rotate_half\)"
#: the tiny families that refuse ``rerope``, each with the start of its message (anchored at its first character)
REROPE_REFUSED = {
    "ernie4_5": r"method 'rerope' does not fit ernie4_5" + _PAIRS,
    "glm4": r"method 'rerope' does not fit glm4" + _PAIRS,
    "hunyuan_v1_dense": r"method 'rerope' does not fit hunyuan_v1_dense: its attention transforms queries and keys "
                        r"after rotating them \(a norm after RoPE\)",
    "gemma2": r"method 'rerope' does not fit gemma2: its attention caps logits \(attn_logit_softcapping=50\.0\)",
    "falcon": r"method 'rerope' needs a 'position_rule' hook, which family 'falcon' does not support; methods for falcon: ",
    "exaone4": r"exaone4: every layer of this model uses sliding-window attention; attention methods apply to "
               r"full-attention layers$",
}


@pytest.mark.parametrize("family", sorted(FAMILY_MODEL_TYPES))
def test_a_window_covering_the_sequence_is_the_unpatched_model_in_every_family(family):
    """Every family that takes position rules, with every norm weight made non-uniform (as trained checkpoints
    have them): ReRoPE with its window past the sequence rotates exactly as the model does. The families that
    refuse it are skipped only after the refusal they are listed with in ``REROPE_REFUSED``."""
    model = tiny_model(family)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.dim() == 1:
                parameter.copy_(torch.linspace(0.5, 1.5, parameter.numel()))
    ids = input_ids(L - 2, batch=2)
    base = logits(model, ids)
    if family in REROPE_REFUSED:  # (refused, saying why; any other refusal, or none, fails)
        with pytest.raises(ValueError, match="^" + REROPE_REFUSED[family]):
            rope_ext.patch(model, "rerope", w=L - 1)
        assert rope_ext.get_patch(model) is None and torch.equal(logits(model, ids), base)
        pytest.skip(f"{family}: rerope refused as expected (REROPE_REFUSED)")
    rope_ext.patch(model, "rerope", w=L - 1)
    torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=2e-5)
    rope_ext.unpatch(model)


def test_importing_rope_ext_imports_no_modeling_module():
    import subprocess
    import sys

    code = ("import sys, rope_ext; "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().replace("'", '"')) == []


def test_long_cpu_attention_calls_hand_freed_memory_back(monkeypatch):
    """glibc keeps freed heap blocks resident (the prefill's added memory then reads 1.25x SDPA's at 16k where the
    memory actually held is 1.01x): a long CPU call trims the heap afterwards, a short one (decoding) does not."""
    from rope_ext.attention import memory

    calls = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: lambda pad: calls.append(pad))
    memory.release_freed_memory(2048, 2048, "cpu")
    assert calls == [0]
    memory.release_freed_memory(1, 2048, "cpu")
    memory.release_freed_memory(4096, 4096, "cuda")
    assert calls == [0]
    monkeypatch.setattr(memory, "TRIM_PAIRS", 1)
    model = tiny_model("llama")
    with rope_ext.patched(model, "dca"):
        logits(model, input_ids(20))
    assert len(calls) == 1 + model.config.num_hidden_layers


def test_a_cache_written_without_the_patch_is_refused():
    """A position rule caches keys unrotated: a cache filled by the unpatched model (rotated keys) or by another
    patch cannot be continued under it; a copy of the patch's own cache can."""
    import copy as copying

    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = input_ids(2 * L)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    with rope_ext.patched(model, "rerope"):
        with pytest.raises(ValueError, match=r"holds keys written by the model without this patch .*Start a new cache"):
            model(input_ids=ids[:, :1], past_key_values=cache)
        own = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=own)
            model(input_ids=ids[:, :1], past_key_values=copying.deepcopy(own))  # a copy: the same patch's keys
    with rope_ext.patched(model, "rerope"):  # the same method, patched again: another patch
        with pytest.raises(ValueError, match="written by another rope_ext patch"):
            model(input_ids=ids[:, :1], past_key_values=own)
    own.reset()
    with rope_ext.patched(model, "dca"), torch.no_grad():
        model(input_ids=ids, past_key_values=own)  # emptied: any patch may fill it


# --- from the trial of the refactor ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("yarn", {"factor": 2.0, "attention_factor": 1e30}, r"attention factor outside \(0, 100\]"),
        ("yarn", {"factor": 2.0, "mscale": 1e30, "mscale_all_dim": 1.0}, r"attention factor outside \(0, 100\]"),
        ("leaky_rerope", {"k": 10**30}, rf"k=10{'0' * 29} exceeds the original context L={L}; valid: 1..{L}"),
        ("self_extend", {"G": 10**30}, rf"G=10{'0' * 29} exceeds the original context L={L}; valid: 1..{L}"),
        ("dca", {"replace_scaling": "yes"}, "replace_scaling must be True or False, got 'yes'"),
        ("yarn", {"factor": 2.0, "replace_scaling": 1}, "replace_scaling must be True or False, got 1"),
    ],
)
def test_values_that_break_a_forward_are_refused_at_patch_time(method, options, message):
    model = tiny_model("llama")
    ids = input_ids(2 * L)
    base = logits(model, ids)
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, method, **options)
    assert rope_ext.get_patch(model) is None and torch.equal(logits(model, ids), base)


def test_a_config_dict_edited_in_place_is_seen_by_unpatch():
    model = tiny_model("llama")
    rope_ext.patch(model, "yarn:factor=4")
    model.config.rope_parameters["factor"] = 8.0
    with pytest.raises(RuntimeError, match=r"rope_parameters was edited in place since the patch set it"):
        rope_ext.unpatch(model)
    model.config.rope_parameters["factor"] = 4.0
    rope_ext.unpatch(model)
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("method", ["dynamic_ntk:factor=2", "dynamic_yarn", "longrope:factor=4:long_factor=[1,1,1,1,2,2,2,2]"])
def test_dynamic_methods_silence_the_reminder_at_l(method):
    from rope_ext.guards import REMINDERS as _REMINDERS

    model = tiny_model("llama")
    with rope_ext.patched(model, method):
        assert _REMINDERS.lengths.get(model) == L


def test_the_range_warning_reads_position_ids_of_a_prompt(caplog):
    model = tiny_model("llama")
    with rope_ext.patched(model, "self_extend:W=8:G=3"), caplog.at_level(logging.WARNING, logger="rope_ext"):
        limit = 3 * (L - 8 + 8 // 3)
        ids = input_ids(40)
        logits(model, ids, position_ids=torch.arange(40)[None] * 25)  # ids up to 975
    assert f"a sequence of {39 * 25 + 1} tokens is beyond what self_extend was made for ({limit} tokens" in caplog.text


def test_patching_a_part_of_a_model_says_to_patch_the_whole_model():
    model = tiny_model("llama")
    for part in (model.model.layers[0], model.model.rotary_emb):
        with pytest.raises(ValueError, match=rf"got a {type(part).__name__}, which no supported family is: if it is "
                                             "part of a model, patch the model that contains it"):
            rope_ext.patch(part, "rerope")


def test_patched_leaves_a_patch_the_body_made_anew():
    model = tiny_model("llama")
    with rope_ext.patched(model, "dca"):
        rope_ext.unpatch(model)
        rope_ext.patch(model, "rerope")
    assert rope_ext.get_patch(model).method == "rerope"
    rope_ext.unpatch(model)
