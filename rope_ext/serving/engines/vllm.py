"""vLLM's rotation from a model's ``config.json``: what ``get_rope`` builds and the ``max_model_len`` it derives.

Read from vllm-project/vllm (mainline around v0.25, mid 2026; the index holds versions file by file):
``vllm/model_executor/layers/rotary_embedding/__init__.py`` (``get_rope``: the branches and their key whitelists,
926c71f6), ``base.py`` (072d10a0), ``common.py`` (``yarn_*`` helpers with ``truncate``), ``yarn_scaling_rope.py``,
``deepseek_scaling_rope.py`` (7bc8d408), ``linear_scaling_rope.py``, ``ntk_scaling_rope.py``,
``dynamic_ntk_scaling_rope.py``, ``dynamic_ntk_alpha_rope.py``, ``llama3_rope.py``, ``phi3_long_rope_scaled_rope.py``,
``dual_chunk_rope.py``; ``vllm/transformers_utils/config.py`` (``patch_rope_parameters``), ``vllm/config/model.py``
(``_get_and_verify_max_len``), ``vllm/model_executor/models/{deepseek_v2,qwen2,qwen3}.py``.

* Keys: transformers 5 builds ``rope_parameters`` (``rope_scaling`` wins when both are stated; ``type`` gives
  ``rope_type``; top-level ``rope_theta``, ``partial_rotary_factor`` fill in; for llama3/yarn/longrope a top-level
  ``original_max_position_embeddings`` wins, else ``max_position_embeddings``); vLLM renames ``su`` to ``longrope``.
  ``rotary_dim = int(head_dim * partial_rotary_factor)`` (a later ``get_rope`` reads ``rope_dim`` first).
* Types: ``default`` ``base^(-2i/d)``; ``linear`` positions ``/ factor``; ``ntk`` (Su's fixed NTK: base ``x factor``,
  frequencies ``/ factor^(2/d)``; ``mixed_b``: ``/ exp(a k^b)``, ``a = ln factor / (d/2)^b``); ``dynamic`` (``alpha``:
  base ``x alpha^(d/(d-2))``; else static NTK at ``max_position_embeddings x factor``: base
  ``x (factor^2 - factor + 1)^(d/(d-2))`` for every position); ``yarn`` (whitelist ``extrapolation_factor``,
  ``attn_factor``, ``beta_fast``, ``beta_slow``, ``apply_yarn_scaling``, ``truncate``; cos/sin carry
  ``attn_factor x (0.1 ln factor + 1)``, or ``attn_factor`` with ``apply_yarn_scaling: false``);
  ``deepseek_yarn``/``deepseek_llama_scaling`` (``mscale``, ``mscale_all_dim``: cos/sin carry
  ``attn_factor x m(mscale) / m(mscale_all_dim)``, ``m(x) = 0.1 x ln factor + 1``; the ramp always truncates);
  ``llama3``; ``longrope`` (``short_mscale``/``long_mscale``, default ``sqrt(1 + ln s / ln L)``,
  ``s = max_position_embeddings / L``). DeepSeek-V2/V3 attention turns any other type into ``deepseek_yarn``
  (``deepseek_llama_scaling`` with ``apply_yarn_scaling: false``) and, for ``deepseek_yarn``, multiplies the softmax
  scale by ``m(mscale_all_dim)^2``.
* ``dual_chunk_attention_config`` (read by Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE) wins over every rope type.
* Caches are float32 (``arange(n) x inv_freq``, then ``x mscale``), cast to the model dtype by vLLM; returned here
  before that cast, as float64.
"""

from __future__ import annotations

import math

import torch

from rope_ext.serving.rotation import Rotation

DEFAULT_THETA = 10000.0
MSCALE_SLOPE = 0.1
BETA_FAST = 32
BETA_SLOW = 1
RAMP_EPSILON = 0.001
DEFAULT_MAX_LEN = 2048
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_sequence_length", "max_seq_length", "seq_len")
UNSCALED_LEN_TYPES = ("su", "longrope", "llama3")
ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")
KNOWN_TYPES = ("default", "llama3", "mllama4", "linear", "ntk", "dynamic", "xdrope", "yarn", "deepseek_yarn",
               "deepseek_llama_scaling", "longrope", "openpangu")
