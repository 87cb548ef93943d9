"""The rotary site and the module that stands in for it.

``RotarySite`` is a family's shared ``rotary_emb`` module (transformers' contract:
``forward(x, position_ids[, layer_type]) -> (cos, sin)`` with ``cos = cat(freqs, freqs).cos() *
attention_factor``, HF's ``rotate_half`` convention: pair ``i`` is dims ``i`` and ``i + d/2``). Its
replacement, ``RopeExtRotaryEmbedding``, is one module that every hook kind working on rotary positions
configures: the frequency hook (``installers/frequency.py``) gives it ``(inv_freq, attention_factor)`` from a
frequency method; the kinds that rotate in attention (``installers/rotation.py``) make it return the identity.

Static methods compute their frequencies once (a non-persistent buffer, so state dicts are unchanged);
dynamic ones recompute from the current length ``max(position_ids) + 1`` on every call, as a device
tensor (no host sync, so ``torch.compile(fullgraph=True)`` holds) and with no hidden cache, so a
forward's result depends only on its inputs. Layer types the patch does not cover (Gemma 3's
sliding-window layers by default) go to the original module, kept as ``.original``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from rope_ext.installers.base import PlanBuilder, RopeExtModule, Site
from rope_ext.installers.convention import MROPE, call, called_with, frequency_placement, measured_layout
from rope_ext.methods import FrequencyConfig, RotarySpec
from rope_ext.methods.base import check_length_within
from rope_ext.methods.frequency import default_inv_freq
from rope_ext.methods.rope import rope_cos_sin

#: Keys of a rope_parameters dict that describe the base rotation, not its scaling.
BASE_KEYS = ("rope_theta", "partial_rotary_factor")
#: rope types whose frequencies do not depend on the sequence length: the checkpoint's window is the extended one
_STATIC_SCALINGS = ("linear", "yarn", "llama3")


def _buffer_name(layer_type: str | None, name: str = "inv_freq") -> str:
    return name if layer_type is None else f"{layer_type}_{name}"


class RopeExtRotaryEmbedding(RopeExtModule):
    """Drop-in for a family's rotary module; configured by the hooks that work on rotary positions."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original
        self.config = getattr(original, "config", None)
        self.method: FrequencyConfig | None = None
        self.specs: dict[str | None, RotarySpec] = {}
        self.attention_scaling: dict[str | None, float] = {}
        self.constant_names: dict[str | None, list[str]] = {}
        #: layer types whose (cos, sin) are the identity, with their rotary dimension
        self.identity: dict[str | None, int] = {}

    def __getattr__(self, name: str):
        """What the model reads off its rotary module besides calling it (Lfm3's ``layer_types``, HunYuan-VL's
        ``mrope_section``, ``None`` included) is the original's, where this module has no attribute of that name;
        never its tensors (its frequencies are not this module's) nor its private attributes (accelerate's hooks
        on the original are not this module's)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_modules", {}).get("original")
            if original is None or name.startswith("_") or not hasattr(original, name):
                raise
            value = getattr(original, name)
            if isinstance(value, torch.Tensor):
                raise
            return value

    def set_frequency(self, method: FrequencyConfig, specs: dict[str | None, RotarySpec]) -> None:
        device, dtype = frequency_placement(self.original)
        self.method = method
        self.specs.update(specs)
        for layer_type, spec in specs.items():
            method.check_spec(spec)
            _check_finite(method, spec, device)
            if method.dynamic:  # recomputed on every call, from constants kept as buffers (they follow .to())
                constants = method.constants(spec, device)
                for name, tensor in constants.items():
                    self.register_buffer(_buffer_name(layer_type, name), tensor, persistent=False)
                self.constant_names[layer_type] = list(constants)
                continue
            self._keep_static(layer_type, *method.frequencies(spec, None, device=device), dtype)

    def _keep_static(self, layer_type: str | None, inv_freq: torch.Tensor, attention_factor: float, dtype) -> None:
        # kept in the dtype the original keeps its own (a model cast to bf16 holds a bf16 inv_freq), so
        # casting before or after patching gives the same model, as it does for transformers' own scaling
        spec = self.specs.get(layer_type)
        inv_freq = inv_freq if spec is None else spec.kept(inv_freq)  # (proportional RoPE's last ones stay zero)
        self.register_buffer(_buffer_name(layer_type), inv_freq.to(dtype), persistent=False)  # [d/2]
        self.attention_scaling[layer_type] = attention_factor

    def set_identity(self, specs: dict[str | None, RotarySpec]) -> None:
        """Return ``(ones, zeros)`` for these layer types: queries and keys reach attention unrotated (an
        attention hook rotates them there, with ``frequencies``)."""
        for layer_type, spec in specs.items():
            self.identity[layer_type] = spec.dim
            self.specs.setdefault(layer_type, spec)

    def set_base(self, site: RotarySite, specs: dict[str | None, RotarySpec]) -> None:
        """Keep the checkpoint's own frequencies (its rope type's, from transformers' init function) for the
        attention hook, when no frequency method supplies new ones."""
        device, dtype = frequency_placement(self.original)
        for layer_type, spec in specs.items():
            self._keep_static(layer_type, *site._expected_inv_freq(layer_type, site.params(layer_type), spec, device), dtype)

    def frequencies(
        self, position_ids: torch.Tensor, layer_type: str | None, device: torch.device
    ) -> tuple[torch.Tensor, float | torch.Tensor]:
        """``(inv_freq [d/2], attention_factor)`` in effect for this call."""
        if self.method is not None and self.method.dynamic:
            spec = self.specs[layer_type]
            seq_len = position_ids.max() + 1  # a device tensor: no host sync
            names = self.constant_names[layer_type]
            constants = {name: getattr(self, _buffer_name(layer_type, name)) for name in names}
            inv_freq, attention_factor = self.method.frequencies(spec, seq_len, device=device, constants=constants)
            return spec.kept(inv_freq), attention_factor
        return getattr(self, _buffer_name(layer_type)), self.attention_scaling[layer_type]

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_type not in self.specs:
            if layer_type is None:
                return self.original(x, position_ids)
            return self.original(x, position_ids, layer_type)
        layout = self.specs[layer_type].layout
        if layer_type in self.identity:
            shape = (*position_ids.shape, self.identity[layer_type] // (1 if layout in ("cat", "interleave") else 2))
            if layout == "complex":
                return torch.ones(shape, dtype=torch.complex64, device=x.device)
            return torch.ones(shape, dtype=x.dtype, device=x.device), torch.zeros(shape, dtype=x.dtype, device=x.device)
        inv_freq, attention_factor = self.frequencies(position_ids, layer_type, x.device)
        if layout == MROPE:  # (its streams' positions and sections: the module's own, with these frequencies)
            with called_with(self.original, inv_freq, attention_factor, layer_type) as original:
                return call(original, x, position_ids, layer_type)
        cos, sin = rope_cos_sin(position_ids, inv_freq, attention_factor, layout)
        if layout == "complex":  # (one complex table, float32 as the module's own: cos + i sin)
            return torch.complex(cos, sin)
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        layer_types = [lt for lt in self.specs if lt is not None]
        suffix = f", layer_types={layer_types}" if layer_types else ""
        if self.identity:
            suffix += ", rotated in attention"
        return f"method={self.method.method if self.method else None}{suffix}"


def _head_dim(config: Any, layer_type: str | None) -> int:
    """The head size of ``layer_type``'s layers: a per-layer config's for that type where the config has one
    (Gemma 4's full-attention layers: ``global_head_dim``), else the config's."""
    per_layer = getattr(config, "per_layer_config", None) if layer_type is not None else None
    if per_layer is not None:
        with contextlib.suppress(KeyError, IndexError, TypeError, ValueError):
            config = per_layer[layer_type]
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _scaling(params: dict[str, Any]) -> str:
    """The checkpoint's rope type as a scaling: ``default`` for proportional RoPE at factor 1 (a rotation, not a
    scaling: Gemma 4's and Lfm3's checkpoints as trained)."""
    rope_type = params.get("rope_type", "default")
    return "default" if rope_type == "proportional" and params.get("factor", 1.0) == 1.0 else rope_type


def nope_layer_types(config: Any) -> set[str]:
    """The layer types a config gives no rope parameters (``None``: Beam's full-attention layers use no positions)."""
    parameters = getattr(config, "rope_parameters", None)
    return {lt for lt, params in parameters.items() if params is None} if isinstance(parameters, dict) else set()


@dataclass(eq=False)
class RotarySite(Site):
    """A rotary module, where it hangs (``parent.attribute``), and what its family's config accepts."""

    kind: ClassVar[str] = "rotary"
    options: ClassVar[dict[str, Any]] = {"layer_types": None, "replace_scaling": False}

    family: str
    parent: nn.Module
    attribute: str
    module: nn.Module
    #: layer types patched by default on a model with several (Gemma 3: ``("full_attention",)``)
    default_layer_types: tuple[str, ...] | None = None
    #: rope types this family's config class accepts natively (``None``: all of transformers')
    native_rope_types: frozenset[str] | None = None

    @property
    def config(self) -> Any:
        return self.module.config

    def replacement(self, builder: PlanBuilder) -> RopeExtRotaryEmbedding:
        return builder.replacement(self, lambda: (self.parent, self.attribute, RopeExtRotaryEmbedding(self.module)))

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        replace = options.get("replace_scaling", False)
        if not isinstance(replace, bool):
            raise ValueError(f"replace_scaling must be True or False, got {replace!r}")

    def layer_types(self, requested: list[str] | None) -> list[str | None]:
        available = getattr(self.module, "layer_types", None)
        if requested is not None and not isinstance(requested, (list, tuple)):
            raise ValueError(f"{self.family}: layer_types must be a list of layer types, got {requested!r}")
        if not available:
            if requested is not None:
                raise ValueError(
                    f"{self.family}: this model has one rotary embedding for every layer (no layer types to choose "
                    f"from); leave layer_types out (--layer-types), got {requested!r}"
                )
            return [None]
        nope = [lt for lt in available if lt in nope_layer_types(self.config)]  # (Beam's full layers)
        available = [lt for lt in available if lt not in nope]
        if requested is None:
            requested = [lt for lt in (self.default_layer_types or available) if lt in available] or available
        if not requested:
            raise ValueError(f"{self.family}: layer_types is empty; choose at least one of {available}")
        if set(requested) & set(nope):
            raise ValueError(f"{self.family}: layer types {sorted(set(requested) & set(nope))} use no rotary "
                             f"embedding (NoPE); valid layer types: {available}")
        bad = [lt for lt in requested if lt not in available]
        if bad:
            raise ValueError(f"{self.family}: unknown layer_types {bad}; valid layer types: {available}")
        return list(requested)

    def params(self, layer_type: str | None) -> dict[str, Any]:
        params = self.config.rope_parameters
        return params[layer_type] if layer_type is not None else params

    def original_length(self, layer_type: str | None) -> int | None:
        """L, the pre-training context, as the checkpoint's config gives it."""
        params, config = self.params(layer_type), self.config
        return (
            params.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None)
            or getattr(config, "max_position_embeddings", None)
        )

    def native_length(self, layer_type: str | None) -> int | None:
        """The context the checkpoint handles as it is: ``L``, or for a static RoPE scaling (``linear``, ``yarn``,
        ``llama3``) the extended window (its ``max_position_embeddings``, at least ``factor * L``). Attention
        methods on such a checkpoint keep its frequencies and take this window as their ``L``."""
        params = self.params(layer_type)
        original = self.original_length(layer_type)
        if params.get("rope_type", "default") not in _STATIC_SCALINGS or not original:
            return original
        extended = max(getattr(self.config, "max_position_embeddings", None) or 0, original)
        factor = params.get("factor")
        if isinstance(factor, (int, float)) and self._states_original(params):
            extended = max(extended, round(factor * original))
        return extended

    def _states_original(self, params: dict[str, Any]) -> bool:
        config_value = getattr(self.config, "original_max_position_embeddings", None)
        return bool(params.get("original_max_position_embeddings") or config_value)

    def spec(self, layer_type: str | None, method: FrequencyConfig | None, replace_scaling: bool) -> RotarySpec:
        """The base rotation of ``layer_type`` for ``method`` (``None``: the checkpoint's own rotation, kept)."""
        config, params = self.config, self.params(layer_type)
        head_dim = _head_dim(config, layer_type)
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)  # (transformers' count)
        proportional = params.get("rope_type") == "proportional" and rotated < head_dim // 2
        if proportional:  # (the whole head's frequencies, base ** (-2i / head_dim), the last ones zero)
            dim = head_dim
        if method is not None:
            self._check_existing_scaling(layer_type, params, replace_scaling)
        # (a frequency method starts again from the unscaled rotation and its L; the checkpoint's own rotation keeps
        # the window it was extended to)
        native = self.original_length(layer_type) if method is not None else self.native_length(layer_type)
        requested = method.original_max_position_embeddings if method is not None else None
        if not native and not requested:
            takes = method is None or "original_max_position_embeddings" not in method.unused_shared_options
            raise ValueError(
                f"{self.family}: the model config gives no original context length (max_position_embeddings); "
                + ("pass original_max_position_embeddings=..." if takes else f"{method.method} takes none of its own: "
                   "give the config one (config.max_position_embeddings), or use a method that states it, e.g. "
                   "yarn:factor=...:original_max_position_embeddings=...")
            )
        rope_type = _scaling(params)
        stated = requested or self._states_original(params)
        if method is not None and rope_type not in ("default", "dynamic") and not stated:
            raise ValueError(
                f"{self.family}: the checkpoint's {rope_type!r} scaling gives no original context length (its "
                "max_position_embeddings is the extended one); pass original_max_position_embeddings=..."
            )
        if method is not None:
            check_length_within(method.method, requested, native)
        original = int(requested or native)
        if original < 2:
            raise ValueError(f"{self.family}: the config's original context length is {original}; it must be >= 2")
        spec = RotarySpec(base=float(params["rope_theta"]), dim=dim, original_max_position_embeddings=original,
                          rotated=rotated if proportional else None)
        return dataclasses.replace(spec, layout=measured_layout(self, layer_type, params, spec, method is not None))

    def _check_existing_scaling(self, layer_type: str | None, params: dict[str, Any], replace: bool) -> None:
        rope_type = _scaling(params)
        if rope_type == "default" or replace:
            return
        scaling = {k: v for k, v in params.items() if k not in BASE_KEYS and not isinstance(v, list)}
        where = f" ({layer_type} layers)" if layer_type else ""
        raise ValueError(
            f"{self.family}: this checkpoint already uses RoPE scaling{where}: {scaling}; rope_ext would replace "
            "it (the new method starts again from the unscaled base frequencies and the original context). "
            "Pass replace_scaling=True to do so (rope-ext: --replace-scaling)."
        )

    def _expected_inv_freq(self, layer_type: str | None, params: dict[str, Any], spec: RotarySpec, device):
        """``(inv_freq, attention_factor)`` the checkpoint's own rope type gives, from transformers' init function."""
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            return default_inv_freq(spec.base, spec.dim, device), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        return ROPE_INIT_FUNCTIONS[rope_type](self.config, device, **kwargs)

    def accepts(self, rope_type: str) -> bool:
        return self.native_rope_types is None or rope_type in self.native_rope_types


