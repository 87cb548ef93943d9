"""SGLang's rotation from a model's ``config.json``: what ``get_rope`` builds and the context length it derives.

Read from sgl-project/sglang (main, mid 2026; versions differ file to file), under
``python/sglang/srt/layers/rotary_embedding/``: ``factory.py`` (``get_rope``: branches and key whitelists, 108c36c0),
``base.py`` (``RotaryEmbedding``, ``LinearScalingRotaryEmbedding``), ``yarn.py`` (``YaRNScalingRotaryEmbedding``,
``yarn_*`` helpers, 0b1fd02d), ``rope_variant.py`` (LongRoPE, DeepSeek, Llama 3, both dynamic NTKs, dual chunk,
0b1fd02d); ``get_context_length`` (``hf_transformers_utils``); ``models/llama.py``, ``models/deepseek_v2.py``; PR
#31232 (yarn ``mscale``/``mscale_all_dim``, merged July 2026).

Same as vLLM (``rope_ext.serving.engines.vllm``, whose helpers this reuses): the standardised ``rope_parameters``,
``rotary_dim``, the float32 cache arithmetic of default, linear, dynamic (factor or ``alpha``), llama3 and
``deepseek_yarn``, DeepSeek's softmax scale, dual chunk attention (the Qwen model set is assumed, not checked).
Where it differs:

* Types: no ``ntk`` and no ``deepseek_llama_scaling`` (both raise); ``proportional`` (Gemma 4) and FoPE
  (``use_fope``) exist but are not modelled here. A missing ``factor`` is 1, ``low_freq_factor`` 1,
  ``high_freq_factor`` 4, ``original_max_position_embeddings`` ``max_position_embeddings`` (a warning, no error).
* ``yarn`` reads ``mscale`` and ``mscale_all_dim``: when both are stated (even 0) cos/sin carry
  ``attn_factor x m(mscale) / m(mscale_all_dim)``, else ``attn_factor x (0.1 ln factor + 1)``; ``truncate`` is
  read; ``attention_factor`` and ``apply_yarn_scaling`` are not.
* ``longrope`` picks the factors per batch: all positions take the long cache when any position exceeds ``L``
  (strictly); a batch whose largest position is exactly ``L`` reads row ``L`` of the concatenated short+long cache,
  the long cache's row 0 (cos 1, sin 0).
* DeepSeek-V2/V3 always use ``deepseek_yarn`` (no ``apply_yarn_scaling``), so the softmax scale always changes.
* Context length: the first of ``max_sequence_length``, ``seq_length``, ``max_seq_len``, ``model_max_length``,
  ``max_position_embeddings``, ``x factor`` unless the rope dict holds ``original_max_position_embeddings`` or is
  llama3 (transformers 5 adds that key for yarn/longrope/llama3, so yarn serves ``max_position_embeddings``).
* The cache stays float32 on CUDA/HIP (vLLM casts it to the model dtype).
"""

from __future__ import annotations

import torch

from rope_ext.serving.engines.vllm import (
    BETA_FAST,
    BETA_SLOW,
    DCA_MODEL_TYPES,
    DEEPSEEK_MODEL_TYPES,
    DEFAULT_MAX_LEN,
    cos_sin32,
    deepseek_softmax_scale,
    default_inv_freq,
    dual_chunk,
    layout,
    llama3_inv_freq,
    longrope_inv_freq,
    longrope_mscale,
    ntk_base,
    rope_parameters,
    rotary_dim,
    unread,
    yarn_inv_freq,
    yarn_mscale,
)
from rope_ext.serving.rotation import Rotation

