"""LongRoPE (Ding et al. 2024, arXiv:2402.13753; a frequency method, formula in ``rope_ext.methods.frequency``):
per-dimension factors ``lambda_i``, ``theta_i / lambda_i`` with ``long_factor`` when ``l > L`` and ``short_factor``
otherwise, attention factor ``sqrt(1 + ln s / ln L)``.

Checked against transformers' ``_compute_longrope_parameters`` (5.23.0): native parity is bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import register_method
from rope_ext.methods.frequency import FREQUENCY_FACTOR, FrequencyConfig, RotarySpec, beyond, longrope_inv_freq
from rope_ext.methods.options import number_list, option, positive


@register_method
@dataclass(frozen=True)
class LongRopeConfig(FrequencyConfig):
    """LongRoPE: searched per-dimension factors. ``short_factor`` defaults to all ones (no change inside ``L``)."""

    method: ClassVar[str] = "longrope"
    summary: ClassVar[str] = (
        "LongRoPE (Ding et al. 2024, arXiv:2402.13753): each rotary frequency divided by its own searched factor, "
        "from long_factor past ``L`` and short_factor within it, and cos and sin times ``sqrt(1 + ln s / ln L)``. "
        "Saved as transformers' ``longrope`` rope type too."
    )
    dynamic: ClassVar[bool] = True  # switches factor lists at l > L
    default_factor: ClassVar[float | None] = 1.0  # (the factor lists scale; factor sets the attention factor only)

    factor: float | None = option(
        None, FREQUENCY_FACTOR,
        meaning="``s``, how many times the original context ``L`` is extended: it sets the attention factor only "
                "(the factor lists do the scaling)")
    long_factor: tuple[float, ...] | None = option(None, number_list(
        positive(), required=": a list of rotary_dim / 2 positive floats (one per frequency, e.g. from a LongRoPE "
                             "search or a Phi-3 config)"),
        meaning="the divisor of each rotary frequency past ``L``: rotary_dim / 2 positive floats, e.g. from a LongRoPE "
                "search or a Phi-3 config")
    short_factor: tuple[float, ...] | None = option(
        None, number_list(positive(), optional=True),
        meaning="the divisor of each rotary frequency within ``L``; None: all ones (no change inside ``L``)")
    attention_factor: float | None = option(
        None, positive(optional=True),
        meaning="a fixed cos/sin multiplier (attention logits scale by its square); None: ``sqrt(1 + ln s / ln L)`` "
                "(1 for ``s <= 1``)")

    def check_spec(self, spec: RotarySpec) -> None:
        for name in ("long_factor", "short_factor"):
            value = getattr(self, name)
            if value is not None and len(value) != spec.num_frequencies:
                raise ValueError(
                    f"{self.method}: {name} has {len(value)} entries; this model's rotary dimension is "
                    f"{spec.dim}, so it needs exactly {spec.num_frequencies} (rotary_dim / 2)"
                )

    def resolved_attention_factor(self, spec: RotarySpec) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(spec.original_max_position_embeddings))

    def _short(self, spec: RotarySpec) -> tuple[float, ...]:
        return self.short_factor if self.short_factor is not None else (1.0,) * spec.num_frequencies

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        constants = constants or self.constants(spec, device)
        if seq_len is None:
            return constants["short"], self.resolved_attention_factor(spec)
        inv_freq = beyond(seq_len, spec.original_max_position_embeddings, constants["long"], constants["short"])
        return inv_freq, self.resolved_attention_factor(spec)

    def constants(self, spec, device=None) -> dict[str, torch.Tensor]:
        self.check_spec(spec)
        return {
            "short": longrope_inv_freq(spec.base, spec.dim, self._short(spec), device),
            "long": longrope_inv_freq(spec.base, spec.dim, self.long_factor, device),
        }

    def native_rope_parameters(self, spec, max_position_embeddings):
        return {
            "rope_type": "longrope",
            "factor": float(self.factor),
            "attention_factor": self.resolved_attention_factor(spec),
            "long_factor": list(self.long_factor),
            "short_factor": list(self._short(spec)),
            "original_max_position_embeddings": spec.original_max_position_embeddings,
        }
