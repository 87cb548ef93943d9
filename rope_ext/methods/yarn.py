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
    dynamic_factor,
    dynamic_scale,
    yarn_mscale,
)
from rope_ext.methods.options import flag, option, positive


@dataclass(frozen=True)
class ByPartsConfig(FrequencyConfig):
    """Base of the NTK-by-parts methods: the ramp between ``beta_slow`` and ``beta_fast`` rotations."""

    beta_fast: float = option(
        32.0, positive(),
        meaning="the ramp's fast end, in rotations: dimensions that turn more than beta_fast times over ``L`` keep "
                "their frequency (YaRN's beta, 32)")
    beta_slow: float = option(
        1.0, positive(),
        meaning="the ramp's slow end, in rotations: dimensions that turn fewer than beta_slow times over ``L`` are "
                "interpolated, their frequency divided by ``s`` (YaRN's alpha, 1); a linear ramp mixes the two between")
    truncate: bool = option(
        True, flag(),
        meaning="whether the correction range's bounds (the ramp's ends as dimension indices) are floored and ceiled "
                "to whole dimensions, as transformers and the YaRN reference do; False: kept fractional")

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
    summary: ClassVar[str] = (
        "NTK-by-parts (bloc97; Peng et al. 2023, arXiv:2309.00071 section 3.2): frequencies that turn fewer than "
        "beta_slow times over ``L`` are divided by ``s``, those that turn more than beta_fast times are kept, and a "
        "linear ramp mixes the two between. Saved as transformers' ``yarn`` rope type with attention_factor 1 too."
    )

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        return self._by_parts(spec, self.factor, device), 1.0

    def native_rope_parameters(self, spec, max_position_embeddings):
        return self._native_yarn(spec, attention_factor=1.0)


@register_method
@dataclass(frozen=True)
class YarnConfig(ByPartsConfig):
    method: ClassVar[str] = "yarn"
    summary: ClassVar[str] = (
        "YaRN (Peng et al. 2023, arXiv:2309.00071, eq. 20-22): ``ntk_by_parts`` plus an attention temperature, cos "
        "and sin times ``0.1 ln s + 1`` (or DeepSeek's mscale / mscale_all_dim ratio). Saved as transformers' ``yarn`` "
        "rope type too."
    )

    attention_factor: float | None = option(
        None, positive(optional=True),
        meaning="a fixed cos/sin multiplier (attention logits scale by its square); None: YaRN's ``0.1 ln s + 1``, or "
                "the mscale / mscale_all_dim ratio when those are set")
    mscale: float | None = option(
        None, positive(optional=True),
        meaning="DeepSeek's attention-temperature numerator: the attention factor is "
                "``m(s, mscale) / m(s, mscale_all_dim)``, ``m(s, x) = 0.1 x ln s + 1``; None: not used (set both or "
                "neither)")
    mscale_all_dim: float | None = option(
        None, positive(optional=True),
        meaning="DeepSeek's attention-temperature denominator: the ``x`` of ``m(s, x)`` that divides "
                "``m(s, mscale)``; None: not used (set both or neither)")

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
    summary: ClassVar[str] = (
        "Dynamic YaRN (Peng et al. 2023, arXiv:2309.00071 section 3.3): ``yarn`` at a scale that follows the current "
        "length ``l``, ``s' = max(1, s*l/L - (s - 1))`` (``s = 1`` gives the paper's ``max(1, l/L)``)."
    )

    factor: float | None = dynamic_factor()  # (the dynamic meaning: ByPartsConfig brings the static one)

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        default = default_inv_freq(spec.base, spec.dim, device)
        if seq_len is None:
            return default, 1.0
        original = spec.original_max_position_embeddings
        scale = dynamic_scale(self.factor, seq_len, original)
        inv_freq = beyond(seq_len, original, self._by_parts(spec, scale, device), default)
        return inv_freq, beyond(seq_len, original, yarn_mscale(scale), 1.0)
