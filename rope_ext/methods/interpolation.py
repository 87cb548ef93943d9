"""Position interpolation and NTK-aware scaling (frequency methods; formulas in ``rope_ext.methods.frequency``).

* ``pi`` -- Position Interpolation (Chen et al. 2023, arXiv:2306.15595): ``theta_i / s``, positions divided by ``s``.
* ``ntk`` -- NTK-aware scaling (bloc97, 2023): base ``b * s ** (d / (d - 2))``; the highest frequency unchanged, the
  lowest divided by exactly ``s``.
* ``dynamic_ntk`` -- dynamic NTK (emozilla, 2023): ``ntk`` with ``s' = s*l/L - (s - 1)`` when ``l > L``, the identity
  otherwise.

Checked against transformers' ``_compute_linear_scaling_rope_parameters`` and ``_compute_dynamic_ntk_parameters``
(5.23.0): native parity is bitwise for the inverse frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rope_ext.methods.base import register_method
from rope_ext.methods.frequency import (
    DynamicFrequencyConfig,
    FrequencyConfig,
    beyond,
    default_inv_freq,
    dynamic_scale,
    ntk_base,
)
from rope_ext.methods.options import context_length, option


@register_method
@dataclass(frozen=True)
class PIConfig(FrequencyConfig):
    method: ClassVar[str] = "pi"
    summary: ClassVar[str] = (
        "Position Interpolation (Chen et al. 2023, arXiv:2306.15595): every rotary frequency divided by ``s``, i.e. "
        "positions divided by ``s``. Saved as transformers' ``linear`` rope type too."
    )
    unused_shared_options: ClassVar[frozenset[str]] = frozenset({"original_max_position_embeddings"})

    original_max_position_embeddings: int | None = option(
        None, context_length(),
        meaning="not used: PI divides every position by factor, whatever the original context; leave it unset")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.original_max_position_embeddings is not None:
            raise ValueError(
                "pi: original_max_position_embeddings has no effect (PI divides every position by factor, "
                "whatever the original length); leave it unset"
            )

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        return default_inv_freq(spec.base, spec.dim, device) / self.factor, 1.0

    def native_rope_parameters(self, spec, max_position_embeddings):
        return {"rope_type": "linear", "factor": float(self.factor)}


@register_method
@dataclass(frozen=True)
class NTKConfig(FrequencyConfig):
    method: ClassVar[str] = "ntk"
    summary: ClassVar[str] = (
        "NTK-aware scaling (bloc97, 2023): the rotary base ``b`` replaced by ``b * s ** (d / (d - 2))``, so the "
        "highest frequency is kept and the lowest divided by exactly ``s``. Saved as that base (transformers' "
        "``default`` rope type with the new ``rope_theta``)."
    )

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        return default_inv_freq(ntk_base(spec.base, spec.dim, self.factor), spec.dim, device), 1.0

    def native_rope_parameters(self, spec, max_position_embeddings):
        # exactly a new base: every engine serves it as an unscaled rotation of that base
        return {"rope_type": "default", "rope_theta": ntk_base(spec.base, spec.dim, self.factor)}


@register_method
@dataclass(frozen=True)
class DynamicNTKConfig(DynamicFrequencyConfig):
    method: ClassVar[str] = "dynamic_ntk"
    summary: ClassVar[str] = (
        "Dynamic NTK (emozilla, 2023): ``ntk`` at a scale that follows the current length ``l``, "
        "``s' = s*l/L - (s - 1)`` when ``l > L``, the identity within ``L``. Saved as transformers' ``dynamic`` rope "
        "type too where ``L`` is the model's max_position_embeddings."
    )

    def frequencies(self, spec, seq_len=None, device=None, constants=None):
        default = default_inv_freq(spec.base, spec.dim, device)
        if seq_len is None:
            return default, 1.0
        scale = dynamic_scale(self.factor, seq_len, spec.original_max_position_embeddings)
        scaled = default_inv_freq(ntk_base(spec.base, spec.dim, scale), spec.dim, device)
        return beyond(seq_len, spec.original_max_position_embeddings, scaled, default), 1.0

    def native_rope_parameters(self, spec, max_position_embeddings):
        # transformers' "dynamic" takes L from max_position_embeddings; equivalent only when they agree.
        if spec.original_max_position_embeddings != max_position_embeddings:
            return None
        return {"rope_type": "dynamic", "factor": float(self.factor)}
