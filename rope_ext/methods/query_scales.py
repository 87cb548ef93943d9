"""Query scaling (hook kind ``query_scale``): queries multiplied per position, beside any position encoding.

log-n scaling (Su 2021; in ReRoPE's patch): queries times ``max(1, ln(i + 1) / ln L)``. (DCA's scale_queries is a query
scale too, installed with its rule: ``DualChunkConfig.query_multiplier``.)

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import HOOK_QUERY_SCALE, MethodConfig, register_method
from rope_ext.methods.options import context_length, option


@register_method
@dataclass(frozen=True)
class LogNConfig(MethodConfig):
    """log-n attention scaling (Su 2021; in ReRoPE's patch): query ``i`` times ``max(1, ln(i + 1) / ln L)``,
    keeping attention's entropy as the context grows. Its own hook kind, so it combines with any method."""

    method: ClassVar[str] = "logn"
    hook: ClassVar[str] = HOOK_QUERY_SCALE
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
