"""The rotation an engine computes from a config: the common record of ``rope_ext.serving.engines``' readers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rotation:
    """What one engine computes for a config at some positions.

    ``cos``/``sin``: ``[positions, rotary_dim // 2]`` float64, one column per frequency pair, the engine's attention
    factor (YaRN's mscale, LongRoPE's scaling) multiplied in, as its rotary cache holds them. ``softmax_scale``: the
    attention's softmax scale where the engine changes it from ``head_dim ** -0.5`` for this config (DeepSeek's
    ``mscale_all_dim``), else ``None``. ``ignored``: what the config states that the engine does not read or
    overrides, as dotted keys (``rope_parameters.attention_factor``) with why, one line each. ``max_length``: the
    longest context the engine serves from this config when the user gives none (vLLM's derived ``max_model_len``,
    llama.cpp's ``n_ctx_train``). ``notes``: other behaviour worth a line (a per-request choice of factors).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    softmax_scale: float | None = None
    ignored: list[str] = field(default_factory=list)
    max_length: int | None = None
    notes: list[str] = field(default_factory=list)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    """``cos(p * f) * a`` and ``sin(p * f) * a`` in float64 for every position ``p`` and frequency ``f``."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return angles.cos() * attention_factor, angles.sin() * attention_factor