DCA_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
LEGACY_PAIRS = (("su", "longrope"), ("mrope", "default"))
COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "rope_dim")
READS = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor", "mixed_b"),
    "dynamic": ("factor", "alpha"),
    "yarn": ("factor", "original_max_position_embeddings", "extrapolation_factor", "attn_factor", "beta_fast",
             "beta_slow", "apply_yarn_scaling", "truncate"),
    "deepseek_yarn": ("factor", "original_max_position_embeddings", "extrapolation_factor", "attn_factor",
                      "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "apply_yarn_scaling"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "short_mscale", "long_mscale"),
}
REASONS = {
    ("yarn", "attention_factor"): "not in get_rope's yarn whitelist (PR #48351 open): cos/sin carry "
                                  "attn_factor x (0.1 ln factor + 1) instead",
    ("yarn", "mscale"): "not in get_rope's yarn whitelist (#48621): transformers' m(mscale) / m(mscale_all_dim) "
                        "is not applied",
    ("yarn", "mscale_all_dim"): "not in get_rope's yarn whitelist (#48621); only deepseek_yarn reads it",
    ("deepseek_yarn", "truncate"): "DeepseekScalingRotaryEmbedding always floors/ceils the ramp",
    ("deepseek_yarn", "attention_factor"): "not in get_rope's deepseek_yarn whitelist: "
                                           "attn_factor x m(mscale) / m(mscale_all_dim) instead",
    ("longrope", "factor"): "the default mscale uses max_position_embeddings / original_max_position_embeddings",
    ("longrope", "attention_factor"): "not in get_rope's longrope whitelist: short_mscale/long_mscale or "
                                      "sqrt(1 + ln s / ln L) instead",
    ("dynamic", "factor"): "alpha is stated: DynamicNTKAlphaRotaryEmbedding uses alpha only",
}


def layout(config: dict) -> str:
    """The config's rope key as stated: ``rope_scaling`` (legacy, wins when both are there) or ``rope_parameters``."""
    return "rope_scaling" if config.get("rope_scaling") else "rope_parameters"


