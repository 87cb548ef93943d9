"""Query scaling (hook kind ``query_scale``): queries multiplied per position, beside any position encoding.

log-n scaling (Su 2021; in ReRoPE's patch): queries times ``max(1, ln(i + 1) / ln L)``; Llama 4's attention temperature:
queries times ``1 + s ln(floor((i + 1) / F) + 1)``. (DCA's scale_queries is a query scale too, installed with its
rule: ``DualChunkConfig.query_multiplier``.) A query scale's ``layers`` says which layers take it: ``rope`` (the
full-attention layers with positions), ``nope`` (those without), ``all``.

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import HOOK_QUERY_SCALE, MethodConfig, register_method
from rope_ext.methods.options import Check, context_length, interval, one_of, option


@register_method
@dataclass(frozen=True)
class LogNConfig(MethodConfig):
    """log-n attention scaling (Su 2021; in ReRoPE's patch): query ``i`` times ``max(1, ln(i + 1) / ln L)``,
    keeping attention's entropy as the context grows. Its own hook kind, so it combines with any method."""

    method: ClassVar[str] = "logn"
    hook: ClassVar[str] = HOOK_QUERY_SCALE
    #: the layers that take it (``QueryScaleInstaller``): the full-attention layers with positions
    layers: ClassVar[str] = "rope"
    summary: ClassVar[str] = (
        "log-n attention scaling (Su 2021; in ReRoPE's patch): query ``i`` multiplied by ``max(1, ln(i + 1) / ln L)``, "
        "keeping attention's entropy as the context grows; its own hook kind, so it combines with any method."
    )

    original_max_position_embeddings: int | None = option(
        None, context_length(),
        meaning="``L`` in ``max(1, ln(i + 1) / ln L)``; None: the rotation's (a frequency method's stated one, else "
                "the model config's)")

    def query_multiplier(self, i: torch.Tensor, original: int) -> torch.Tensor:
        """``max(1, ln(i + 1) / ln L)`` at query positions ``i`` (float64)."""
        length = self.original_max_position_embeddings or original
        return torch.clamp(torch.log(i.to(torch.float64) + 1) / math.log(length), min=1.0)


@register_method
@dataclass(frozen=True)
class TemperatureConfig(MethodConfig):
    """Llama 4's attention temperature (``attn_temperature_tuning``): query ``i`` times
    ``1 + attn_scale * ln(floor((i + 1) / floor_scale) + 1)``, a step up every ``floor_scale`` positions; Llama 4
    applies it on its layers without positions (NoPE), and any family can take it on those, or on every layer."""

    method: ClassVar[str] = "temperature"
    hook: ClassVar[str] = HOOK_QUERY_SCALE
    summary: ClassVar[str] = (
        "Llama 4's attention temperature (attn_temperature_tuning): query ``i`` multiplied by ``1 + attn_scale * "
        "ln(floor((i + 1) / floor_scale) + 1)``, sharper attention far into a long context; on the layers without "
        "positions (Llama 4's NoPE layers) or on every layer."
    )

    attn_scale: float = option(
        0.1, interval(0, 10), meaning="``s``, how much each step of floor_scale positions sharpens (Llama 4's 0.1)")
    floor_scale: int | None = option(
        None, context_length(),
        meaning="``F``, the positions per step; None: ``L`` (the rotation's original context; Llama 4's is 8192)")
    position_offset: int = option(
        1, Check("0 or 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v in (0, 1)),
        meaning="``o`` in ``floor((i + o) / F)``: 1 counts positions from one (Llama 4's), 0 from zero (Ministral 3's "
                "and Mistral 4's llama_4_scaling_beta, which rope_ext then writes into their rope parameters)")
    layers: str = option(
        "all", one_of("all", "nope", "rope"),
        meaning="the full-attention layers that take it: all, nope (those without positions: Llama 4's) or rope "
                "(those with them); sliding-window layers never do")

    def query_multiplier(self, i: torch.Tensor, original: int) -> torch.Tensor:
        """``1 + s ln(floor((i + o) / F) + 1)`` at query positions ``i`` (float64)."""
        steps = torch.floor((i.to(torch.float64) + self.position_offset) / (self.floor_scale or original))
        return 1 + self.attn_scale * torch.log1p(steps)
