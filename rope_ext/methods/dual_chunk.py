"""Dual Chunk Attention (An et al. 2024, arXiv:2402.17463; HKUNLP/ChunkLlama), a position rule
(``rope_ext.methods.position_rules``; its mapping is ``rope_ext.methods.windows.dca_positions``).

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import register_method
from rope_ext.methods.options import flag, integer, option
from rope_ext.methods.position_rules import PositionRuleConfig, Region, check_below, check_within
from rope_ext.methods.windows import dca_positions


@register_method
@dataclass(frozen=True)
class DualChunkConfig(PositionRuleConfig):
    """Dual Chunk Attention (An et al. 2024, arXiv:2402.17463; HKUNLP/ChunkLlama): keys at ``j mod s``
    (``s = chunk_size - local_window``); a query at ``i mod s`` for its own chunk, at
    ``min(i mod s + s, chunk_size)`` for the previous one, at ``chunk_size`` for older ones.

    Defaults ``chunk_size = 3L/4``, ``local_window = L/8`` (the reference's; below a smaller ``chunk_size``). ``scale_queries`` multiplies the scores
    of query ``i`` by ``(0.05 ln((i + 1) / L) + 1) ** 2`` beyond ``L``: the reference's ``0.05 ln(n/L) + 1`` on
    both q and k, with ``n`` taken per query so that generation with the cache equals a full forward.
    """

    method: ClassVar[str] = "dca"
    #: YaRN's ``mscale`` is a number; DCA's switch was named after the reference's variable
    renamed_options: ClassVar[dict[str, str]] = {"mscale": "scale_queries"}
    summary: ClassVar[str] = (
        "Dual Chunk Attention (An et al. 2024, arXiv:2402.17463; HKUNLP/ChunkLlama): the sequence cut into chunks of "
        "``s = chunk_size - local_window`` tokens, keys at ``j mod s`` and each query at a position set by the key's "
        "chunk (its own, the previous one, an older one), so no relative position passes chunk_size."
    )

    chunk_size: int | None = option(
        None, integer(2, optional=True),
        meaning="the largest relative position in use: queries are at most there, chunks are "
                "``chunk_size - local_window`` long; None: ``3L/4`` (the reference's)")
    local_window: int | None = option(
        None, integer(1, optional=True),
        meaning="the local window: a query in the first local_window positions of its chunk sees the previous "
                "chunk's keys at their true distance; None: ``L/8`` (the reference's; below chunk_size)")
    scale_queries: bool = option(
        True, flag(),
        meaning="multiply the scores of query ``i`` beyond ``L`` by ``(0.05 ln((i + 1) / L) + 1)^2`` (the "
                "reference's ``mscale``, ``0.05 ln(n/L) + 1`` on q and k; ``mscale`` before 0.2)")

    def with_defaults(self, original: int) -> DualChunkConfig:
        chunk_size = self.chunk_size if self.chunk_size is not None else max(2, 3 * original // 4)
        check_within(self.method, "chunk_size", chunk_size, original, low=2)
        local = self.local_window if self.local_window is not None else max(1, min(original // 8, chunk_size - 1))
        check_below(self.method, "local_window", local, chunk_size, "chunk_size")
        return dataclasses.replace(self, chunk_size=chunk_size, local_window=local)

    @property
    def chunk(self) -> int:
        return self.chunk_size - self.local_window

    def query_scale(self, i: torch.Tensor, original: int) -> torch.Tensor | None:
        """The multiplier at query positions ``i`` (``None`` with ``scale_queries`` off); ``L`` is the config's own
        when it states one, else ``original``."""
        if not self.scale_queries:
            return None
        length = self.original_max_position_embeddings or original
        return torch.clamp(0.05 * torch.log((i.to(torch.float64) + 1) / length) + 1, min=1.0) ** 2

    def query_multiplier(self, i: torch.Tensor, original: int) -> torch.Tensor:
        """The program's form of ``query_scale`` (installed only with ``scale_queries``)."""
        return self.query_scale(i, original)

    def relative(self, i, j):
        return dca_positions(i, j, self.chunk_size, self.local_window)

    def _chunk_of(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.div(positions, self.chunk, rounding_mode="floor")

    def _same_chunk(self, i, j):
        return self._chunk_of(i) == self._chunk_of(j)

    def _previous_chunk(self, i, j):
        return self._chunk_of(i) == self._chunk_of(j) + 1

    def _older_chunk(self, i, j):
        return self._chunk_of(i) >= self._chunk_of(j) + 2

    def _within(self, positions):
        return torch.remainder(positions, self.chunk)

    def _successive_query(self, i):
        return torch.clamp(torch.remainder(i, self.chunk) + self.chunk, max=self.chunk_size)

    def _older_query(self, i):
        return torch.full_like(i, float(self.chunk_size))

    def regions(self) -> list[Region]:
        return [
            Region(self._same_chunk, self._within, self._within),
            Region(self._previous_chunk, self._successive_query, self._within),
            Region(self._older_chunk, self._older_query, self._within),
        ]
