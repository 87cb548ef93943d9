"""Every RoPE causal LM of the pinned transformers, from its own model list: a tiny model of each type is built from
its config class (tests/conformance.py) and patched as a user would. Families found at run time (no row kept by
hand: ``rope_ext.families.discovered``) are held to what the hand-kept rows are.

For each type that builds: ``patch`` finds a family or refuses in one line; where the frequency methods fit, YaRN
moves the logits, equals transformers' own ``yarn`` rope type on the same weights (and ``pi``, ``llama3`` their
``linear`` and ``llama3``), decodes on the cache as the full
forward and keeps a left-padded row of a batch what the row gives alone (each as close as the unpatched model is),
and ``unpatch`` restores the logits bit-exactly; where a position rule fits, ReRoPE with a window covering the sequence is the unpatched model;
where a bias fits, ALiBi patches and unpatches exactly. A type that is refused must be listed below with the reason's
words, a type the recipe cannot build yet must be listed with its error's, and a listed one that starts working
fails the test until its line is removed: a new release's families turn the suite red the day the pin moves.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conformance import ORIGINAL, VOCAB, model_types, tiny_config, tiny_model
from tiny import patched_dispatched
from transformers import AutoModelForCausalLM, DynamicCache

import rope_ext
from rope_ext.attention.program import QueryScale
from rope_ext.families import find_family, get_family
from rope_ext.installers.attention import installed_programs
from rope_ext.installers.rotary import RopeExtRotaryEmbedding

#: types the tiny recipe cannot build yet -> words of the error (the recipe's gap, not rope_ext's)
NOT_BUILT = {
    "gemma3n": "timm",
}
#: types whose tiny model's logits do not depend on positions at initialisation (a method cannot move them)
POSITION_FREE = ("zaya",)  # (its CCA attention at init: logits equal at positions 0..23 and 0, 5, ..., 115)
#: types whose tiny model runs no padded batch of two even unpatched (the recipe's MLA sizes: a shape error)
NO_PADDED_BATCH: tuple[str, ...] = ()  # (none since MLA keeps as many key heads as query heads)
#: types whose frequency methods are refused -> words of the one-line reason (issue 35's families that are not a
#: table row: a p-RoPE checkpoint without its original length)
FREQUENCY_REFUSED: dict[str, str] = {  # (Recurrent Gemma's config states no context length: a method's
    "recurrent_gemma": "gives no original context length",  # original_max_position_embeddings must)
}
#: of those, the refusals a checkpoint's config decides (the family's listing keeps the method)
CHECKPOINT_REFUSED: tuple[str, ...] = ("recurrent_gemma",)
#: types whose tiny model refuses the attention rewrites and biases its family's support lists -> the reason's words
#: (what a checkpoint's layers allow: NoPE full layers beside sliding ones; every layer sliding)
RULE_REFUSED: dict[str, str] = {
    "exaone4": "no layer to rewrite", "exaone_moe": "no layer to rewrite", "kolibri1": "no layer to rewrite",
    "ministral": "every layer of this model uses sliding-window attention",
    "beam": "no layer to rewrite",  # (its full layers are NoPE: no layer for a position rule)
}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _cache_distance(model: torch.nn.Module, ids: torch.Tensor, full: torch.Tensor) -> float:
    """How far the last token's logits decoded on the cache of the rest are from the full forward's."""
    with torch.no_grad():
        prefix = model(ids[:, :-1], use_cache=True)
        cache = getattr(prefix, "past_key_values", None)
        if cache is None:  # (Recurrent Gemma returns no cache: its recurrent state set up anew, its cache given)
            model.model._setup_cache(model.config, ids.shape[0], ids.device, torch.float32)
            cache = DynamicCache(config=model.config)
            model(ids[:, :-1], past_key_values=cache, use_cache=True)
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
    return (step[:, -1] - full[:, -1]).abs().max().item()


def _padding_distance(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """How far a left-padded row of a batch is from the same row alone (its real tokens' logits)."""
    short = ids[:, 6:]
    batch = torch.cat([ids, torch.cat([torch.zeros_like(ids[:, :6]), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits[1, 6:]
        alone = model(short).logits[0]
    return (padded - alone).abs().max().item()


def _existing_scaling(model: torch.nn.Module) -> bool:
    """Whether the type's default config already scales its RoPE (gpt-oss's and Ministral 3's YaRN)."""
    config = model.config.get_text_config()
    parameters = getattr(config, "rope_parameters", None) or {}
    kinds = parameters.values() if all(isinstance(v, dict) for v in parameters.values()) and parameters else [parameters]
    return any(p.get("rope_type", "default") not in ("default", None) for p in kinds)


#: rope_ext's methods and transformers' own rope types of the same name, written out (not read from rope_ext)
NATIVE = {
    "pi:factor=4": {"rope_type": "linear", "factor": 4.0},
    "llama3:factor=4": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": ORIGINAL},
}


#: transformers' dynamic NTK (``dynamic``) at factor 4 over the tiny native context (its max_position_embeddings)
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}


def _longrope(half: int) -> dict:
    """transformers' ``longrope`` at factor 4 over the tiny native context: long factors 1..4 over the ``half``
    frequencies, short ones 1."""
    return {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
            "long_factor": [1.0 + 3.0 * i / max(1, half - 1) for i in range(half)], "short_factor": [1.0] * half}


def _native(model_type: str, model: torch.nn.Module, rope: dict | None = None, **options: float):
    """The same weights with transformers' own ``yarn`` rope type, factor 4 over the tiny native context (and
    ``options``: DeepSeek's mscale pair), or ``rope`` (``None`` where the type's config takes no such parameters)."""
    config = model.config.get_text_config()
    parameters = copy.deepcopy(getattr(config, "rope_parameters", None))
    if not isinstance(parameters, dict) or not parameters:
        return None
    yarn = rope or {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, **options}
    if all(isinstance(v, dict) or v is None for v in parameters.values()):  # (per layer type: those the family
        rotary = [k for k, v in parameters.items() if v is not None]  # patches by default; None: a NoPE type)
        default = [t for t in getattr(find_family(model), "default_layer_types", None) or () if t in rotary]
        parameters = {k: {**v, **yarn} if k in (default or rotary) else v for k, v in parameters.items()}
    else:
        parameters = {**parameters, **yarn}
    try:
        native = tiny_model(model_type, rope_parameters=parameters)
    except Exception:  # noqa: BLE001  (a config class that takes no yarn parameters: its own validation errors)
        return None
    native.load_state_dict(model.state_dict())
    return native


@pytest.mark.parametrize("model_type", model_types())
def test_every_rope_causal_lm_of_transformers(model_type):
    try:
        model = tiny_model(model_type)
        ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
        base = _logits(model, ids)
    except Exception as error:  # (the recipe's gap: listed with its words)
        assert model_type in NOT_BUILT, f"{model_type} does not build: {type(error).__name__}: {error}"
        assert NOT_BUILT[model_type] in str(error), f"{model_type} fails otherwise now: {error}"
        return
    assert model_type not in NOT_BUILT, f"{model_type} builds now: take it out of NOT_BUILT"
    own_cache = _cache_distance(model, ids, base)
    if model_type in NO_PADDED_BATCH:
        with pytest.raises(RuntimeError, match="must match the size"):  # (still: else take it out of the list)
            _padding_distance(model, ids)
    own_padding = None if model_type in NO_PADDED_BATCH else _padding_distance(model, ids)
    options = {"replace_scaling": True} if _existing_scaling(model) else {}
    try:
        support = find_family(model).support(model)
        rope_ext.patch(model, "yarn:factor=4", **options)
    except ValueError as error:
        assert "\n" not in str(error)
        assert model_type in FREQUENCY_REFUSED, f"{model_type}: yarn refused: {error}"
        assert FREQUENCY_REFUSED[model_type] in str(error)
        assert rope_ext.get_patch(model) is None and torch.equal(_logits(model, ids), base)
        # (what `rope-ext families` lists: the family's support refuses it too, but where the checkpoint decides)
        assert not support.fits("yarn") or model_type in CHECKPOINT_REFUSED, f"{model_type}: listed, refused"
        return
    assert model_type not in FREQUENCY_REFUSED, f"{model_type} takes yarn now: take it out of FREQUENCY_REFUSED"
    assert support.fits("yarn")
    patched = _logits(model, ids)
    half = next(m for m in model.modules() if isinstance(m, RopeExtRotaryEmbedding)).specs
    half = next(iter(half.values())).num_frequencies  # (the rotary frequencies of a patched layer type)
    # cached decoding: the prefix, then its last token on the cache, is the full forward, as close as the unpatched
    # model's own cache is to its full forward (a recurrent layer's cached path rounds otherwise: Bamba's)
    assert _cache_distance(model, ids, patched) <= 2 * own_cache + 1e-5
    if own_padding is not None:  # (a left-padded row is the row alone)
        assert _padding_distance(model, ids) <= 2 * own_padding + 1e-5
    rope_ext.unpatch(model)
    assert torch.equal(_logits(model, ids), base)
    if model_type in POSITION_FREE:  # (its tiny model's logits do not move with positions at all: still so?)
        with torch.no_grad():
            moved = model(input_ids=ids, position_ids=5 * torch.arange(ids.shape[1])[None]).logits
        assert torch.equal(moved, base), f"{model_type}: positions move its logits now: take it out of POSITION_FREE"
    else:
        assert not torch.equal(patched, base), f"{model_type}: yarn left the logits as they were"
    native = None if options else _native(model_type, model)
    if native is not None:
        torch.testing.assert_close(patched, _logits(native, ids), rtol=1e-5, atol=1e-5)
    for spec, rope in NATIVE.items() if native is not None else ():  # (transformers' other rope types, same weights)
        other = _native(model_type, model, rope)
        if other is not None:
            with rope_ext.patched(model, spec):
                torch.testing.assert_close(_logits(model, ids), _logits(other, ids), rtol=1e-5, atol=1e-5)
    long = torch.randint(3, VOCAB, (1, 2 * ORIGINAL + 8), generator=torch.Generator().manual_seed(1))
    dynamic = _native(model_type, model, DYNAMIC) if native is not None else None
    if dynamic is not None:  # (past the native context, where transformers' dynamic rope type rescales)
        with rope_ext.patched(model, "dynamic_ntk:factor=4"):
            torch.testing.assert_close(_logits(model, long), _logits(dynamic, long), rtol=1e-5, atol=1e-5)
    longrope = _native(model_type, model, _longrope(half)) if native is not None else None
    if longrope is not None:  # (its short factors within the native context, its long ones past it)
        with rope_ext.patched(model, "longrope:factor=4", long_factor=_longrope(half)["long_factor"]):
            for x in (ids, long):
                torch.testing.assert_close(_logits(model, x), _logits(longrope, x), rtol=1e-5, atol=1e-5)
    attention = find_family(model).locate(model).get("attention")
    if native is not None and attention and attention[0].softmax_scale is not None:  # (DeepSeek's mscale_all_dim:
        mscales = {"mscale": 1.0, "mscale_all_dim": 1.0}  # the softmax scale follows the rope parameters)
        with rope_ext.patched(model, "yarn:factor=4", **mscales):
            torch.testing.assert_close(_logits(model, ids), _logits(_native(model_type, model, **mscales), ids),
                                       rtol=1e-5, atol=1e-5)
        assert torch.equal(_logits(model, ids), base)
    refused = []
    for kind, spec in (("position_rule", "rerope:w=32"), ("bias", "alibi")):
        if kind not in support.kinds:
            continue
        try:
            with rope_ext.patched(model, spec):  # (the checkpoint's scaling kept: none of them replaces it)
                logits = _logits(model, ids)
        except ValueError as error:
            assert "\n" not in str(error) and RULE_REFUSED.get(model_type, "\n") in str(error), error
            refused.append(spec)
            continue
        finally:
            assert torch.equal(_logits(model, ids), base)
        if kind == "position_rule":  # (a window covering the 24 tokens: exact positions)
            torch.testing.assert_close(logits, base, rtol=1e-5, atol=1e-5)
        else:
            assert not torch.equal(logits, base)
    assert bool(refused) == (model_type in RULE_REFUSED), f"{model_type}: refused {refused}; RULE_REFUSED is stale"


# --- what a new user's trial of the found families met -------------------------------------------------------------


def test_a_model_cast_after_loading_whose_rotary_computes_in_float32_patches():
    """Phi-MoE's rotary recomputes its frequencies in float32 from the config whatever its buffer's dtype: a model
    cast to bf16 is standard RoPE, not refused."""
    model = tiny_model("phimoe").to(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    base = _logits(model, ids)
    with rope_ext.patched(model, "yarn:factor=4"):
        assert not torch.equal(_logits(model, ids), base)
    assert torch.equal(_logits(model, ids), base)


@pytest.mark.parametrize("spec", ["pi:factor=2", "yarn:factor=2", "ntk:factor=2"])
def test_ministral3s_attention_temperature_keeps_what_it_reads_under_any_method(spec):
    """Ministral 3's attention scales queries by ``llama_4_scaling_beta`` over the original context, both read from
    the rope parameters: a method that replaces the checkpoint's YaRN keeps them (pi's linear type dropped the
    original context: the first forward raised inside transformers)."""
    model = tiny_model("ministral3")
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    base = _logits(model, ids)
    kept = {k: model.config.rope_parameters[k] for k in ("llama_4_scaling_beta", "original_max_position_embeddings")}
    with rope_ext.patched(model, spec, replace_scaling=True):
        assert not torch.equal(_logits(model, ids), base)
        parameters = model.config.rope_parameters
        assert parameters["llama_4_scaling_beta"] == kept["llama_4_scaling_beta"]
        if not spec.startswith("yarn"):  # (YaRN states its own original context)
            assert parameters["original_max_position_embeddings"] == kept["original_max_position_embeddings"]
    assert torch.equal(_logits(model, ids), base)


def test_ministral3s_own_temperature_form_is_written_where_its_attention_reads_it(tmp_path):
    """``temperature:position_offset=0`` on Ministral 3 is its own ``llama_4_scaling_beta`` over the rope parameters'
    L: the patch writes it there (nothing else installed), equal to the same weights built with that beta, and plain
    transformers reloads it the same; a checkpoint with a beta of its own keeps it and the method multiplies it
    (replace_scaling replaces it, and refuses another form); a frequency method beside it leaves the native form."""
    def built(beta: float) -> torch.nn.Module:
        parameters = dict(rope_type="default", rope_theta=1e4, llama_4_scaling_beta=beta,
                          original_max_position_embeddings=16)
        return tiny_model("ministral3", rope_parameters=parameters)

    model, native = built(0.0), built(0.3)
    ids = torch.randint(3, VOCAB, (1, 80), generator=torch.Generator().manual_seed(0))
    base, reference = _logits(model, ids), _logits(native, ids)
    assert not torch.equal(base, reference)
    with rope_ext.patched(model, "temperature:attn_scale=0.3:position_offset=0"):
        assert model.config.rope_parameters["llama_4_scaling_beta"] == 0.3
        assert not list(installed_programs(model))
        assert torch.equal(_logits(model, ids), reference)
        model.save_pretrained(tmp_path)
    assert torch.equal(_logits(model, ids), base) and model.config.rope_parameters["llama_4_scaling_beta"] == 0.0
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), ids), reference)
    with rope_ext.patched(model, "temperature:attn_scale=0.3:floor_scale=16:position_offset=0:layers=rope"):
        assert list(installed_programs(model))  # (another form: the query scale in rope_ext's attention, same values)
        torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-5, atol=1e-5)
    with rope_ext.patched(native, "temperature:attn_scale=0.3:position_offset=0"):
        assert native.config.rope_parameters["llama_4_scaling_beta"] == 0.3 and list(installed_programs(native))
    with rope_ext.patched(native, "temperature:attn_scale=0.5:position_offset=0", replace_scaling=True):
        assert native.config.rope_parameters["llama_4_scaling_beta"] == 0.5 and not list(installed_programs(native))
    with pytest.raises(ValueError, match=r"^temperature: replace_scaling replaces this model's own "
                                         r"llama_4_scaling_beta only with its form, temperature:position_offset=0 "
                                         r"\(layers=all, floor_scale 16"):
        rope_ext.patch(native, "temperature:attn_scale=0.5", replace_scaling=True)
    with rope_ext.patched(model, "pi:factor=2+temperature:attn_scale=0.3:position_offset=0"):
        assert model.config.rope_parameters["llama_4_scaling_beta"] == 0.0 and list(installed_programs(model))
    assert torch.equal(_logits(native, ids), reference)


def test_rope_ext_families_says_why_a_family_is_refused(monkeypatch):
    """No RoPE family of transformers 5.23 is refused whole since Qwen3.5's M-RoPE takes the frequency methods (its
    line lists them); a family whose rotary module is not standard RoPE is listed refused with the reason."""
    from rope_ext.families import listing
    from rope_ext.families.rotary import NOT_STANDARD, RotaryFamily

    lines = listing()
    assert lines[0].startswith("family (model types)") and "(a family refused: why)" in lines[0]
    qwen = next(line for line in lines if line.startswith("qwen3_5 "))  # (its types alike, one line)
    assert "hooks: frequency; methods: dynamic_ntk, dynamic_yarn, llama3, longrope, ntk, ntk_by_parts, pi, yarn" in qwen
    assert not any("refused" in line for line in lines[1:])
    measured = RotaryFamily.rotary_refused
    monkeypatch.setattr(get_family("qwen3_5"), "_refusals", {})  # (each family keeps its measured refusals)
    monkeypatch.setattr(RotaryFamily, "rotary_refused",
                        lambda self, t: NOT_STANDARD[2][1] if t.startswith("qwen3_5") else measured(self, t))
    qwen = next(line for line in listing() if line.startswith("qwen3_5 "))  # (all its types alike: one line)
    assert "refused: its rotary module is not standard RoPE (measured on one built from its default config" in qwen


def test_a_model_whose_config_turns_rope_off_is_refused_saying_so():
    """Granite MoE Hybrid's default config has no position embedding (``position_embedding_type`` None): its modeling
    code has a rotary class, the model holds none; the refusal says so rather than "does not support"."""
    config = tiny_config("granitemoehybrid", position_embedding_type=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match=r"^GraniteMoeHybridForCausalLM: its modeling code has a rotary embedding "
                                         r"\(GraniteMoeHybridRotaryEmbedding\), but this model holds none: .* so there "
                                         r"is no RoPE to extend$"):
        rope_ext.patch(model, "yarn:factor=2")


def test_llama4s_attention_temperature_as_a_method_equals_transformers_own(monkeypatch):
    """``temperature:layers=nope`` on a Llama 4 whose own temperature tuning is off equals the same weights with it
    on (transformers' ``attn_temperature_tuning``), on a checkpoint whose chunks are past its input; a chunked
    Llama 4 refuses it (and every attention rewrite), saying why; layers=nope where no layer is NoPE is refused."""
    from rope_ext.families import Refusals

    settings = dict(no_rope_layers=[1, 0], floor_scale=8, attention_chunk_size=1000)
    model = tiny_model("llama4_text", attn_temperature_tuning=False, **settings)
    # (Llama 4's config class chunks by default, so the family refuses attention programs for every checkpoint: this
    # checkpoint's chunks are past its input, and both refusals are lifted for it alone)
    family = find_family(model)
    monkeypatch.setitem(vars(family).setdefault("_refusals", {}), "llama4_text", Refusals())
    monkeypatch.setattr("rope_ext.families.attention.chunking_refused", lambda size: None)  # (chunks past the input)
    native = tiny_model("llama4_text", attn_temperature_tuning=True, **settings)
    native.load_state_dict(model.state_dict())
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    base = _logits(model, ids)
    assert not torch.equal(base, _logits(native, ids))
    with rope_ext.patched(model, "temperature:layers=nope:floor_scale=8"):
        torch.testing.assert_close(_logits(model, ids), _logits(native, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(_logits(model, ids), base)
    monkeypatch.undo()
    chunked = tiny_model("llama4_text", attn_temperature_tuning=False, no_rope_layers=[1, 0], attention_chunk_size=16)
    monkeypatch.setitem(vars(family).setdefault("_refusals", {}), "llama4_text", Refusals())
    for spec in ("temperature:layers=nope", "logn", "alibi"):  # (the checkpoint's own refusal, past the family's)
        with pytest.raises(ValueError, match=r"its attention is chunked \(attention_chunk_size=16"):
            rope_ext.patch(chunked, spec)
    monkeypatch.undo()
    for spec in ("temperature:layers=nope", "logn"):  # (the family's: Llama 4's config class chunks by 8192)
        with pytest.raises(ValueError, match=r"does not fit llama4 .*its attention is chunked \(attention_chunk_size=8192"):
            rope_ext.patch(chunked, spec)
    with pytest.raises(ValueError, match=r"temperature: .* every attention layer of this model has positions \(no NoPE "
                                         r"layer to take layers=nope\); give layers=all or layers=rope"):
        rope_ext.patch(tiny_model("llama"), "temperature:layers=nope")


def test_a_bias_replaces_positions_only_on_the_layers_that_have_them():
    """Beam's full-attention layers have no rope parameters (NoPE): ALiBi goes to its sliding layers alone (it was
    added to every layer); AFMoE rotates under a condition of its forward rope_ext cannot read, so it refuses."""
    from rope_ext.installers.attention import installed_programs

    model = tiny_model("beam")
    with rope_ext.patched(model, "alibi"):
        terms = {model.config.layer_types[i]: len(program.terms)
                 for i, (_, program) in enumerate(installed_programs(model))}
    assert terms == {"sliding_attention": 1, "full_attention": 0}
    with pytest.raises(ValueError, match=r"under a condition of its own \(if self.is_local_attention: layers without "
                                         r"positions\), so rope_ext cannot tell which layers have positions"):
        rope_ext.patch(tiny_model("afmoe"), "alibi")


@pytest.mark.parametrize("model_type,head_dim,rotated", [("lfm3", 16, 4), ("gemma4_text", 32, 4)])
def test_proportional_rope_takes_frequency_methods_on_its_whole_head(model_type, head_dim, rotated, tmp_path):
    """Lfm3's and Gemma 4's full-attention layers rotate with proportional RoPE (transformers' ``proportional``: the
    whole head's frequencies ``base ** (-2i / head_dim)``, the last zero past ``partial_rotary_factor``'s share;
    Gemma 4's head size that layer type's own, from its per-layer config). ReRoPE crashed in Lfm3's forward before
    (it sized a quarter-head rotation): now every kind patches the whole head with those frequencies zero. PI equals
    transformers' own ``proportional`` with the factor, which ``save_pretrained`` writes and plain transformers
    reloads; YaRN's tables are transformers' YaRN of a head that size with the same frequencies zeroed (computed
    apart, on a Llama config); ReRoPE with a window covering the input is the unpatched model (where the family
    takes rewrites). The model reads its rotary module's ``layer_types`` through rope_ext's (AttributeError
    before), never the original's tensors or private attributes."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny_model(model_type)
    ids = torch.randint(3, VOCAB, (1, 2 * ORIGINAL + 8), generator=torch.Generator().manual_seed(0))
    base = _logits(model, ids)
    full = model.config.rope_parameters["full_attention"]
    assert full["rope_type"] == "proportional" and full["partial_rotary_factor"] * head_dim // 2 == rotated
    native = _native(model_type, model, {**full, "factor": 4.0})
    with rope_ext.patched(model, "pi:factor=4"):  # (proportional at factor 1 is no scaling to replace)
        torch.testing.assert_close(_logits(model, ids), _logits(native, ids), rtol=1e-5, atol=1e-5)
        assert model.config.rope_parameters["full_attention"] == {**full, "factor": 4.0}
        model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(reloaded, ids), _logits(native, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(_logits(model, ids), base)

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    whole = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                        max_position_embeddings=ORIGINAL, rope_parameters={"rope_theta": full["rope_theta"], **yarn})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](whole, None)
    assert inv_freq.shape == (head_dim // 2,)
    inv_freq[rotated:] = 0.0
    positions = torch.arange(2 * ORIGINAL)[None]
    angles = torch.cat([positions[..., None] * inv_freq] * 2, dim=-1)
    with rope_ext.patched(model, "yarn:factor=4"):
        cos, sin = model.model.rotary_emb(torch.zeros(1), positions, "full_attention")
        torch.testing.assert_close(cos, angles.cos() * factor, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, angles.sin() * factor, rtol=0, atol=1e-6)
        assert not torch.equal(_logits(model, ids), base)

    short, rewrites = ids[:, :24], "position_rule" in find_family(model).support(model).kinds
    with rope_ext.patched(model, "rerope:w=32" if rewrites else "pi:factor=2"):  # (a covering window: exact)
        if rewrites:
            torch.testing.assert_close(_logits(model, short), base[:, :24], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(_logits(model, ids), base, atol=1e-3)
        rotary = model.model.rotary_emb
        assert rotary.layer_types == rotary.original.layer_types and "layer_types" not in vars(rotary)
        with pytest.raises(AttributeError):  # (never the original's tensors: its frequencies are not the patch's)
            rotary.full_attention_original_inv_freq  # noqa: B018
        rotary.original._hf_hook, rotary.original.mrope_section = object(), None  # (accelerate's; HunYuan-VL's)
        assert not hasattr(rotary, "_hf_hook") and rotary.mrope_section is None
        del rotary.original._hf_hook, rotary.original.mrope_section
    assert torch.equal(_logits(model, ids), base)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_qwen35s_multimodal_rope_takes_frequency_methods_through_its_own_module(model_type, tmp_path):
    """Qwen3.5's M-RoPE (frequencies split among three position streams by ``mrope_section``) patched with YaRN
    through its own module: the logits equal transformers' own ``yarn`` on the same weights, on text and on
    position ids whose three streams differ (an image's grid: each stream's frequencies keep their positions);
    ``save_pretrained`` writes the native rope type with the sections kept, which plain transformers reloads to the
    same logits. Attention methods and biases are refused naming M-RoPE, the model untouched."""
    from transformers import AutoModelForCausalLM

    sections = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                "mrope_section": [3, 3, 2], "mrope_interleaved": True}  # (8 frequencies of a 16-dim head)
    model = tiny_model(model_type, rope_parameters=sections)
    assert model.model.rotary_emb.mrope_section == [3, 3, 2] and model.model.rotary_emb.inv_freq.numel() == 8
    ids = torch.randint(3, VOCAB, (1, 2 * ORIGINAL + 8), generator=torch.Generator().manual_seed(0))
    n = ids.shape[1]
    text = torch.arange(n)
    grid = torch.stack([text, text, text // 3, text % 5])[:, None]  # (text, time, height, width) x [1, n]
    base = _logits(model, ids)
    native = _native(model_type, model)
    assert native is not None and native.model.rotary_emb.mrope_section == model.model.rotary_emb.mrope_section
    for spec in ("rerope:w=32", "alibi"):
        with pytest.raises(ValueError, match=r"multimodal RoPE \(M-RoPE.*frequency methods patch it"):
            rope_ext.patch(model, spec)
        assert rope_ext.get_patch(model) is None and torch.equal(_logits(model, ids), base)
    rope_ext.patch(model, "yarn:factor=4")
    with torch.no_grad():
        patched_grid = model(input_ids=ids, position_ids=grid).logits
        torch.testing.assert_close(patched_grid, native(input_ids=ids, position_ids=grid).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(patched_grid, model(input_ids=ids).logits, atol=1e-3)  # (the streams matter)
    torch.testing.assert_close(_logits(model, ids), _logits(native, ids), rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    parameters = saved.config.rope_parameters
    assert parameters["rope_type"] == "yarn" and parameters["factor"] == 4.0
    assert parameters["mrope_section"] == [3, 3, 2] and parameters["mrope_interleaved"] is True
    torch.testing.assert_close(_logits(saved, ids), _logits(native, ids), rtol=1e-5, atol=1e-5)
    rope_ext.unpatch(model)
    assert torch.equal(_logits(model, ids), base)


def test_attention_classes_of_other_modalities_do_not_decide_what_the_text_layers_take():
    """Gemma 4's modeling module holds an audio attention that does not call transformers' attention interface; its
    text layers' attention does. The family's support is read off the text classes alone (it took the frequency
    methods only before): ALiBi patches a tiny Gemma 4 and unpatches exactly."""
    model = tiny_model("gemma4_text")
    family = find_family(model)
    assert [c.__name__ for c in family.attention_classes] == ["Gemma4TextAttention"]
    assert "bias" in family.support(model).kinds
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    base = _logits(model, ids)
    with rope_ext.patched(model, "alibi"):
        assert not torch.allclose(_logits(model, ids), base, atol=1e-3)
    assert torch.equal(_logits(model, ids), base)


def test_a_bias_of_the_head_size_takes_each_layers_own():
    """Sandwich's bias is built on the head size (``dim`` None: NeMo's choice); Gemma 4's full-attention layers have
    heads of their own size (32 here against 16): each layer's bias takes its own (the first layer's for all,
    before)."""
    model = tiny_model("gemma4_text")
    sizes = [layer.self_attn.head_dim for layer in model.model.layers]
    assert sizes == [16, 32]
    from rope_ext.attention.program import Bias

    with rope_ext.patched(model, "sandwich"):
        dims = [program.of_type(Bias)[0].fixed.dim for _, program in installed_programs(model)]
    assert dims == sizes


def test_a_query_scale_skips_sliding_window_layers_and_refuses_layer_types_it_does_not_read():
    """Temperature on every layer (``layers=all``, its default) took Gemma 4's sliding-window layers too, and cached
    generation failed once the cache passed the window (a trial found it; Gemma 3 and Lfm3 alike): full-attention
    layers only now, and greedy decoding with the cache equals decoding without it. ``layer_types`` beside
    ``layers=all`` was accepted and ignored: refused in one line."""
    model = tiny_model("gemma4_text")
    prompt = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^temperature: layer_types chooses the rotary layers of layers=rope; "
                                         r"layers=all takes its layers itself: leave layer_types out, or give "
                                         r"layers=rope$"):
        rope_ext.patch(model, "temperature", layer_types=["full_attention"])
    assert rope_ext.get_patch(model) is None
    with rope_ext.patched(model, "temperature"), torch.no_grad():
        scaled = [module.layer_type for module, program in installed_programs(model) if program.of_type(QueryScale)]
        assert scaled == ["full_attention"]
        cached = model.generate(prompt, max_new_tokens=40, do_sample=False)  # (past the tiny window of 32)
        full = model.generate(prompt, max_new_tokens=40, do_sample=False, use_cache=False)
    assert torch.equal(cached, full)


def test_replace_scaling_on_a_method_without_a_frequency_part_is_said_not_ignored():
    """``replace_scaling`` only lets a frequency method replace a checkpoint's scaling; given to DCA or ALiBi it did
    nothing, silently (a trial): now a warning says so, and the patch is as without it. An evaluation's
    ``--replace-scaling`` beside a list of methods reaches the frequency methods alone (no warning for the others)."""
    import warnings

    from rope_ext.runs.saved import with_method

    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    for spec in ("dca", "alibi"):
        with rope_ext.patched(model, spec):
            plain = _logits(model, ids)
        with pytest.warns(UserWarning, match=rf"^rope_ext: replace_scaling has no effect on {spec}: only a frequency "
                                             r"method replaces the checkpoint's own RoPE scaling \(and a temperature "
                                             r"Ministral 3's llama_4_scaling_beta\)$"):
            with rope_ext.patched(model, spec, replace_scaling=True):
                assert torch.equal(_logits(model, ids), plain)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with_method(model, rope_ext.methods.make_configs(spec), lambda: None, {"replace_scaling": True})


def test_qwen35s_rotary_patched_through_itself_under_accelerates_hooks(tmp_path):
    """Qwen3.5's M-RoPE is patched by calling its own module with the method's frequencies swapped in; loaded with
    ``device_map`` (accelerate's hooks on that module, offloaded to disk, and on a layer): the patched model gives
    the plain patched model's logits, generates, and unpatches bit-exactly."""
    ids = torch.randint(3, VOCAB, (1, 2 * ORIGINAL + 8), generator=torch.Generator().manual_seed(0))
    model, before, patched = patched_dispatched(tiny_model("qwen3_5_text"), tmp_path, "yarn:factor=4", ids,
                                                rotary="disk")
    assert hasattr(model.model.rotary_emb, "_hf_hook")
    assert not torch.allclose(patched, before, atol=1e-3)


@pytest.mark.parametrize("spec", ["yarn:factor=4", "dynamic_ntk:factor=4"])
def test_qwen35s_rotary_patched_through_itself_compiles_into_one_graph(spec):
    """The frequencies swapped into Qwen3.5's own M-RoPE module for the call (``called_with``) keep
    ``torch.compile(fullgraph=True)`` to one graph, on text positions and on three streams, inside and beyond the
    native context (a dynamic method's frequencies follow the length), equal to the uncompiled module."""
    model = tiny_model("qwen3_5_text")
    rope_ext.patch(model, spec)
    rotary = model.model.rotary_emb
    compiled = torch.compile(rotary, fullgraph=True, backend="eager", dynamic=False)
    x = torch.zeros(1, 4, 64)
    for length in (ORIGINAL // 2, 2 * ORIGINAL):
        text = torch.arange(length)[None]
        for positions in (text, torch.stack([text, text // 2, text % 5])):
            for got, expected in zip(compiled(x, positions), rotary(x, positions)):
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch._dynamo.reset()


def test_ministral3s_temperature_counts_the_pre_training_context_and_keeps_its_own_length():
    """(A trial's findings.) On a YaRN-scaled Ministral 3 the temperature's default step is the rope parameters' L
    (16), not the scaled window, in rope_ext's attention as natively; ``get_patch(resolved=True)`` states it either
    way; ``replace_scaling`` beside a frequency method says the model's own temperature stays; a frequency method that
    states another L leaves the temperature's L (the config keeps its rope parameters); an in-place edit of the rope
    parameters is named by its key when ``unpatch`` refuses."""
    def built(beta: float, rope_type: str = "yarn") -> torch.nn.Module:
        parameters = dict(rope_type=rope_type, factor=4.0, rope_theta=1e4, llama_4_scaling_beta=beta,
                          original_max_position_embeddings=16)
        return tiny_model("ministral3", rope_parameters=parameters)

    for beta in (0.0, 0.1):  # (native, then in rope_ext's attention: the same step)
        model = built(beta)
        with rope_ext.patched(model, "temperature:attn_scale=0.3:position_offset=0"):
            assert rope_ext.get_patch(model, resolved=True).floor_scale == 16
    model = built(0.2, "default")
    with pytest.warns(UserWarning, match=r"the model's own temperature \(llama_4_scaling_beta=0.2\) stays"):
        rope_ext.patch(model, "yarn:factor=2+temperature:attn_scale=0.3:position_offset=0", replace_scaling=True)
    rope_ext.unpatch(model)
    with rope_ext.patched(model, "yarn:factor=2:original_max_position_embeddings=8"):
        assert model.config.rope_parameters["original_max_position_embeddings"] == 16
    rope_ext.patch(model, "temperature:attn_scale=0.3:position_offset=0", replace_scaling=True)
    model.config.rope_parameters["llama_4_scaling_beta"] = 0.5
    with pytest.raises(RuntimeError, match=r"edited in place since the patch set it \(now \{'llama_4_scaling_beta': "
                                           r"0.5\}, set as \{'llama_4_scaling_beta': 0.3\}\)"):
        rope_ext.unpatch(model)


def test_recurrent_gemma_takes_a_frequency_method_with_its_length_stated():
    """Recurrent Gemma's config states no context length: a method given one patches (it crashed reading the config's
    max_position_embeddings), and unpatches exactly; PI, which takes none, is told what to do instead."""
    model = tiny_model("recurrent_gemma")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    base = _logits(model, ids)
    for spec in ("yarn:factor=2", "ntk:factor=2", "llama3:factor=2", "dynamic_ntk:factor=2"):
        with rope_ext.patched(model, f"{spec}:original_max_position_embeddings=16"):
            assert not torch.equal(_logits(model, ids), base)
        assert torch.equal(_logits(model, ids), base)
    with pytest.raises(ValueError, match=r"no original context length \(max_position_embeddings\); pi takes none of "
                                         r"its own: give the config one"):
        rope_ext.patch(model, "pi:factor=2")
