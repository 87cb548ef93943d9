"""What to write for each serving engine so that it computes the rotation a patch computes, checked by that engine's
reader (``rope_ext.serving.engines``) against rope_ext's own frequencies.

``target_plan(config, methods, target)`` takes a model's config.json (a dict) and the patch's resolved methods, and
gives a ``TargetPlan``: the config keys (transformers, vLLM, SGLang) or GGUF keys (llama.cpp) to write, the engine
flags, the context to serve, and a status:

* ``exact``: the engine's reader on what is written gives rope_ext's cos and sin (attention factor included) at the
  probe positions, within float32 rounding (``tolerance``);
* ``mapped``: the engine has the method itself (DCA in vLLM/SGLang, Self-Extend in llama.cpp), configured from the
  patch's options; its attention is the engine's own, not compared here;
* ``approximate``: what the engine computes from the closest config differs by ``difference`` (written only when the
  user allows it);
* ``not servable``: no config of that engine gives the method; the reason and what to serve instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rope_ext.methods import FrequencyConfig, MethodConfig, RotarySpec
from rope_ext.methods.frequency import default_inv_freq
from rope_ext.serving import TARGETS
from rope_ext.serving.rotation import Rotation, cos_sin

EXACT, MAPPED, APPROXIMATE, REFUSED = "exact", "mapped", "approximate", "not servable"
#: model types whose vLLM and SGLang modeling code reads ``dual_chunk_attention_config``
DCA_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
#: what to serve instead of a method no engine has
SERVABLE_INSTEAD = "yarn:factor=S (exact in every engine), or dca on Qwen2/Qwen3 in vLLM and SGLang"


@dataclass
class TargetPlan:
    target: str
    status: str
    reason: str
    config: dict[str, Any] = field(default_factory=dict)  # config.json keys to set (HF targets)
    gguf: dict[str, Any] = field(default_factory=dict)  # GGUF keys to set (llama.cpp)
    tensors: dict[str, list[float]] = field(default_factory=dict)  # GGUF tensors to add (Llama 3's rope_freqs)
    flags: list[str] = field(default_factory=list)  # engine command-line flags beyond the model and the context
    max_length: int | None = None  # the context to serve
    difference: float | None = None  # the largest |cos|, |sin| difference measured against rope_ext
    alternative: str | None = None  # the closest exact spec where this one is not exact

    @property
    def writable(self) -> bool:
        return self.status in (EXACT, MAPPED)


def tolerance(position: torch.Tensor) -> torch.Tensor:
    """float32 rounding of an angle ``p * f`` (``f <= 1``) and of cos/sin: what two exact implementations differ by."""
    return 2e-6 + 4e-7 * position.to(torch.float64)


def rope_dict(config: dict) -> dict:
    """The rope parameters a config.json states, either layout (a legacy ``rope_scaling`` with the top-level base)."""
    params = config.get("rope_parameters")
    if params and all(isinstance(value, dict) for value in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    if not params:
        params = dict(config.get("rope_scaling") or {})
        if "rope_theta" in config:
            params.setdefault("rope_theta", config["rope_theta"])
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


def rotary_spec(config: dict, method: MethodConfig | None = None) -> RotarySpec:
    """The rotary embedding a config describes: base, rotary dimension, the original context ``L`` (the method's
    own where it states one)."""
    params = rope_dict(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    original = (getattr(method, "original_max_position_embeddings", None)
                or params.get("original_max_position_embeddings")
                or config.get("original_max_position_embeddings") or config["max_position_embeddings"])
    return RotarySpec(base=float(params.get("rope_theta", 10000.0)), dim=int(head_dim * partial),
                      original_max_position_embeddings=int(original))


def probe_lengths(original: int, served: int) -> list[int]:
    """The request lengths a rotation is checked at: a short one inside the original context and the longest served."""
    return sorted({min(2048, original), served})


def probe_positions(n: int) -> torch.Tensor:
    """The positions a request of ``n`` tokens is checked at: 0, 1, n/2 and n - 1."""
    return torch.tensor(sorted({0, 1, n // 2, n - 1}), dtype=torch.int64)


def rotation_gap(cos: torch.Tensor, sin: torch.Tensor, theirs: Rotation, positions: torch.Tensor) -> float:
    """The largest |cos|, |sin| difference between ``(cos, sin)`` and ``theirs`` where some value is beyond float32
    rounding (``tolerance``); 0.0 where every one is within it; ``inf`` where their shapes differ."""
    if theirs.cos.shape != cos.shape or theirs.sin.shape != sin.shape:
        return math.inf
    gap = torch.maximum((cos - theirs.cos).abs(), (sin - theirs.sin).abs())
    return float(gap.max()) if bool((gap > tolerance(positions)[:, None]).any()) else 0.0


def measured_difference(method: FrequencyConfig, spec: RotarySpec, served: int, reader) -> float:
    """The largest |cos|, |sin| difference, beyond float32 rounding, between rope_ext's rotation and ``reader(
    positions, n)`` (an engine's ``Rotation`` for requests of ``n`` tokens) at the probe positions of each probe
    length ``n``; 0.0 when every value is within ``tolerance``."""
    worst = 0.0
    for n in probe_lengths(spec.original_max_position_embeddings, served):
        positions = probe_positions(n)
        inv_freq, factor = method.frequencies(spec, n if method.dynamic else None)
        worst = max(worst, rotation_gap(*cos_sin(spec.kept(inv_freq), positions, float(factor)),
                                        reader(positions, n), positions))
    return worst


def frequency_methods(methods: tuple[MethodConfig, ...]) -> tuple[list[FrequencyConfig], list[MethodConfig]]:
    frequency = [m for m in methods if isinstance(m, FrequencyConfig)]
    return frequency, [m for m in methods if not isinstance(m, FrequencyConfig)]


def served_length(method: FrequencyConfig, spec: RotarySpec, requested: int | None) -> int:
    """The context to serve: the user's, else ``s L`` (a dynamic method: at least ``2 L``)."""
    if requested:
        return int(requested)
    factor = max(2.0, method.factor) if method.dynamic else method.factor
    return round(factor * spec.original_max_position_embeddings)


def layout_keys(params: dict, layout: str) -> dict:
    """The config keys that state ``params``: transformers 5's ``rope_parameters``, or the legacy ``rope_scaling``
    (``type`` and ``rope_type`` both, for readers of either name; ``null`` for the default rotation) beside a
    top-level ``rope_theta``."""
    if layout == "rope_parameters":
        return {"rope_parameters": params}
    if layout != "rope_scaling":
        raise ValueError(f"unknown layout {layout!r}; layouts: rope_parameters, rope_scaling")
    scaling = {key: value for key, value in params.items() if key != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    else:
        scaling = {"type": scaling["rope_type"], **scaling}
    return {"rope_scaling": scaling, "rope_theta": params.get("rope_theta")}


def applied(config: dict, changes: dict) -> dict:
    """``config`` with ``changes``; where they state the rope keys (either layout), the config's own rope keys (both
    layouts) give way to them; the ``rope_ext`` block always goes (engines ignore it)."""
    restated = "rope_parameters" in changes or "rope_scaling" in changes
    dropped = ("rope_scaling", "rope_parameters", "rope_theta", "rope_ext") if restated else ("rope_ext",)
    out = {key: value for key, value in config.items() if key not in dropped}
    out.update(changes)
    return {key: value for key, value in out.items() if value is not None or key == "rope_scaling"}


def has_rope(config: dict) -> bool:
    """Whether a config states a rotary embedding (transformers 5's or the legacy layout)."""
    return bool(config.get("rope_parameters") or config.get("rope_theta") or config.get("rope_scaling"))


# --- one target ---------------------------------------------------------------------------------------------------


def reader_for(target: str, config: dict, metadata: dict | None, served: int):
    """``reader(positions, n) -> Rotation``: the target engine on ``config`` (HF targets) or ``metadata`` (GGUF)."""
    if target == "transformers":
        from rope_ext.serving.engines import hf

        return lambda positions, n: hf.rotation(config, positions)
    if target in ("vllm", "sglang"):
        from rope_ext.serving.engines import sglang, vllm

        engine = vllm if target == "vllm" else sglang
        return lambda positions, n: engine.rotation(config, positions, max_model_len=served)
    from rope_ext.serving.engines import llamacpp

    return lambda positions, n: llamacpp.rotation(metadata, positions, n_ctx=served)


def gguf_metadata(config: dict) -> dict:
    """The GGUF keys llama.cpp's rotation reads, as a conversion of ``config`` would write them (for a plan made
    without a GGUF file at hand)."""
    spec = rotary_spec(config)
    return {
        "general.architecture": "llama", "llama.context_length": config["max_position_embeddings"],
        "llama.rope.freq_base": spec.base, "llama.rope.dimension_count": spec.dim,
        "llama.embedding_length": config["hidden_size"], "llama.attention.head_count": config["num_attention_heads"],
    }


def candidates(target: str, params: dict, spec: RotarySpec) -> list[dict]:
    """The rope parameters to try for ``target``, in order: transformers' own, then the engine's way of stating the
    same rotation where it reads other keys (vLLM and SGLang take YaRN's attention factor as ``attn_factor``, a
    multiplier of their ``0.1 ln s + 1``; vLLM drops DeepSeek's ``mscale``/``mscale_all_dim`` too)."""
    out = [params]
    if target not in ("vllm", "sglang") or params.get("rope_type") != "yarn":
        return out

    def m(scale: float, x: float = 1.0) -> float:  # YaRN's 0.1 x ln s + 1 (1 within the original context)
        return 0.1 * x * math.log(scale) + 1.0 if scale > 1 else 1.0

    factor = params["factor"]
    wanted = params.get("attention_factor")
    if wanted is None and "mscale" in params and "mscale_all_dim" in params:
        wanted = m(factor, params["mscale"]) / m(factor, params["mscale_all_dim"])
    if wanted is not None:
        out.append({**params, "attn_factor": wanted / m(factor)})
    return out


def config_class_refusal(config: dict) -> str | None:
    """Why transformers' config class for ``config['model_type']`` refuses it (Phi-3's takes only ``longrope``), or
    ``None``."""
    from rope_ext.serving.engines import hf

    try:
        hf.config_object(config)
    except Exception as error:  # noqa: BLE001  (the class's own validation errors)
        return (f"the {config.get('model_type')} config class refuses these keys (transformers, vLLM and SGLang read "
                f"config.json through it: {' '.join(str(error).split())[:200]})")
    return None


def frequency_plan(config: dict, method: FrequencyConfig, target: str, requested: int | None, layout: str,
                   metadata: dict | None) -> TargetPlan:
    per_layer = config.get("rope_parameters") or {}
    if per_layer and all(isinstance(value, dict) for value in per_layer.values()):
        return TargetPlan(target, REFUSED, f"{method.method}: rope parameters per layer type ({', '.join(per_layer)}) "
                          "are not exported yet (rope_ext.from_pretrained serves the model as patched)")
    spec = rotary_spec(config, method)
    served = served_length(method, spec, requested)
    opened = served_length(method, spec, None)
    if requested is not None and not method.dynamic and requested > opened:
        return TargetPlan(target, REFUSED, f"--max-length {requested} is beyond what {method.method}:factor="
                          f"{method.factor:g} was made for ({opened} = s L); give a larger factor",
                          alternative=f"{method.method}:factor={requested / spec.original_max_position_embeddings:.10g}")
    # (the config states the context the patch opens, as the factor does: s L; transformers' dynamic reads L from
    # max_position_embeddings, which then stays L; --max-length is the context served)
    stated = spec.original_max_position_embeddings if method.dynamic else max(opened, config["max_position_embeddings"])
    native = method.native_rope_parameters(spec, spec.original_max_position_embeddings)
    if native is None:
        return TargetPlan(target, REFUSED, f"{method.method} has no rope type in transformers' set, which every "
                          "engine reads", alternative=alternative_for(method))
    base = {key: value for key, value in rope_dict(config).items() if key in ("rope_theta", "partial_rotary_factor")}
    best: TargetPlan | None = None
    for params in candidates(target, {**base, **native}, spec):
        if target == "llama.cpp":
            from rope_ext.serving.gguf_io import hf_to_gguf_rope

            source = metadata or gguf_metadata(config)
            arch = str(source["general.architecture"])
            tensors = {}
            try:
                if params["rope_type"] == "llama3":  # (as llama.cpp's converter: the divisors as rope_freqs.weight)
                    keys = hf_to_gguf_rope({"rope_type": "default", "rope_theta": spec.base}, stated, arch)
                    inv_freq, _ = method.frequencies(spec)
                    tensors = {"rope_freqs.weight": (default_inv_freq(spec.base, spec.dim) / inv_freq).tolist()}
                else:
                    keys = hf_to_gguf_rope(params, stated, arch)
            except ValueError as error:
                return TargetPlan(target, REFUSED, str(error), alternative=alternative_for(method))
            plan = TargetPlan(target, EXACT, "", gguf=keys, tensors=tensors, max_length=served)
            reader = reader_for(target, {}, {**source, **keys, **tensors}, served)
        else:
            changes = {**layout_keys(params, layout), "max_position_embeddings": stated}
            written = applied(config, changes)
            plan = TargetPlan(target, EXACT, "", config=changes, max_length=served)
            reader = reader_for(target, written, None, served)
            refusal = config_class_refusal(written)
            if refusal:  # (vLLM and SGLang read config.json through transformers' config classes too)
                instead = f"ntk:factor={method.factor:g} (a new base, which every config class takes)"
                return TargetPlan(target, REFUSED, refusal, alternative=None if method.method == "ntk" else instead)
        try:
            plan.difference = measured_difference(method, spec, served, reader)
        except Exception as error:  # noqa: BLE001  (the engine's config class refuses the keys: its own error types)
            return TargetPlan(target, REFUSED, f"{target} does not take these keys ({' '.join(str(error).split())})",
                              alternative=alternative_for(method))
        if plan.difference == 0.0:
            plan.reason = f"{target} computes rope_ext's rotation from these keys (checked up to {served} tokens)"
            return plan
        if best is None or plan.difference < best.difference:
            best = plan
    assert best is not None
    best.status, best.alternative = APPROXIMATE, alternative_for(method)
    best.reason = (f"{target} computes another rotation from the closest config: cos/sin differ by up to "
                   f"{best.difference:.3g} (checked up to {served} tokens)")
    return best


def alternative_for(method: MethodConfig) -> str | None:
    """The closest spec every engine serves exactly."""
    factor = getattr(method, "factor", None)
    if method.method in ("dynamic_ntk",):
        return f"ntk:factor={factor:g} (static: its rotation at every length)"
    if factor and method.method not in ("yarn", "pi", "ntk"):
        return f"yarn:factor={factor:g}"
    return None if factor else "yarn:factor=S"


def as_is_plan(config: dict, target: str, served: int | None, layout: str) -> TargetPlan:
    """No patch: the config's own rotation (transformers' reading of it) served by ``target``, its rope keys restated
    in ``layout`` and in the engine's terms where it reads them otherwise (vLLM's ``attn_factor``)."""
    from rope_ext.serving.engines import hf

    if not has_rope(config) or target == "llama.cpp":
        return TargetPlan(target, EXACT, "no patch: the model's own config, as it is", max_length=served)
    params = rope_dict(config)
    spec = rotary_spec(config)
    best: TargetPlan | None = None
    for candidate in candidates(target, params, spec):
        changes = layout_keys(candidate, layout)
        written = applied(config, changes)
        n = served or config["max_position_embeddings"]
        gap = 0.0
        for length in probe_lengths(spec.original_max_position_embeddings, n):
            positions = probe_positions(length)
            ref = hf.rotation(config, positions)
            gap = max(gap, rotation_gap(ref.cos, ref.sin, reader_for(target, written, None, n)(positions, length),
                                        positions))
        plan = TargetPlan(target, EXACT, "no patch: the model's own rotation (as transformers reads its config), "
                          f"restated for {target}", config=changes, max_length=served, difference=gap)
        if gap == 0.0:
            return plan
        if best is None or gap < best.difference:
            best = plan
    best.status = APPROXIMATE
    best.reason = f"{target} computes another rotation from this config: cos/sin differ by up to {best.difference:.3g}"
    return best


def target_plan(config: dict, methods: tuple[MethodConfig, ...], target: str, max_length: int | None = None,
                layout: str = "rope_parameters", metadata: dict | None = None) -> TargetPlan:
    """What to write for ``target`` so that it serves ``config``'s model patched with ``methods`` (resolved), or
    why it cannot. ``max_length``: the context to serve (default: the one the patch opens); ``metadata``: the GGUF's
    keys (llama.cpp; default: those a conversion of ``config`` writes)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    frequency, others = frequency_methods(tuple(methods))
    if not methods:
        return as_is_plan(config, target, max_length or config.get("max_position_embeddings"), layout)
    if max_length is not None and has_rope(config) and max_length < rotary_spec(config).original_max_position_embeddings:
        raise ValueError(f"--max-length {max_length} is below the model's original context "
                         f"{rotary_spec(config).original_max_position_embeddings}, where no patch changes anything")
    if not has_rope(config):
        return TargetPlan(target, REFUSED, f"a {config.get('model_type')} model has no rotary embedding: the engines "
                          "serve its own positions, and none has rope_ext's methods for it")
    if len(frequency) == 1 and not others:
        return frequency_plan(config, frequency[0], target, max_length, layout, metadata)
    names = "+".join(method.method for method in methods)
    if frequency and others:
        return TargetPlan(target, REFUSED, f"{names}: no engine combines a frequency method with an attention "
                          "rewrite or a bias", alternative=alternative_for(frequency[0]))
    spec = rotary_spec(config)
    (method, *rest) = [m.with_defaults(spec.original_max_position_embeddings) if hasattr(m, "with_defaults") else m
                       for m in others]
    if not rest and method.method == "dca" and target in ("vllm", "sglang"):
        model_type = config.get("model_type")
        if model_type not in DCA_MODEL_TYPES:
            return TargetPlan(target, REFUSED, f"dca: {target} reads dual_chunk_attention_config only for "
                              f"{', '.join(DCA_MODEL_TYPES)}, not {model_type}", alternative=SERVABLE_INSTEAD)
        served = max_length or 4 * spec.original_max_position_embeddings
        dca = {"chunk_size": method.chunk_size, "local_size": method.local_window}
        return TargetPlan(target, MAPPED, f"{target}'s own dual chunk attention, chunk_size {method.chunk_size}, "
                          f"local_size {method.local_window} (its kernel, not compared here)",
                          config={"dual_chunk_attention_config": dca, "max_position_embeddings": served},
                          max_length=served)
    if not rest and method.method == "self_extend" and target == "llama.cpp":
        from rope_ext.serving.engines.llamacpp import self_extend_arguments

        intended = method.intended_length(spec.original_max_position_embeddings)
        if max_length is not None and max_length > intended:
            return TargetPlan(target, REFUSED, f"--max-length {max_length} is beyond what self_extend:G={method.G}:W="
                              f"{method.W} reaches ({intended}: grouped positions stay below L); give a larger G")
        served = max_length or intended
        return TargetPlan(target, MAPPED, f"llama.cpp's group attention (llama-completion; llama-server dropped it), "
                          f"G {method.G}, W {method.W}", flags=self_extend_arguments(method.G, method.W),
                          max_length=served)
    where = "plain transformers" if target == "transformers" else target
    return TargetPlan(target, REFUSED, f"{names}: {where} has no such attention (rope_ext.from_pretrained serves it, "
                      "from the saved rope_ext block)", alternative=SERVABLE_INSTEAD)
