"""llama.cpp's rotation from a GGUF's metadata and its command-line options; the flags that serve ``self_extend``.

Read from ggml-org/llama.cpp: ``src/llama-model.cpp`` (``load_hparams``: the keys and their defaults),
``src/llama-hparams.h`` (``yarn_ext_factor = -1``, ``yarn_attn_factor = 1``, ``yarn_beta_fast = 32``,
``yarn_beta_slow = 1``, ``rope_attn_factor = 1``), ``src/llama-context.cpp`` (options over the file, the YaRN
attention factor), ``ggml/src/ggml-cpu/ops.cpp`` (``rope_yarn``, ``ggml_rope_yarn_corr_dims``), ``common/arg.cpp``
(the flags) and ``tools/completion`` (Self-Extend's KV-cache edits).

* Keys, ``{arch}.`` prefixed: ``context_length`` (``n_ctx_train``, the default ``-c``), ``rope.dimension_count``
  (``n_rot``; absent: the head size), ``rope.freq_base`` (absent: 10000), ``rope.scaling.type`` (``none``,
  ``linear``, ``yarn``, ``longrope``; absent: ``linear``), ``rope.scaling.factor`` (or the older
  ``rope.scale_linear``; ``freq_scale = 1 / factor``, absent or 0: 1), ``rope.scaling.original_context_length``
  (``n_ctx_orig_yarn``; absent: ``context_length``), ``rope.scaling.attn_factor`` (multiplies cos/sin for every
  type; absent: 1). Only the DeepSeek-2 (value ``/ 0.1``) and Mistral-3 loaders read
  ``rope.scaling.yarn_log_multiplier``, only Grok's and Laguna's ``rope.scaling.yarn_{ext_factor,attn_factor,
  beta_fast,beta_slow}``. Longrope's factors are tensors (``rope_factors_long/short.weight``; Llama 3's
  ``rope_freqs.weight``): give them in ``metadata`` under those names (``gguf_io.read_rope_factors``).
* Options win over the file (``overrides``, the flags' names with ``_``): ``rope_scaling`` (``--rope-scaling``),
  ``rope_scale`` (``--rope-scale N``: ``freq_scale = 1/N``) or ``rope_freq_scale``, ``rope_freq_base``,
  ``yarn_orig_ctx``, ``yarn_ext_factor`` (-1: 1 for yarn, else 0), ``yarn_attn_factor``, ``yarn_beta_fast``,
  ``yarn_beta_slow`` (negative: the file's), ``ctx_size`` (``-c``), ``parallel`` (``-np``, longrope's choice).
* Pair ``i`` of ``n_rot / 2``: ``e = p base^(-2i/n_rot) / ff_i``, ``t = freq_scale e``; with ``ext_factor != 0``
  the ramp ``r = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)`` mixes them, ``theta = t (1 - r x) + e r x``
  (``x = ext_factor``), and ggml multiplies the magnitude by ``1 + 0.1 ln(1 / freq_scale)``; ``lo = max(0,
  floor(d(beta_fast)))``, ``hi = min(n_rot - 1, ceil(d(beta_slow)))``, ``d(b) = n_rot ln(n_ctx_orig / (2 pi b)) /
  (2 ln base)``.
* Magnitude (``llama_context``, since PR #17945): with ``ext_factor != 0`` the attention factor is *set* to
  ``m(s) / (1 + 0.1 ln s)`` (``s = 1 / freq_scale``, ``m(s) = 0.1 ln s + 1`` above 1, else 1; with a log multiplier
  ``L``: ``m(s, mscale) / m(s, L)``), cancelling ggml's term, so cos/sin carry ``m(s) * rope.scaling.attn_factor``
  and ``--yarn-attn-factor`` is dropped; with ``ext_factor = 0``: ``yarn_attn_factor * rope.scaling.attn_factor``.
"""

from __future__ import annotations

import math

import torch

from rope_ext.serving.rotation import Rotation

