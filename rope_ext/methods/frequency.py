"""Frequency-scaling methods: new rotary inverse frequencies ``(inv_freq, attention_factor)``.

Notation: ``b`` the rotary base (``rope_theta``), ``d`` the rotary dimension (``head_dim`` times
``partial_rotary_factor``), ``theta_i = b ** (-2i / d)`` for ``i < d/2`` the inverse frequencies,
``L`` the original (pre-training) context, ``s`` the scale factor, ``l`` the current sequence length.
Position ``m`` rotates pair ``i`` by ``m * theta_i``; ``attention_factor`` multiplies cos and sin, so
it scales attention logits by its square (YaRN's temperature ``1/sqrt(t)``).

* ``pi`` -- Position Interpolation (Chen et al. 2023, arXiv:2306.15595): ``theta_i / s``, i.e. positions
  divided by ``s``.
* ``ntk`` -- NTK-aware scaling (bloc97, 2023): base ``b * s ** (d / (d - 2))``; the highest frequency
  (``i = 0``) is unchanged and the lowest is divided by exactly ``s``.
* ``dynamic_ntk`` -- dynamic NTK (emozilla, 2023): ``ntk`` with ``s' = s*l/L - (s - 1)`` when ``l > L``,
  the identity otherwise.
* ``ntk_by_parts`` -- NTK-by-parts (bloc97; Peng et al. 2023, arXiv:2309.00071 section 3.2): with
  ``r_i = L * theta_i / (2 pi)`` rotations in the original window and a ramp ``gamma`` that is 0 for
  ``r_i < beta_slow`` and 1 for ``r_i > beta_fast``, ``theta_i' = (1 - gamma) theta_i / s + gamma theta_i``.
* ``yarn`` -- YaRN (Peng et al. 2023, eq. 20-22): ``ntk_by_parts`` plus attention temperature
  ``sqrt(1/t) = 0.1 ln s + 1`` (or DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio).
* ``dynamic_yarn`` -- YaRN section 3.3: ``yarn`` with ``s' = max(1, s*l/L - (s - 1))`` (``s = 1`` gives
  the paper's ``max(1, l/L)``).
* ``llama3`` -- Llama 3.1 (Meta 2024): wavelengths ``> L/low_freq_factor`` divided by ``s``, ``< L/high_freq_factor``
  kept, smooth interpolation between.
* ``longrope`` -- LongRoPE (Ding et al. 2024, arXiv:2402.13753): per-dimension factors ``lambda_i``,
  ``theta_i / lambda_i`` with ``long_factor`` when ``l > L`` and ``short_factor`` otherwise, attention
  factor ``sqrt(1 + ln s / ln L)``.

Checked against transformers' ``modeling_rope_utils.py`` (5.23.0: ``_compute_linear_scaling_rope_parameters``,
``_compute_dynamic_ntk_parameters``, ``_compute_yarn_parameters``, ``_compute_llama3_parameters``,
``_compute_longrope_parameters``) and jquesnelle/yarn ``scaled_rope/LlamaDynamicYaRNScaledRotaryEmbedding.py``
(commit a18e549); the floating-point operations follow transformers' order so native parity is bitwise
for the inverse frequencies. Convention: HF's ``rotate_half`` (pair ``i`` is dims ``i`` and ``i + d/2``).

This module holds the formulas and the bases (``FrequencyConfig``, ``DynamicFrequencyConfig``); the methods are in
``interpolation`` (pi, ntk, dynamic_ntk), ``yarn`` (ntk_by_parts, yarn, dynamic_yarn), ``llama3`` and ``longrope``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rope_ext.methods.base import HOOK_FREQUENCY, MethodConfig
from rope_ext.methods.options import context_length, factor_range, flag, option


@dataclass(frozen=True)
class RotarySpec:
    """What a frequency method needs to know about one rotary embedding."""

    base: float  # rope_theta
    dim: int  # rotary dimension (even)
    original_max_position_embeddings: int  # L, the pre-training context
    #: how the model's cos/sin tables lay the pairs out (``rope_ext.methods.rope.LAYOUTS``): ``"cat"``, transformers'
    #: shared ``rotate_half`` one; ``"interleave"``, adjacent pairs (Cohere); ``"half"``, one entry a pair (gpt-oss)
    layout: str = "cat"
    #: proportional RoPE (transformers' ``proportional`` rope type, Gemma 4's and Lfm3's): the frequencies past the
    #: first ``rotated`` are zero (a rotation over the whole head whose last pairs stay put); ``None``: all rotate
    rotated: int | None = None

    @property
    def num_frequencies(self) -> int:
        return self.dim // 2

    def kept(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """``inv_freq`` with the frequencies past ``rotated`` zero (as they are; a copy where it zeroes them)."""
        if self.rotated is None:
            return inv_freq
        return torch.cat([inv_freq[: self.rotated], inv_freq.new_zeros(inv_freq.shape[-1] - self.rotated)])


# --- pure formulas ---------------------------------------------------------------------------------


def default_inv_freq(base: float, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """``theta_i = base ** (-2i / dim)``, float32, shape ``[dim // 2]``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # made on the device
    return 1.0 / (base**exponents)


def ntk_base(base: float, dim: int, factor: float | torch.Tensor) -> float | torch.Tensor:
    """NTK-aware base change: ``b * s ** (d / (d - 2))``."""
    return base * factor ** (dim / (dim - 2))


#: A sequence length: a Python int, or a 0-d tensor (``max(position_ids) + 1`` inside a forward, kept on
#: the device so the dynamic methods need no host sync and compile into one graph).
SeqLen = int | torch.Tensor


def dynamic_scale(factor: float, seq_len: SeqLen, original: int) -> float | torch.Tensor:
    """Effective scale of the dynamic methods: ``s * l / L - (s - 1)``, never below 1.

    For a tensor length the arithmetic is transformers' own (float32, ``l`` raised to ``L`` first), so
    dynamic NTK stays bitwise equal to its native ``dynamic`` rope type.
    """
    if isinstance(seq_len, torch.Tensor):
        seq_len = torch.clamp(seq_len, min=original)
        return factor * seq_len / original - (factor - 1)
    return max(1.0, factor * seq_len / original - (factor - 1))


def beyond(seq_len: SeqLen, original: int, scaled: torch.Tensor, unscaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` when ``seq_len > original`` else ``unscaled``, without a host sync for tensor lengths."""
    if isinstance(seq_len, torch.Tensor):
        return torch.where(seq_len > original, scaled, unscaled)
    return scaled if seq_len > original else unscaled


def yarn_mscale(scale: float | torch.Tensor, mscale: float = 1.0) -> float | torch.Tensor:
    """YaRN's ``sqrt(1/t) = 0.1 * mscale * ln(s) + 1`` (1 for ``s <= 1``)."""
    if isinstance(scale, torch.Tensor):
        return torch.where(scale <= 1, 1.0, 0.1 * mscale * torch.log(scale) + 1.0)
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def correction_dim(num_rotations: float, dim: int, base: float, original: int) -> float:
    """Dimension index whose wavelength completes ``num_rotations`` turns in ``original`` tokens."""
    return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def by_parts_inv_freq(
    base: float,
    dim: int,
    factor: float,
    original: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
    device: torch.device | None = None,
) -> torch.Tensor:
    """NTK-by-parts frequencies: interpolate (``/ s``) the slow dims, keep the fast ones, ramp between."""
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)

    low = correction_dim(beta_fast, dim, base, original)
    high = correction_dim(beta_slow, dim, base, original)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp  # gamma: 1 = keep frequency
    return inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight


def llama3_inv_freq(
    base: float,
    dim: int,
    factor: float,
    original: int,
    low_freq_factor: float,
    high_freq_factor: float,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Llama 3.1 frequency scaling by wavelength band."""
    inv_freq = default_inv_freq(base, dim, device)
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freq(
    base: float, dim: int, ext_factors: list[float] | tuple[float, ...], device: torch.device | None = None
) -> torch.Tensor:
    """Per-dimension rescaling ``theta_i / lambda_i``."""
    factors = torch.tensor(ext_factors, dtype=torch.float32, device=device)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (factors * base**exponents)


# --- configs ---------------------------------------------------------------------------------------

#: the check of every frequency method's ``factor``
FREQUENCY_FACTOR = factor_range("the context is extended factor times", "shrink the context")


@dataclass(frozen=True)
class FrequencyConfig(MethodConfig):
    """Base of the frequency methods: ``factor`` and the original context ``L``."""

    hook: ClassVar[str] = HOOK_FREQUENCY
    #: True when the frequencies depend on the current sequence length.
    dynamic: ClassVar[bool] = False

    #: the factor when none is given: ``None`` (required) for the static methods, whose factor 1 is the identity
    default_factor: ClassVar[float | None] = None

    factor: float | None = option(
        None, FREQUENCY_FACTOR,
        meaning="``s``, how many times the original context ``L`` is extended (1 is the identity)")
    original_max_position_embeddings: int | None = option(
        None, context_length(),
        meaning="``L``, the context the model was trained at; None: the model config's (its rope_parameters' or its "
                "own original_max_position_embeddings, else max_position_embeddings)")

    def __post_init__(self) -> None:
        if self.factor is None and self.default_factor is not None:
            object.__setattr__(self, "factor", self.default_factor)
        super().__post_init__()

    def frequencies(
        self,
        spec: RotarySpec,
        seq_len: SeqLen | None = None,
        device: torch.device | None = None,
        constants: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, float | torch.Tensor]:
        """``(inv_freq [dim // 2] float32, attention_factor)`` for sequences of length ``seq_len``.

        ``constants`` are this method's ``constants(spec, device)``, computed once by the caller.
        """
        raise NotImplementedError

    def constants(self, spec: RotarySpec, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Tensors a length-dependent method needs on every call but that do not depend on the length
        (made once and kept on the model's device, so a forward copies nothing from the host)."""
        return {}

    def check_spec(self, spec: RotarySpec) -> None:
        """Raise ``ValueError`` if the method cannot apply to this rotary embedding."""

    def native_rope_parameters(self, spec: RotarySpec, max_position_embeddings: int) -> dict[str, Any] | None:
        """transformers' own ``rope_parameters`` giving the same frequencies, or ``None`` if it has none."""
        return None


def dynamic_factor() -> Any:
    """The ``factor`` option of a method whose frequencies follow the current length (declared on each such base)."""
    return option(
        None, FREQUENCY_FACTOR,
        meaning="``s``: at the current length ``l`` the frequencies are scaled as a static method's by "
                "``s*l/L - (s - 1)``, never below 1 (1, the default, follows ``l / L`` past ``L``)")


@dataclass(frozen=True)
class DynamicFrequencyConfig(FrequencyConfig):
    """Base of the methods whose frequencies follow the current length (``dynamic_ntk``, ``dynamic_yarn``).

    ``cache_consistent=True``: keys are cached unrotated and every step rotates all of them with the current
    length's frequencies (through the attention hook), so a cached step sees the rotation a full forward of
    the same tokens would (transformers #25104: natively, keys keep the rotation of the step that cached
    them). Hidden states of earlier tokens in deeper layers still come from the step that computed them.
    """

    dynamic: ClassVar[bool] = True
    default_factor: ClassVar[float | None] = 1.0  # (factor 1 still scales past L: by l / L)

    factor: float | None = dynamic_factor()
    cache_consistent: bool = option(
        False, flag(),
        meaning="True: keys are cached unrotated and every step rotates all of them with the current length's "
                "frequencies, as a full forward would; False: cached keys keep the rotation of the step that cached "
                "them (transformers' behaviour, #25104)")
