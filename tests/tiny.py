"""Tiny randomly initialised models of every supported family, built from configs (no hub)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ORIGINAL_CONTEXT = 64
VOCAB = 128
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=ORIGINAL_CONTEXT,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

#: model_type -> extra config; rope_parameters hold the *default* (unscaled) RoPE.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mistral": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=None),
    "qwen2": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, head_dim=16),
    "gemma": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, head_dim=16),
    "gemma2": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, head_dim=16, sliding_window=32),
    "gemma3_text": dict(
        head_dim=16,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
    "phi3": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        original_max_position_embeddings=ORIGINAL_CONTEXT,
    ),
    "gpt_neox": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "olmo2": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
for _model_type in ("olmo", "granite", "starcoder2", "stablelm", "phi", "smollm3", "glm4", "exaone4", "seed_oss",
                    "ernie4_5", "persimmon", "nemotron", "bitnet", "arcee", "apertus", "falcon"):
    FAMILY_CONFIGS[_model_type] = dict(rope_parameters=dict(_DEFAULT_ROPE))
for _model_type in ("mixtral", "qwen3_moe", "olmoe", "granitemoe"):
    FAMILY_CONFIGS[_model_type] = dict(rope_parameters=dict(_DEFAULT_ROPE), **_MOE)
FAMILY_CONFIGS["qwen2_moe"] = dict(rope_parameters=dict(_DEFAULT_ROPE), shared_expert_intermediate_size=32, **_MOE)
FAMILY_CONFIGS["olmo3"] = dict(rope_parameters=dict(_DEFAULT_ROPE), sliding_window=32,
                               layer_types=["sliding_attention", "full_attention"])
FAMILY_CONFIGS["ministral"] = dict(rope_parameters=dict(_DEFAULT_ROPE), sliding_window=32, head_dim=16,
                                   layer_types=["sliding_attention", "full_attention"])
FAMILY_CONFIGS["hunyuan_v1_dense"] = dict(rope_parameters=dict(_DEFAULT_ROPE), head_dim=16)
for _model_type in ("glm4", "seed_oss", "ernie4_5"):  # their default head_dim is 128
    FAMILY_CONFIGS[_model_type]["head_dim"] = 16

#: rope_ext family name -> model_type used to build it (the same name but for Gemma 3's text model)
FAMILY_MODEL_TYPES = {name: name for name in FAMILY_CONFIGS if name != "gemma3_text"} | {"gemma3": "gemma3_text"}


def tiny_config(family: str, rope_parameters: dict[str, Any] | None = None):
    model_type = FAMILY_MODEL_TYPES[family]
    kwargs = copy.deepcopy({**_COMMON, **FAMILY_CONFIGS[model_type]})
    if model_type == "gpt_neox":
        kwargs.pop("num_key_value_heads")
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    return AutoConfig.for_model(model_type, **kwargs)


#: families whose transformers model refuses SDPA (softcapping); they run eager
EAGER_ONLY = {"gemma2"}


def tiny_model(family: str, rope_parameters: dict[str, Any] | None = None, seed: int = 0, attn: str | None = None):
    attn = attn or ("eager" if family in EAGER_ONLY else "sdpa")
    torch.manual_seed(seed)
    config = tiny_config(family, rope_parameters)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


def rotary_dim(family: str) -> int:
    config = tiny_config(family)
    params = config.rope_parameters
    params = params.get("full_attention", params)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def native_model(family: str, scaled: dict[str, Any], weights_from) -> torch.nn.Module:
    """The same weights built with transformers' own ``rope_parameters`` (scaled for the patched layer type)."""
    base = copy.deepcopy(FAMILY_CONFIGS[FAMILY_MODEL_TYPES[family]]["rope_parameters"])
    if family == "gemma3":
        base["full_attention"] = {**base["full_attention"], **scaled}
    else:
        base = {**base, **scaled}
    model = tiny_model(family, rope_parameters=base)
    model.load_state_dict(weights_from.state_dict())
    return model


def input_ids(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@torch.no_grad()
def logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return model(input_ids=ids, **kwargs).logits


def patched_dispatched(plain, folder, spec: str, ids: torch.Tensor, rotary: str = "cpu"):
    """``plain`` saved under ``folder`` and reloaded with ``device_map`` (its second layer offloaded to disk, its
    rotary module on ``rotary``: accelerate's hooks load their weights for each forward). Checks that it gives
    ``plain``'s logits; that, both patched with ``spec``, it gives the plain patched model's logits and generates;
    and that ``unpatch`` restores its own bit-exactly. Returns ``(dispatched model, logits before, logits patched)``
    for the caller's checks."""
    import rope_ext

    plain.save_pretrained(folder / "model")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": rotary, "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(folder / "model", device_map=device_map,
                                                 offload_folder=folder / "offload").eval()
    assert model.hf_device_map["model.layers.1"] == "disk"
    with torch.no_grad():
        before = model(ids).logits
        torch.testing.assert_close(before, plain(ids).logits, rtol=1e-5, atol=1e-5)
        torch.manual_seed(0)  # (a learnable bias's initialisation: the same for both)
        rope_ext.patch(model, spec)
        torch.manual_seed(0)
        rope_ext.patch(plain, spec)
        patched = model(ids).logits
        torch.testing.assert_close(patched, plain(ids).logits, rtol=1e-5, atol=1e-5)
        assert model.generate(ids[:, :20], max_new_tokens=4, do_sample=False).shape == (1, 24)
        rope_ext.unpatch(model)
        assert torch.equal(model(ids).logits, before)
    return model, before, patched