DEFAULT_FREQ_BASE = 10000.0
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
MSCALE_SLOPE = 0.1
RAMP_FLOOR = 0.001
SCALING_TYPES = ("none", "linear", "yarn", "longrope")
YARN_KEY_ARCHS = frozenset({"grok", "laguna"})
YARN_LOG_MUL_DIVISORS = {"deepseek2": 0.1, "mistral3": 1.0}
FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
OPTIONS = {
    "rope_scaling": "--rope-scaling", "rope_scale": "--rope-scale", "rope_freq_scale": "--rope-freq-scale",
    "rope_freq_base": "--rope-freq-base", "yarn_orig_ctx": "--yarn-orig-ctx", "yarn_ext_factor": "--yarn-ext-factor",
    "yarn_attn_factor": "--yarn-attn-factor", "yarn_beta_fast": "--yarn-beta-fast",
    "yarn_beta_slow": "--yarn-beta-slow", "ctx_size": "-c", "parallel": "-np",
}
UNREAD = {
    "rope.scaling.yarn_log_multiplier": "read only by the deepseek2 and mistral3 loaders",
    "rope.scaling.yarn_ext_factor": "read only by the grok and laguna loaders",
    "rope.scaling.yarn_attn_factor": "read only by the grok and laguna loaders",
    "rope.scaling.yarn_beta_fast": "read only by the grok and laguna loaders",
    "rope.scaling.yarn_beta_slow": "read only by the grok and laguna loaders",
    "rope.scaling.finetuned": "read into hparams.rope_finetuned, which changes no rotation",
    "rope.freq_base_swa": "the sliding-window layers' base, not modelled here",
    "rope.dimension_count_swa": "the sliding-window layers' n_rot, not modelled here",
    "rope.dimension_sections": "M-RoPE sections, not modelled here",
    "rope.scaling.alpha": "XDRoPE's NTK alpha, not modelled here",
}


def mscale(scale: float, multiplier: float = 1.0) -> float:
    """llama.cpp's ``get_mscale``: ``0.1 * multiplier * ln(scale) + 1`` above 1, else 1."""
    return 1.0 if scale <= 1.0 else MSCALE_SLOPE * multiplier * math.log(scale) + 1.0


def corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml's ``ggml_rope_yarn_corr_dims``: the ramp's ends, floored/ceiled and clamped to ``[0, n_rot - 1]``."""

    def dim(rotations: float) -> float:
        return n_rot * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, float(math.floor(dim(beta_fast)))), min(n_rot - 1.0, float(math.ceil(dim(beta_slow))))


def rope_yarn(positions: torch.Tensor, n_rot: int, base: float, freq_scale: float, ext_factor: float,
              attn_factor: float, dims: tuple[float, float], freq_factors=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[positions, n_rot // 2]`` in float64 as ggml's ``rope_yarn`` fills its cache (magnitude included)."""
    i = torch.arange(n_rot // 2, dtype=torch.float64)
    extrap = positions.to(torch.float64)[:, None] * (base ** (-2.0 * i / n_rot))[None, :]
    if freq_factors is not None:
        extrap = extrap / torch.as_tensor(freq_factors, dtype=torch.float64)[None, :]
    theta = freq_scale * extrap
    magnitude = attn_factor
    if ext_factor != 0:
        ramp = 1 - ((i - dims[0]) / max(RAMP_FLOOR, dims[1] - dims[0])).clamp(0, 1)
        mix = ramp * ext_factor
        theta = theta * (1 - mix) + extrap * mix
        magnitude = attn_factor * (1.0 + MSCALE_SLOPE * math.log(1.0 / freq_scale))
    return theta.cos() * magnitude, theta.sin() * magnitude


def _n_rot(metadata: dict, arch: str) -> int:
    if f"{arch}.rope.dimension_count" in metadata:
        return int(metadata[f"{arch}.rope.dimension_count"])
    if f"{arch}.attention.key_length" in metadata:
        return int(metadata[f"{arch}.attention.key_length"])
    heads = metadata[f"{arch}.attention.head_count"]
    heads = heads[0] if isinstance(heads, (list, tuple)) else heads
    return int(metadata[f"{arch}.embedding_length"]) // int(heads)


def _given(options: dict, name: str) -> bool:
    """Whether option ``name`` is set (llama.cpp's 'not set': absent, 0 for sizes/bases/scales, < 0 for YaRN's)."""
    value = options.get(name)
    if value is None:
        return False
    return value >= 0 if name.startswith("yarn_") and name != "yarn_orig_ctx" else bool(value)


def _freq_factors(metadata: dict, n_ctx: int, parallel: int, n_ctx_orig_train: int, notes: list[str]):
    if "rope_freqs.weight" in metadata:
        notes.append("rope_freqs.weight divides every position's angles (llama.cpp's llama3 rotation)")
        return metadata["rope_freqs.weight"]
    if "rope_factors_long.weight" in metadata or "rope_factors_short.weight" in metadata:
        long = n_ctx // parallel > n_ctx_orig_train
        notes.append(f"longrope: the {'long' if long else 'short'} factors, chosen once per context "
                     f"(n_ctx / parallel = {n_ctx // parallel} > {n_ctx_orig_train}: long), not per sequence")
        return metadata["rope_factors_long.weight" if long else "rope_factors_short.weight"]
    return None


def rotation(metadata: dict, positions: torch.Tensor, n_ctx: int | None = None,
             overrides: dict | None = None) -> Rotation:
    """What llama.cpp computes for the GGUF whose key/value pairs are ``metadata``, run with the options
    ``overrides`` (``{'rope_scaling': 'yarn', 'rope_scale': 4, 'yarn_orig_ctx': 8192}``) and context ``n_ctx``
    (``-c``; None: ``overrides['ctx_size']``, else ``context_length``), at ``positions``. See the module's notes for
    the keys and formulas; ``max_length`` is that context."""
    if "general.architecture" not in metadata:
        raise ValueError("metadata needs 'general.architecture' (the GGUF's architecture name)")
    arch = str(metadata["general.architecture"])
    options = dict(overrides or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown llama.cpp options {unknown}; known: {sorted(OPTIONS)}")
    if _given(options, "rope_scale") and _given(options, "rope_freq_scale"):
        raise ValueError("give rope_scale or rope_freq_scale, not both (both set llama.cpp's rope_freq_scale)")
    key = f"{arch}.{{}}".format
    ignored: list[str] = []
    notes: list[str] = []

    def override(name: str, suffix: str | None = None) -> bool:
        if not _given(options, name):
            return False
        if suffix is not None and key(suffix) in metadata:
            ignored.append(f"{key(suffix)}: overridden by {OPTIONS[name]} {options[name]}")
        return True

    n_ctx_train = int(metadata[key("context_length")])
    n_rot = _n_rot(metadata, arch)
    base = float(metadata.get(key("rope.freq_base"), DEFAULT_FREQ_BASE))
    scaling = metadata.get(key("rope.scaling.type"), "linear")
    factor = metadata.get(key("rope.scaling.factor"), metadata.get(key("rope.scale_linear"), 0.0))
    freq_scale = 1.0 / float(factor) if factor else 1.0
    n_ctx_orig_train = int(metadata.get(key("rope.scaling.original_context_length"), n_ctx_train)) or n_ctx_train
    rope_attn_factor = float(metadata.get(key("rope.scaling.attn_factor"), 1.0))
    yarn = {"ext_factor": -1.0, "attn_factor": 1.0, "beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW}
    read = {key(s) for s in ("context_length", "rope.dimension_count", "rope.freq_base", "rope.scaling.type",
                             "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
                             "rope.scaling.attn_factor")}
    if arch in YARN_KEY_ARCHS:
        for name, default in yarn.items():
            read.add(key(f"rope.scaling.yarn_{name}"))
            yarn[name] = float(metadata.get(key(f"rope.scaling.yarn_{name}"), default))
    log_mul = 0.0
    if arch in YARN_LOG_MUL_DIVISORS and key("rope.scaling.yarn_log_multiplier") in metadata:
        read.add(key("rope.scaling.yarn_log_multiplier"))
        log_mul = float(metadata[key("rope.scaling.yarn_log_multiplier")]) / YARN_LOG_MUL_DIVISORS[arch]
    if scaling not in SCALING_TYPES:
        raise ValueError(f"{key('rope.scaling.type')} = {scaling!r}: llama.cpp knows {SCALING_TYPES}")

    if n_ctx is None and override("ctx_size"):
        n_ctx = int(options["ctx_size"])
    n_ctx = int(n_ctx) if n_ctx else n_ctx_train
    if override("rope_freq_base", "rope.freq_base"):
        base = float(options["rope_freq_base"])
    if override("rope_freq_scale", "rope.scaling.factor"):
        freq_scale = float(options["rope_freq_scale"])
    elif override("rope_scale", "rope.scaling.factor"):
        freq_scale = 1.0 / float(options["rope_scale"])
    n_ctx_orig = n_ctx_orig_train
    if override("yarn_orig_ctx", "rope.scaling.original_context_length"):
        n_ctx_orig = int(options["yarn_orig_ctx"])
    if options.get("rope_scaling") is not None:
        if options["rope_scaling"] not in ("none", "linear", "yarn"):
            raise ValueError(f"--rope-scaling takes none, linear or yarn, not {options['rope_scaling']!r}")
        if key("rope.scaling.type") in metadata:
            ignored.append(f"{key('rope.scaling.type')}: overridden by --rope-scaling {options['rope_scaling']}")
        scaling = options["rope_scaling"]
    if scaling == "none":
        if freq_scale != 1.0:
            source = next((f"overrides.{n}" for n in ("rope_freq_scale", "rope_scale") if _given(options, n)),
                          key("rope.scaling.factor"))
            ignored.append(f"{source}: scaling type none never scales (freq_scale = 1)")
        freq_scale = 1.0
    values = {}
    for name, stored in yarn.items():
        stated = f"rope.scaling.yarn_{name}" if arch in YARN_KEY_ARCHS else None
        values[name] = float(options[f"yarn_{name}"]) if override(f"yarn_{name}", stated) else stored
    ext_factor = values["ext_factor"]
    if ext_factor < 0:
        ext_factor = 1.0 if scaling == "yarn" else 0.0
    attn_factor = values["attn_factor"]
    if ext_factor != 0:
        s = 1.0 / freq_scale
        if log_mul != 0:
            numerator = log_mul if arch == "deepseek2" and log_mul != 1.0 else 1.0
            attn_factor = mscale(s, numerator) / mscale(s, log_mul)
        else:
            attn_factor = mscale(s)
        attn_factor /= 1.0 + MSCALE_SLOPE * math.log(s)
        if _given(options, "yarn_attn_factor"):
            ignored.append("overrides.yarn_attn_factor: overwritten by the YaRN attention factor (ext_factor != 0)")
        elif arch in YARN_KEY_ARCHS and key("rope.scaling.yarn_attn_factor") in metadata:
            ignored.append(f"{key('rope.scaling.yarn_attn_factor')}: overwritten by the YaRN attention factor")
        if arch == "deepseek2":
            notes.append("deepseek2's graph also multiplies kq_scale by the YaRN mscale squared (not modelled)")
    elif key("rope.scaling.original_context_length") in metadata and not any(
            k in metadata for k in FACTOR_TENSORS[1:]):
        ignored.append(f"{key('rope.scaling.original_context_length')}: used by YaRN's ramp only (ext_factor = 0)")
    attn_factor *= rope_attn_factor

    parallel = int(options.get("parallel") or 1)
    factors = _freq_factors(metadata, n_ctx, parallel, n_ctx_orig_train, notes)
    if scaling == "longrope" and factors is None:
        raise ValueError("longrope needs the rope_factors_long.weight / rope_factors_short.weight tensors in "
                         "metadata (rope_ext.serving.gguf_io.read_rope_factors)")
    dims = corr_dims(n_rot, n_ctx_orig, base, values["beta_fast"], values["beta_slow"])
    cos, sin = rope_yarn(positions, n_rot, base, freq_scale, ext_factor, attn_factor, dims, factors)
    for name in sorted(metadata):
        if name.startswith(f"{arch}.rope.") and name not in read:
            ignored.append(f"{name}: {UNREAD.get(name[len(arch) + 1:], 'not read by llama.cpp here')}")
    notes += [
        ("column i is pair i: ggml's normal rope (llama, mistral; the converter permutes q/k to match transformers' "
         "rotate_half) rotates channels (2i, 2i+1), neox (qwen2, phi3, gemma) (i, i + n_rot/2), same frequencies"),
        (f"freq_scale {freq_scale:g}, ext_factor {ext_factor:g}, corr dims {dims}, n_ctx_orig {n_ctx_orig}; float64 "
         "here, ggml computes the angles in float32 (about 1e-6 relative apart)"),
        "fixed when the context is created: no per-request RoPE options (llama-server included)",
    ]
    return Rotation(cos=cos, sin=sin, ignored=ignored, max_length=n_ctx, notes=notes)


def self_extend_arguments(group: int, window: int, context: int | None = None) -> list[str]:
    """``llama-completion`` flags for rope_ext's ``self_extend`` with ``G = group``, ``W = window``: ``--grp-attn-n
    G --grp-attn-w W --batch-size W`` (and ``-c context`` when given; every token still takes a KV cell).

    llama.cpp's ``ga_n``/``ga_w`` are ``G``/``W`` with ``W % G == 0`` (it asserts so) but edit the KV cache in
    blocks: each time ``ga_w`` new positions fill up, that block is shifted and integer-divided by ``ga_n``. A query
    at ``i >= W`` (one token at a time) then sees Self-Extend's ``(i // G + w - w // G) - j // G`` with a neighbour
    window ``w = i mod W`` instead of ``W``: the exact window shrinks to 0 at every multiple of ``W``, and no position
    exceeds rope_ext's, so ``intended_length`` holds. A prompt is regrouped only between batches (``--batch-size``,
    default 2048), its positions running on ungrouped inside one: ``--batch-size W`` bounds that. Only
    ``llama-completion`` (the old ``main``) takes both flags (``llama-passkey`` takes ``-gan``); llama-server dropped
    Self-Extend (PR #9860, October 2024); ``G = 1`` turns it off (plain RoPE, as rope_ext's ``G = 1``).
    """
    for name, value in (("group", group), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if window % group:
        raise ValueError(f"llama.cpp asserts grp_attn_w % grp_attn_n == 0: window {window} is not a multiple of "
                         f"group {group}")
    flags = ["--grp-attn-n", str(group), "--grp-attn-w", str(window), "--batch-size", str(window)]
    if context is not None:
        flags += ["-c", str(int(context))]
    return flags
