"""The adapter for every family built on transformers' shared ``rotary_emb`` design.

Such a model owns one rotary module (``model.model.rotary_emb``) holding ``inv_freq`` and
``attention_scaling`` and returning ``(cos, sin)`` that each attention layer applies with HF's
``rotate_half`` convention (pair ``i`` = dims ``i`` and ``i + d/2``). Models with per-layer-type RoPE
(Gemma 3: ``full_attention`` / ``sliding_attention``) pass ``layer_type`` to it; rope_ext patches the
``full_attention`` type by default and any subset on request.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from rope_ext.hooks.rotary import RopeExtRotaryEmbedding
from rope_ext.methods import HOOK_FREQUENCY, FrequencyConfig, MethodConfig, RotarySpec
from rope_ext.methods.frequency import default_inv_freq
from rope_ext.patches.base import CONFIG_KEY, AttrEdit, FamilyAdapter, PatchPlan, saved_block

#: Keys of a rope_parameters dict that describe the base rotation, not its scaling.
_BASE_KEYS = ("rope_theta", "partial_rotary_factor")


class RotaryFamily(FamilyAdapter):
    hooks = frozenset({HOOK_FREQUENCY})

    def __init__(
        self,
        name: str,
        rotary_classes: tuple[type[nn.Module], ...],
        default_layer_types: tuple[str, ...] | None = None,
        native_rope_types: frozenset[str] | None = None,
    ) -> None:
        self.name = name
        self.rotary_classes = rotary_classes
        self.default_layer_types = default_layer_types
        #: rope types this family's config class accepts (``None``: all of transformers')
        self.native_rope_types = native_rope_types

    # --- discovery ---------------------------------------------------------------------------------

    def rotary_modules(self, model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
        """``(parent, attribute, module)`` for every rotary module of this family in ``model``."""
        return [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if isinstance(child, self.rotary_classes)
        ]

    def matches(self, model: nn.Module) -> bool:
        return bool(self.rotary_modules(model))

    def _layer_types(self, rotary: nn.Module, requested: list[str] | None) -> list[str | None]:
        available = getattr(rotary, "layer_types", None)
        if not available:
            if requested:
                raise ValueError(f"{self.name}: this model has one rotary embedding; layer_types must be None")
            return [None]
        available = list(available)
        if requested is None:
            requested = [lt for lt in (self.default_layer_types or available) if lt in available]
        if not requested:
            raise ValueError(f"{self.name}: choose layer_types from {available}")
        bad = [lt for lt in requested if lt not in available]
        if bad:
            raise ValueError(f"{self.name}: unknown layer_types {bad}; valid layer types: {available}")
        return list(requested)

    @staticmethod
    def _params(config: Any, layer_type: str | None) -> dict[str, Any]:
        params = config.rope_parameters
        return params[layer_type] if layer_type is not None else params

    def spec(self, rotary: nn.Module, layer_type: str | None, method: FrequencyConfig) -> RotarySpec:
        config = rotary.config
        params = self._params(config, layer_type)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        original = (
            method.original_max_position_embeddings
            or params.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None)
            or getattr(config, "max_position_embeddings", None)
        )
        if not original:
            raise ValueError(
                f"{self.name}: the model config gives no original context length "
                "(max_position_embeddings); pass original_max_position_embeddings=..."
            )
        spec = RotarySpec(base=float(params["rope_theta"]), dim=dim, original_max_position_embeddings=int(original))
        self._check_convention(rotary, layer_type, params, spec)
        return spec

    def _check_convention(self, rotary: nn.Module, layer_type: str | None, params: dict, spec: RotarySpec) -> None:
        """Run the unscaled module on a few positions: its ``(cos, sin)`` must be ours at ``base ** (-2i/d)``.

        This catches a family (or checkpoint) whose rotary module follows another convention, so it is
        refused instead of silently mis-patched.
        """
        if params.get("rope_type", "default") != "default":
            return
        device = next((b.device for b in rotary.buffers()), None)
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        positions = torch.arange(0, 4096, 257, device=device)[None]  # [1, 16]
        args = (probe, positions) if layer_type is None else (probe, positions, layer_type)
        cos, sin = rotary(*args)
        freqs = positions[..., None].float() * default_inv_freq(spec.base, spec.dim, device)
        emb = torch.cat((freqs, freqs), dim=-1)
        if cos.shape != emb.shape or not (
            torch.allclose(cos, emb.cos(), atol=1e-5) and torch.allclose(sin, emb.sin(), atol=1e-5)
        ):
            raise ValueError(
                f"{self.name}: the model's rotary embedding is not standard RoPE with base={spec.base}, "
                f"rotary dim={spec.dim}; rope_ext cannot patch this checkpoint's RoPE variant"
            )

    # --- planning ----------------------------------------------------------------------------------

    def plan(self, model: nn.Module, method: MethodConfig, layer_types: list[str] | None) -> PatchPlan:
        assert isinstance(method, FrequencyConfig)
        plan = PatchPlan()
        for parent, attr, rotary in self.rotary_modules(model):
            chosen = self._layer_types(rotary, layer_types)
            specs = {lt: self.spec(rotary, lt, method) for lt in chosen}
            replacement = RopeExtRotaryEmbedding(rotary, method, specs)
            plan.edits.append(AttrEdit(parent, attr, replacement))
            plan.edits.extend(self._config_edits(rotary.config, method, specs, layer_types))
        return plan

    def _config_edits(
        self,
        config: Any,
        method: FrequencyConfig,
        specs: dict[str | None, RotarySpec],
        layer_types: list[str] | None,
    ) -> list[AttrEdit]:
        edits = [AttrEdit(config, CONFIG_KEY, saved_block(method, layer_types))]
        native = {lt: method.native_rope_parameters(spec, config.max_position_embeddings) for lt, spec in specs.items()}
        if any(params is None or not self._accepts(params["rope_type"]) for params in native.values()):
            return edits  # no native equivalent: the rope_ext block alone records the patch
        rope_parameters = copy.deepcopy(config.rope_parameters)
        for layer_type, params in native.items():
            current = self._params(config, layer_type)
            merged = {key: current[key] for key in _BASE_KEYS if key in current} | params
            if layer_type is None:
                rope_parameters = merged
            else:
                rope_parameters[layer_type] = merged
        edits.append(AttrEdit(config, "rope_parameters", rope_parameters))
        originals = {p.get("original_max_position_embeddings") for p in native.values()} - {None}
        if originals and hasattr(config, "original_max_position_embeddings"):
            # Phi-3 keeps L at the top level and transformers gives that copy priority.
            edits.append(AttrEdit(config, "original_max_position_embeddings", originals.pop()))
        return edits

    def _accepts(self, rope_type: str) -> bool:
        return self.native_rope_types is None or rope_type in self.native_rope_types

    def saved_block(self, model: nn.Module) -> tuple[Any, dict[str, Any]] | None:
        for _, _, rotary in self.rotary_modules(model):
            block = getattr(rotary.config, CONFIG_KEY, None)
            if block is not None:
                return rotary.config, block
        return None
