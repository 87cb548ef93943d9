"""Tiny models of every causal-LM model type transformers lists whose modeling code has a text rotary embedding: the
shrinking recipe (tests/test_conformance.py runs the checks; scripts/conformance.py writes the matrix).

``model_types()`` is read from transformers at run time (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` crossed with the
modeling files that define a ``*RotaryEmbedding`` class), so a new release's families are tried the day the pin
moves. ``tiny_config(model_type)`` shrinks the type's default config: the common sizes, MoE sizes, MLA ranks, a
layer-type list (an MLP's, an indexer's) cut to its first kinds, the text part of a composite config and its other
parts (vision, audio) made anew small; ``parameters_on_meta`` counts a model's parameters before anything is
allocated (a default config forgotten unshrunk is gigabytes).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rope_ext.families.discovered import rope_causal_lm_types

ORIGINAL = 64
VOCAB = 128
#: the sizes every tiny model takes where its config has the attribute
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=ORIGINAL, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False,
)
#: mixture-of-experts sizes
MOE: dict[str, Any] = dict(
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, shared_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1, num_dense_layers=1, zero_expert_num=2,
)
#: multi-head latent attention (DeepSeek-V2/V3 and their kin): the rotary part of the head is qk_rope_head_dim
MLA: dict[str, Any] = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
#: DeepSeek-V3.2's sparse attention indexer (its own small heads; 8 of them: with 2, keys whose ReLU'd scores are
#: all zero tie, and the top-k of a left-padded row picks other keys than the row alone); Qwen4-Exp's block indexer
#: (QSA: none by default, its checkpoint's), 2 blocks of 4 keys a query
INDEXER: dict[str, Any] = dict(index_head_dim=16, index_n_heads=8, index_topk=8, indexer_head_dim=16,
                               indexer_n_heads=8, indexer_kv_heads=1, indexer_budget=8, indexer_compress_ratio=4)
#: the sizes of a composite's other parts (vision, audio: built beside the text by some causal-LM classes), each
#: under its own names
PARTS: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, depth=1, num_blocks=1,
                             num_attention_heads=4, num_heads=4, attention_heads=4, head_dim=16,
                             max_position_embeddings=ORIGINAL)
#: the few types (or parts) the generic recipe cannot shrink alone (a hybrid's attention layer indices, sizes under
#: names of their own)
RECIPES: dict[str, dict[str, Any]] = {
    "bamba": dict(attn_layer_indices=[1]),
    "blt": dict(encoder_hash_byte_group_vocab=VOCAB,  # (its byte n-gram hash tables; its config has no layer count,
                num_hidden_layers=1),  # which the cache its forward makes reads)
    "blt_local_encoder": dict(hidden_size_global=PARTS["hidden_size"]),  # (the global transformer's width, read
    "blt_local_decoder": dict(hidden_size_global=PARTS["hidden_size"]),  # by the local ones under their names)
    "gemma3n_text": dict(num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=VOCAB),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=ORIGINAL,  # (its own size names; its attention
                 attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),  # config has no default theta)
                 ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)),
    "dots3_note_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16,  # (its
                            swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8,  # sliding layers' MLA
                            swa_v_head_dim=16),  # sizes, made into their per-layer config from these names)
    "gemma4_text": dict(global_head_dim=32, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], position_embedding_type="rope"),
    "zaya": dict(num_experts_per_tok=1),  # (the one routing it takes)
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1], use_mem_rope=True),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "mimo_v2_flash": dict(head_dim=24),  # (its partial rotary factor, 1/3, of 16 dims is an odd 5)
    "moshi": dict(sliding_window=4 * ORIGINAL),  # (its config takes no None)
}
#: the most parameters a tiny model may have
MAX_PARAMETERS = 5_000_000


def model_types() -> list[str]:
    """The causal-LM model types whose modeling file defines one text rotary class, sorted (read from transformers)."""
    return rope_causal_lm_types()


def _settable(config: Any, name: str) -> bool:  # (a property only with its setter: LongCat's layers, two a block)
    kind = getattr(type(config), name, None)
    return hasattr(config, name) and (not isinstance(kind, property) or kind.fset is not None)


def _kinds(config: Any, layers: int) -> dict[str, list]:
    """The config's per-layer kinds (``*_types``: an MLP's, an indexer's; or a pattern the layers repeat, Recurrent
    Gemma's ``block_types``) over ``layers``: their first kinds."""
    return {name: (list(dict.fromkeys(value)) * layers)[:layers] for name, value in config.to_dict().items()
            if name.endswith("_types") and isinstance(value, list) and _settable(config, name)
            and 1 < len(value) <= getattr(config, "num_hidden_layers", 0)}


