"""Llama 3.1's frequency scaling (a frequency method; formula in ``rope_ext.methods.frequency``).

* ``llama3`` -- Llama 3.1 (Meta 2024): wavelengths ``> L/low_freq_factor`` divided by ``s``, ``< L/high_freq_factor``
  kept, smooth interpolation between.

Checked against transformers' ``_compute_llama3_parameters`` (5.23.0): native parity is bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rope_ext.methods.base import register_method
from rope_ext.methods.frequency import FrequencyConfig, llama3_inv_freq
from rope_ext.methods.options import option, positive


@register_method
@dataclass(frozen=True)
class Llama3Config(FrequencyConfig):
    method: ClassVar[str] = "llama3"
    summary: ClassVar[str] = (
        "Llama 3.1's frequency scaling (Meta 2024, The Llama 3 Herd of Models, arXiv:2407.21783): frequencies whose "
        "wavelength is longer than ``L / low_freq_factor`` divided by ``s``, those shorter than "
        "``L / high_freq_factor`` kept, a smooth mix between. Saved as transformers' ``llama3`` rope type too."
    )

    low_freq_factor: float = option(
        1.0, positive(),
        meaning="frequencies whose wavelength is longer than ``L / low_freq_factor`` are divided by ``s`` (Llama "
                "3.1: 1)")
    high_freq_factor: float = option(
        4.0, positive(),
        meaning="frequencies whose wavelength is shorter than ``L / high_freq_factor`` are kept; between the two "
                "bands, a smooth mix (Llama 3.1: 4; above low_freq_factor)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"{self.method}: high_freq_factor must be > low_freq_factor (defaults 4 and 1), "
                f"got high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        inv_freq = llama3_inv_freq(
            spec.base,
            spec.dim,
            self.factor,
            spec.original_max_position_embeddings,
            self.low_freq_factor,
            self.high_freq_factor,
            device,
        )
        return inv_freq, 1.0

    def native_rope_parameters(self, spec, max_position_embeddings):
        return {
            "rope_type": "llama3",
            "factor": float(self.factor),
            "low_freq_factor": float(self.low_freq_factor),
            "high_freq_factor": float(self.high_freq_factor),
            "original_max_position_embeddings": spec.original_max_position_embeddings,
        }