KNOWN_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "deepseek_yarn", "longrope", "proportional")
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
MISSING_DEFAULTS = {"factor": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
READS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "alpha"),
    "yarn": ("factor", "original_max_position_embeddings", "extrapolation_factor", "attn_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "deepseek_yarn": ("factor", "original_max_position_embeddings", "extrapolation_factor", "attn_factor",
                      "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "short_mscale", "long_mscale"),
}
COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
REASONS = {
    ("*", "rope_dim"): "SGLang sizes the rotation by partial_rotary_factor only",
    ("yarn", "attention_factor"): "not in SGLang's yarn whitelist: cos/sin carry attn_factor x m(mscale) / "
                                  "m(mscale_all_dim), or attn_factor x (0.1 ln factor + 1)",
    ("yarn", "apply_yarn_scaling"): "a vLLM-only key: SGLang always applies the YaRN magnitude",
    ("deepseek_yarn", "truncate"): "DeepseekScalingRotaryEmbedding always floors/ceils the ramp",
    ("deepseek_yarn", "attention_factor"): "not in SGLang's deepseek_yarn whitelist",
    ("deepseek_yarn", "apply_yarn_scaling"): "SGLang's deepseek_v2 always uses deepseek_yarn",
    ("longrope", "factor"): "the default mscale uses max_position_embeddings / original_max_position_embeddings",
    ("longrope", "attention_factor"): "not in SGLang's longrope whitelist: short_mscale/long_mscale or "
                                      "sqrt(1 + ln s / ln L) instead",
}


def context_length(config: dict, params: dict) -> int:
    """``get_context_length``: the first length key (2048 if none), ``x factor`` unless the rope dict holds
    ``original_max_position_embeddings`` or is llama3."""
    factor = params.get("factor", 1) or 1
    if "original_max_position_embeddings" in params or params["rope_type"] == "llama3":
        factor = 1
    length = next((config[k] for k in CONTEXT_LENGTH_KEYS if config.get(k) is not None), DEFAULT_MAX_LEN)
    return int(factor * length)


def _param(params: dict, key: str, default, notes: list[str]):
    """``params[key]``, else ``default`` with the warning SGLang logs."""
    if key in params:
        return params[key]
    notes.append(f"rope dict has no {key}: SGLang warns and uses {default}")
    return default