def _shrunk(config: Any) -> dict[str, Any]:
    if hasattr(type(config), "allow_global_per_layer_attribute_access") or "per_layer_config" in config.to_dict():
        config.allow_global_per_layer_attribute_access = True  # (Gemma 4's: read the global sizes to shrink them)
    sizes = {**COMMON, **MOE}
    if getattr(config, "qk_rope_head_dim", None):  # (MLA: the rotary head is the rope part; as many key heads as
        sizes.update(MLA, head_dim=MLA["qk_rope_head_dim"],  # query heads, its keys expanded per head already)
                     qk_head_dim=MLA["qk_rope_head_dim"] + MLA["qk_nope_head_dim"],
                     num_key_value_heads=COMMON["num_attention_heads"])
    sizes.update(INDEXER)
    out = {name: value for name, value in sizes.items() if _settable(config, name)}
    layered = isinstance(getattr(config, "layer_types", None), (list, tuple)) and "layer_types" in config.to_dict()
    # (a window on every layer: a checkpoint's choice, off; kept beside other layer types, and where the sliding
    # layers are read off another pattern: Recurrent Gemma's blocks, whose window takes no None)
    windowed = layered or "sliding_attention" in (getattr(config, "layer_types", None) or ())
    for name in ("sliding_window", "attention_chunk_size"):
        if getattr(config, name, None) and _settable(config, name):
            out[name] = ORIGINAL // 2 if windowed else None
    layer_types = getattr(config, "layer_types", None)
    if (isinstance(layer_types, (list, tuple)) and layer_types and "layer_types" in config.to_dict()
            and "layer_types" not in out):
        kinds = list(dict.fromkeys(layer_types))
        out["layer_types"] = (kinds * 2)[: max(2, len(kinds))]
        out["num_hidden_layers"] = len(out["layer_types"])
    kinds = _kinds(config, out.get("num_hidden_layers", COMMON["num_hidden_layers"]))
    out.update({name: value for name, value in kinds.items() if name not in out})
    if layered and getattr(config, "rope_parameters", None) == {}:  # (per layer type, none by default: the
        kinds = dict.fromkeys(out.get("layer_types", layer_types))  # checkpoint's own; default RoPE on each)
        out["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 1e4} for kind in kinds}
    return {**out, **RECIPES.get(config.model_type, {})}


def _parts(config: Any, width: int) -> dict[str, dict[str, Any]]:
    """The composite's parts other than its text, made anew shrunk: PARTS, and any width equal to the part's own or
    the text's (``width``: an adapter's in and out) the tiny one."""
    parts = {}
    for name in getattr(config, "sub_configs", None) or ():
        part = getattr(config, name, None)
        if name == "text_config" or part is None:
            continue
        widths = {getattr(part, "hidden_size", None): PARTS["hidden_size"], width: COMMON["hidden_size"]}
        widths.pop(None, None)
        parts[name] = {**{k: widths[v] for k, v in part.to_dict().items() if type(v) is int and v in widths},
                       **{k: v for k, v in PARTS.items() if _settable(part, k)},
                       **_kinds(part, PARTS["num_hidden_layers"]), **RECIPES.get(part.model_type, {})}
    return parts


def tiny_config(model_type: str, **extra: Any) -> Any:
    """The type's default config shrunk (``extra`` on top: ``rope_parameters`` for a native rope type)."""
    config = AutoConfig.for_model(model_type)
    text = getattr(config, "text_config", None)
    if text is not None and text is not config:
        own = {k: v for k, v in text.to_dict().items() if k != "per_layer_config"}  # (Gemma 4's: made anew)
        kwargs = {**_parts(config, text.hidden_size), "text_config": {**own, **_shrunk(text), **extra}}
        return AutoConfig.for_model(model_type, **kwargs)
    parts = _parts(config, getattr(config, "hidden_size", None))
    rope = extra.get("rope_parameters")
    for name, part in parts.items() if isinstance(rope, dict) and "rope_type" in rope else ():  # (parts that
        own = getattr(getattr(config, name), "rope_parameters", None)  # rotate apart, BLT's: each the same rope
        if isinstance(own, dict) and "rope_type" in own:  # type over its own base)
            part["rope_parameters"] = {**own, **{k: v for k, v in rope.items() if k != "rope_theta"}}
    return AutoConfig.for_model(model_type, **{**parts, **_shrunk(config), **extra})


def parameters_on_meta(config: Any) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def tiny_model(model_type: str, seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A tiny randomly initialised model of ``model_type`` in eval mode; refuses a config the recipe leaves large."""
    config = tiny_config(model_type, **extra)
    count = parameters_on_meta(config)
    if count > MAX_PARAMETERS:
        raise ValueError(f"{model_type}: the tiny recipe leaves {count:,} parameters (a part it does not shrink)")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