#: the largest attention factor a frequency method may give (YaRN's is about 1.1-1.5 for factors 2-128)
MAX_ATTENTION_FACTOR = 100.0


def _check_finite(method: FrequencyConfig, spec: RotarySpec, device) -> None:
    """Refuse options whose frequencies overflow (inside L, and at 1024 L for the methods that depend on it)."""
    lengths = [None]
    if method.dynamic:  # as a forward computes it: a device tensor
        lengths.append(torch.tensor(1024 * spec.original_max_position_embeddings, device=device))
    for seq_len in lengths:
        try:
            inv_freq, attention_factor = method.frequencies(spec, seq_len, device=device)
            finite = bool(torch.isfinite(inv_freq).all()) and bool((inv_freq > 0).all())
            factor = torch.as_tensor(attention_factor, dtype=torch.float32)
            finite = finite and bool(torch.isfinite(factor).all()) and bool(((factor > 0) & (factor <= MAX_ATTENTION_FACTOR)).all())
        except (OverflowError, ZeroDivisionError, RuntimeError):  # RuntimeError: a Python int too large for torch
            finite = False
        if not finite:
            raise ValueError(
                f"{method.method}: these options give non-finite or zero rotary frequencies, or an attention factor "
                f"outside (0, {MAX_ATTENTION_FACTOR:g}] (it scales the attention scores by its square), for "
                f"base={spec.base}, dim={spec.dim}, L={spec.original_max_position_embeddings} ({method}); use smaller values"
            )