def rotation(config: dict, positions: torch.Tensor, max_model_len: int | None = None) -> Rotation:
    """SGLang's cos/sin for ``config`` at ``positions`` (one batch), served with ``--context-length max_model_len``."""
    params, prefix = rope_parameters(config), layout(config)
    dim = rotary_dim(config, {k: v for k, v in params.items() if k != "rope_dim"})
    kind, base = params["rope_type"], float(params["rope_theta"])
    max_pos = int(config.get("max_position_embeddings", DEFAULT_MAX_LEN))
    default_len = context_length(config, params)
    model_type = str(config.get("model_type", ""))
    notes = ["SGLang keeps the cache in float32 on CUDA/HIP"]
    if max_model_len and max_model_len > default_len:
        notes.append(f"--context-length {max_model_len} > derived {default_len}: refused unless "
                     "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    if config.get("dual_chunk_attention_config") is not None:
        if model_type in DCA_MODEL_TYPES:
            result = dual_chunk(config, params, positions, dim, prefix, "SGLang")
            result.max_length, result.notes = default_len, notes + result.notes
            return result
        notes.append("dual_chunk_attention_config: read only by the Qwen2/Qwen3 model families")
    if kind not in KNOWN_TYPES:
        raise ValueError(f"SGLang knows no rope type {kind!r}; it knows {', '.join(KNOWN_TYPES)}")
    if model_type in DEEPSEEK_MODEL_TYPES and kind != "default":
        notes.append(f"{model_type} attention maps rope_type {kind} to deepseek_yarn")
        kind = "deepseek_yarn"
    if kind not in READS:
        raise ValueError(f"SGLang's {kind} rope is not modelled here; modelled: {', '.join(READS)}")
    scale, divisor, softmax, reads = 1.0, 1.0, None, READS[kind]
    if kind in ("linear", "dynamic", "yarn", "deepseek_yarn", "llama3"):
        factor = float(_param(params, "factor", MISSING_DEFAULTS["factor"], notes))
    if kind in ("yarn", "deepseek_yarn", "llama3", "longrope"):
        original = int(_param(params, "original_max_position_embeddings", max_pos, notes))
    if kind == "default":
        inv = default_inv_freq(dim, base)
    elif kind == "linear":
        inv, divisor = default_inv_freq(dim, base), factor
    elif kind == "dynamic" and "alpha" in params:
        inv = default_inv_freq(dim, ntk_base(base, dim, float(params["alpha"])))
    elif kind == "dynamic":
        inv = default_inv_freq(dim, ntk_base(base, dim, factor * (max_pos * factor) / max_pos - (factor - 1)))
        notes.append(f"dynamic is static NTK at max_position_embeddings x factor = {int(max_pos * factor)} for "
                     "every position, as in vLLM")
    elif kind in ("yarn", "deepseek_yarn"):
        attn = float(params.get("attn_factor", 1.0))
        inv = yarn_inv_freq(dim, base, factor, original, params.get("beta_fast", BETA_FAST),
                            params.get("beta_slow", BETA_SLOW), float(params.get("extrapolation_factor", 1.0)),
                            kind == "deepseek_yarn" or bool(params.get("truncate", True)))
        if kind == "deepseek_yarn":
            ratio = yarn_mscale(factor, float(params.get("mscale", 1))) / yarn_mscale(
                factor, float(params.get("mscale_all_dim", 0)))
            scale, softmax = ratio * attn, deepseek_softmax_scale(config, params | {"factor": factor})
        elif params.get("mscale") is not None and params.get("mscale_all_dim") is not None:
            scale = yarn_mscale(factor, float(params["mscale"])) / yarn_mscale(
                factor, float(params["mscale_all_dim"])) * attn
        else:
            scale = yarn_mscale(factor) * attn
    elif kind == "llama3":
        low = float(_param(params, "low_freq_factor", MISSING_DEFAULTS["low_freq_factor"], notes))
        high = float(_param(params, "high_freq_factor", MISSING_DEFAULTS["high_freq_factor"], notes))
        inv = llama3_inv_freq(dim, base, factor, low, high, original)
    else:
        return _longrope(params, positions, dim, base, max_pos, original, prefix, default_len, notes)
    if kind == "dynamic" and "alpha" in params:
        reads = ("alpha", "factor")
    cos, sin = cos_sin32(inv, positions, scale, divisor)
    ignored = unread(params, kind, reads, prefix, "SGLang", REASONS, COMMON_KEYS)
    return Rotation(cos, sin, softmax_scale=softmax, ignored=ignored, max_length=default_len, notes=notes)


def _longrope(params: dict, positions: torch.Tensor, dim: int, base: float, max_pos: int, original: int,
              prefix: str, default_len: int, notes: list[str]) -> Rotation:
    """Rows of ``cat(short cache [L rows], long cache)`` at ``p + L`` when any ``p > L``, else at ``p``."""
    default = longrope_mscale(max_pos, original)
    short = longrope_inv_freq(dim, base, params["short_factor"]), float(params.get("short_mscale") or default)
    long = longrope_inv_freq(dim, base, params["long_factor"]), float(params.get("long_mscale") or default)
    use_long = bool(len(positions)) and bool((positions > original).any())
    rows = positions + original if use_long else positions
    in_short = rows < original
    cos_s, sin_s = cos_sin32(short[0], rows, short[1])
    cos_l, sin_l = cos_sin32(long[0], rows - original, long[1])
    cos = torch.where(in_short[:, None], cos_s, cos_l)
    sin = torch.where(in_short[:, None], sin_s, sin_l)
    notes.append(f"longrope: {'a position > ' if use_long else 'no position > '}{original} in this batch: the "
                 f"{'long' if use_long else 'short'} factors for all its positions (vLLM decides by max_model_len)")
    if not use_long and bool((positions == original).any()):
        notes.append(f"position {original} with the short factors reads the long cache's row 0 (cos 1, sin 0)")
    ignored = unread(params, "longrope", READS["longrope"], prefix, "SGLang", REASONS, COMMON_KEYS)
    return Rotation(cos, sin, ignored=ignored, max_length=default_len, notes=notes)
