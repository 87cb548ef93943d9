"""NTK-by-parts and YaRN, static and dynamic (frequency methods; formulas in ``rope_ext.methods.frequency``).

* ``ntk_by_parts`` -- NTK-by-parts (bloc97; Peng et al. 2023, arXiv:2309.00071 section 3.2): with
  ``r_i = L * theta_i / (2 pi)`` rotations in the original window and a ramp ``gamma`` that is 0 for
  ``r_i < beta_slow`` and 1 for ``r_i > beta_fast``, ``theta_i' = (1 - gamma) theta_i / s + gamma theta_i``.
* ``yarn`` -- YaRN (Peng et al. 2023, eq. 20-22): ``ntk_by_parts`` plus attention temperature
  ``sqrt(1/t) = 0.1 ln s + 1`` (or DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio).
* ``dynamic_yarn`` -- YaRN section 3.3: ``yarn`` with ``s' = max(1, s*l/L - (s - 1))`` (``s = 1`` gives the paper's
  ``max(1, l/L)``).

Checked against transformers' ``_compute_yarn_parameters`` (5.23.0) and jquesnelle/yarn
``scaled_rope/LlamaDynamicYaRNScaledRotaryEmbedding.py`` (commit a18e549).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rope_ext.methods.base import register_method
from rope_ext.methods.frequency import (
    DynamicFrequencyConfig,
    FrequencyConfig,
    RotarySpec,
    beyond,
    by_parts_inv_freq,
    default_inv_freq,
    dynamic_scale,
    yarn_mscale,
)
from rope_ext.methods.options import flag, option, positive


@dataclass(frozen=True)
class ByPartsConfig(FrequencyConfig):
    """Base of the NTK-by-parts methods: the ramp between ``beta_slow`` and ``beta_fast`` rotations."""

    beta_fast: float = option(32.0, positive())
    beta_slow: float = option(1.0, positive())
    #: Round the ramp's ends to whole dimensions, as the YaRN reference does.
    truncate: bool = option(True, flag())

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"{self.method}: beta_fast must be > beta_slow (defaults 32 and 1), "
                f"got beta_fast={self.beta_fast}, beta_slow={self.beta_slow}"
            )

    def _by_parts(self, spec: RotarySpec, scale: float, device) -> torch.Tensor:
        return by_parts_inv_freq(
            spec.base,
            spec.dim,
            scale,
            spec.original_max_position_embeddings,
            self.beta_fast,
            self.beta_slow,
            self.truncate,
            device,
        )

    def _native_yarn(self, spec: RotarySpec, attention_factor: float | None) -> dict[str, Any]:
        """transformers' ``yarn`` ``rope_parameters`` with these options (and ``attention_factor`` when given)."""
        params: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(self.factor),
            "original_max_position_embeddings": spec.original_max_position_embeddings,
            "beta_fast": float(self.beta_fast),
            "beta_slow": float(self.beta_slow),
            "truncate": self.truncate,
        }
        if attention_factor is not None:
            params["attention_factor"] = float(attention_factor)
        return params


@register_method
@dataclass(frozen=True)
class NTKByPartsConfig(ByPartsConfig):
    method: ClassVar[str] = "ntk_by_parts"

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        return self._by_parts(spec, self.factor, device), 1.0

    def native_rope_parameters(self, spec, max_position_embeddings):
        return self._native_yarn(spec, attention_factor=1.0)


@register_method
@dataclass(frozen=True)
class YarnConfig(ByPartsConfig):
    method: ClassVar[str] = "yarn"

    #: Fixed cos/sin multiplier; ``None`` means ``0.1 ln s + 1`` (or the mscale ratio below).
    attention_factor: float | None = option(None, positive(optional=True))
    #: DeepSeek-style temperature: ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` when both are set.
    mscale: float | None = option(None, positive(optional=True))
    mscale_all_dim: float | None = option(None, positive(optional=True))

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.mscale is None) != (self.mscale_all_dim is None):
            raise ValueError(f"{self.method}: set both mscale and mscale_all_dim, or neither")
        if self.attention_factor is not None and self.mscale is not None:
            raise ValueError(f"{self.method}: give attention_factor or mscale/mscale_all_dim, not both")

    def resolved_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale is not None and self.mscale_all_dim is not None:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        return self._by_parts(spec, self.factor, device), self.resolved_attention_factor()

    def native_rope_parameters(self, spec, max_position_embeddings):
        params = self._native_yarn(spec, self.attention_factor)
        if self.mscale is not None:
            params.update(mscale=float(self.mscale), mscale_all_dim=float(self.mscale_all_dim))
        return params


@register_method
@dataclass(frozen=True)
class DynamicYarnConfig(ByPartsConfig, DynamicFrequencyConfig):
    """YaRN whose scale follows the sequence length: ``s' = max(1, s*l/L - (s - 1))``."""

    method: ClassVar[str] = "dynamic_yarn"

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        default = default_inv_freq(spec.base, spec.dim, device)
        if seq_len is None:
            return default, 1.0
        original = spec.original_max_position_embeddings
        scale = dynamic_scale(self.factor, seq_len, original)
        inv_freq = beyond(seq_len, original, self._by_parts(spec, scale, device), default)
        return inv_freq, beyond(seq_len, original, yarn_mscale(scale), 1.0)