def rope_parameters(config: dict) -> dict:
    """The ``rope_parameters`` dict ``get_rope`` receives: transformers 5's standardisation, then vLLM's patch."""
    params = dict(config.get(layout(config)) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    legacy = params.get("type", params["rope_type"])
    if legacy != params["rope_type"] and (legacy, params["rope_type"]) not in LEGACY_PAIRS:
        raise ValueError(f"rope_type={params['rope_type']} conflicts with type={legacy}")
    params["rope_type"] = {"su": "longrope", "mrope": "default"}.get(params["rope_type"], params["rope_type"])
    theta = next((config[k] for k in ("rope_theta", "rotary_emb_base") if config.get(k) is not None), DEFAULT_THETA)
    params.setdefault("rope_theta", theta)
    names = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")
    partial = next((config[k] for k in names if config.get(k) is not None), None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in ORIGINAL_LEN_TYPES:
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def head_size(config: dict) -> int:
    """``head_dim``, else ``hidden_size // num_attention_heads``; DeepSeek MLA rotates ``qk_rope_head_dim``."""
    if config.get("qk_rope_head_dim"):
        return int(config["qk_rope_head_dim"])
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rotary_dim(config: dict, params: dict) -> int:
    """``int(head_size * partial_rotary_factor)`` (in ``(0, 1]``), or ``rope_dim`` where stated."""
    if params.get("rope_dim"):
        return int(params["rope_dim"])
    partial = params.get("partial_rotary_factor", 1.0)
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"partial_rotary_factor={partial} must be in (0, 1]")
    return int(head_size(config) * partial)


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """``1 / base^(2i/d)`` in float32, as ``RotaryEmbedding._compute_inv_freq``."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def ntk_inv_freq(dim: int, base: float, factor: float, mixed_b: float | None) -> torch.Tensor:
    """Su's NTK: fixed (``(base factor)^(-2i/d) / factor^(2/d)``) or mixed (``base^(-2i/d) / exp(a k^b)``)."""
    if mixed_b is None:
        return default_inv_freq(dim, base * factor) / factor ** (2 / dim)
    a = torch.tensor(factor).log() / (dim / 2) ** mixed_b
    return default_inv_freq(dim, base) / (a * torch.arange(1, dim // 2 + 1).float() ** mixed_b).exp()


def ntk_base(base: float, dim: int, ratio: float) -> float:
    """NTK-aware base ``base x ratio^(d/(d-2))``."""
    return base * ratio ** (dim / (dim - 2))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 mscale ln(scale) + 1`` above 1, else 1 (``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else MSCALE_SLOPE * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, factor: float, original: int, beta_fast: float = BETA_FAST,
                  beta_slow: float = BETA_SLOW, extrapolation: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN's frequencies: ``base^(-2i/d)`` kept below the ramp, ``/ factor`` above, the ramp between ``d(32)``,
    ``d(1)`` (``d(b) = d ln(L / (2 pi b)) / (2 ln base)``, floored/ceiled unless ``truncate`` is false)."""

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(beta_fast), correction(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += RAMP_EPSILON
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * extrapolation
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def llama3_inv_freq(dim: int, base: float, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama 3.1: wavelengths under ``L / high`` kept, over ``L / low`` divided by ``factor``, smoothed between."""
    inv = default_inv_freq(dim, base)
    wave = 2 * math.pi / inv
    smooth = (original / wave - low) / (high - low) if low != high else 0
    mixed = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wave < original / high, inv, torch.where(wave > original / low, inv / factor, mixed))


def longrope_inv_freq(dim: int, base: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE: ``1 / (factor_i base^(2i/d))``."""
    rescale = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (rescale * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def longrope_mscale(max_position: int, original: int) -> float:
    """``sqrt(1 + ln s / ln L)`` with ``s = max_position / L`` above 1, else 1."""
    scale = max_position / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def cos_sin32(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0, divisor: float = 1.0):
    """The cache rows at ``positions``: ``cos``/``sin`` of ``(p / divisor) x f`` in float32, ``x scale``, as float64."""
    t = positions.to(torch.float32)
    if divisor != 1.0:
        t = t / divisor
    angles = t[:, None] * inv_freq.to(torch.float32)[None, :]
    return (angles.cos() * scale).double(), (angles.sin() * scale).double()


def unread(params: dict, kind: str, reads: tuple, prefix: str, engine: str, reasons: dict,
           common: tuple = COMMON_KEYS) -> list[str]:
    """``prefix.key: why`` for every stated key the branch ``kind`` does not read (``reasons`` by ``(kind, key)``,
    then ``("*", key)``)."""
    lines = []
    for key in params:
        if key in common or key in reads:
            continue
        why = reasons.get((kind, key)) or reasons.get(("*", key)) or f"not read by {engine}'s {kind} branch"
        lines.append(f"{prefix}.{key}: {why}")
    return lines


def deepseek_softmax_scale(config: dict, params: dict) -> float:
    """``qk_head_dim^-0.5 x m(mscale_all_dim)^2`` (``m`` is ``yarn_mscale`` at ``factor``)."""
    qk_head = int(config.get("qk_nope_head_dim", 0)) + head_size(config)
    mscale = yarn_mscale(float(params["factor"]), float(params.get("mscale_all_dim", 0) or 0))
    return qk_head ** -0.5 * mscale * mscale


def dual_chunk(config: dict, params: dict, positions: torch.Tensor, dim: int, prefix: str, engine: str) -> Rotation:
    """Dual Chunk Attention's intra-chunk rotation: plain RoPE at ``p % (chunk_size - local_size)``."""
    dca = config["dual_chunk_attention_config"]
    chunk_len = int(dca["chunk_size"]) - int(dca["local_size"])
    cos, sin = cos_sin32(default_inv_freq(dim, float(params["rope_theta"])), positions % chunk_len)
    ignored = [f"{prefix}.{k}: dual_chunk_attention_config wins over the rope type"
               for k in params if k not in COMMON_KEYS]
    ignored += [f"dual_chunk_attention_config.{k}: not read by {engine}'s rotary embedding"
                for k in dca if k not in ("chunk_size", "local_size", "sparse_attention_config")]
    notes = [
        (f"dual chunk attention: chunk_len = chunk_size - local_size = {chunk_len}; the cos/sin returned are the "
         "intra-chunk ones (queries and keys at p % chunk_len)"),
        ("queries against the previous chunk rotate at min(p % chunk_len + chunk_len, chunk_size), against earlier "
         "chunks at the constant min(2 chunk_len - 1, chunk_size); keys always at p % chunk_len"),
        "rope scaling (factor, yarn...) is not applied under dual chunk attention",
    ]
    return Rotation(cos, sin, ignored=ignored, notes=notes)


def max_length(config: dict, params: dict) -> int:
    """``_get_and_verify_max_len`` with no user value: the smallest length key (2048 if none), ``x factor`` unless
    the type is su/longrope/llama3 (yarn starts from ``original_max_position_embeddings``); longrope defaults to the
    config's top-level ``original_max_position_embeddings``."""
    found = [config[k] for k in MAX_LEN_KEYS if config.get(k) is not None]
    derived = min(found) if found else DEFAULT_MAX_LEN
    kind = params["rope_type"]
    if "gemma3" not in str(config.get("model_type", "")) and kind not in UNSCALED_LEN_TYPES:
        if kind == "yarn":
            derived = params["original_max_position_embeddings"]
        derived *= params.get("factor") or 1.0
    if kind == "longrope":
        return int(config.get("original_max_position_embeddings") or derived)
    return int(derived)


def rotation(config: dict, positions: torch.Tensor, max_model_len: int | None = None) -> Rotation:
    """vLLM's cos/sin for ``config`` at ``positions``, served with ``--max-model-len max_model_len`` (None: derived)."""
    params, prefix = rope_parameters(config), layout(config)
    kind, base = params["rope_type"], float(params["rope_theta"])
    dim, max_pos = rotary_dim(config, params), int(config.get("max_position_embeddings", DEFAULT_MAX_LEN))
    default_len = max_length(config, params)
    served = max_model_len or default_len
    model_type = str(config.get("model_type", ""))
    notes = ["vLLM casts the cache to the model dtype; values here are its float32 rows"]
    if max_model_len and max_model_len > default_len:
        notes.append(f"--max-model-len {max_model_len} > derived {default_len}: refused unless "
                     "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    if config.get("dual_chunk_attention_config") is not None:
        if model_type in DCA_MODEL_TYPES:
            result = dual_chunk(config, params, positions, dim, prefix, "vLLM")
            result.max_length, result.notes = default_len, notes + result.notes
            return result
        notes.append("dual_chunk_attention_config: read only by the Qwen2/Qwen2-MoE/Qwen3/Qwen3-MoE models")
    if kind not in KNOWN_TYPES:
        raise ValueError(f"vLLM knows no rope type {kind!r}; it knows {', '.join(KNOWN_TYPES)}")
    if model_type in DEEPSEEK_MODEL_TYPES and kind != "default":
        kind = "deepseek_yarn" if params.get("apply_yarn_scaling", True) else "deepseek_llama_scaling"
        notes.append(f"{model_type} attention maps rope_type {params['rope_type']} to {kind}")
    branch = "deepseek_yarn" if kind == "deepseek_llama_scaling" else kind
    if branch not in READS:
        raise ValueError(f"vLLM's {kind} rope is not modelled here; modelled: {', '.join(READS)}")
    scale, divisor, softmax, cache_len = 1.0, 1.0, None, max_pos
    if branch == "default":
        inv = default_inv_freq(dim, base)
    elif branch == "linear":
        inv, divisor = default_inv_freq(dim, base), float(params["factor"])
        cache_len = int(max_pos * divisor)
    elif branch == "ntk":
        inv = ntk_inv_freq(dim, base, float(params["factor"]), params.get("mixed_b"))
    elif branch == "dynamic" and "alpha" in params:
        inv = default_inv_freq(dim, ntk_base(base, dim, float(params["alpha"])))
    elif branch == "dynamic":
        factor = float(params["factor"])
        inv = default_inv_freq(dim, ntk_base(base, dim, factor * (max_pos * factor) / max_pos - (factor - 1)))
        cache_len = int(max_pos * factor)
        notes.append(f"dynamic is static NTK at max_position_embeddings x factor = {cache_len} for every position: "
                     "transformers recomputes from the current length (original frequencies on short inputs)")
    elif branch in ("yarn", "deepseek_yarn"):
        factor, original = float(params["factor"]), int(params["original_max_position_embeddings"])
        attn = float(params.get("attn_factor", 1.0))
        inv = yarn_inv_freq(dim, base, factor, original, params.get("beta_fast", BETA_FAST),
                            params.get("beta_slow", BETA_SLOW), float(params.get("extrapolation_factor", 1.0)),
                            branch == "deepseek_yarn" or bool(params.get("truncate", True)))
        cache_len = int(original * factor)
        if branch == "deepseek_yarn":
            ratio = yarn_mscale(factor, float(params.get("mscale", 1))) / yarn_mscale(
                factor, float(params.get("mscale_all_dim", 0)))
            scale = ratio * attn
            softmax = deepseek_softmax_scale(config, params) if kind == "deepseek_yarn" else None
        else:
            scale = yarn_mscale(factor) * attn if params.get("apply_yarn_scaling", True) else attn
    elif branch == "llama3":
        inv = llama3_inv_freq(dim, base, float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    else:
        original = int(params["original_max_position_embeddings"])
        use_long = served > original
        key = "long" if use_long else "short"
        inv = longrope_inv_freq(dim, base, params[f"{key}_factor"])
        scale = float(params.get(f"{key}_mscale") or longrope_mscale(max_pos, original))
        notes.append(f"longrope: max_model_len {served} {'>' if use_long else '<='} original {original}: the "
                     f"{key} factors for every position of every request (transformers picks per sequence length)")
    reads = READS[branch]
    if branch == "dynamic" and "alpha" in params:
        reads = ("alpha",)
    cos, sin = cos_sin32(inv, positions, scale, divisor)
    if len(positions) and int(positions.max()) >= cache_len:
        notes.append(f"positions >= {cache_len} lie past vLLM's cos/sin cache")
    ignored = unread(params, branch, reads, prefix, "vLLM", REASONS)
    return Rotation(cos, sin, softmax_scale=softmax, ignored=ignored, max_length=default_len, notes=notes)
