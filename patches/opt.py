"""OPT: a learned absolute position table (``decoder.embed_positions``, ``max_position_embeddings`` rows after 2
leading ones that OPT keeps, row 1 read at padding) and attention modules that run transformers'
``AttentionInterface``. The same methods as GPT-2 (``patches/gpt2.py``) serve it: the table read past its rows
(``absolute``), or switched off under a bias (``bias``).
"""

from __future__ import annotations

import torch
from torch import nn

from rope_ext.hooks.absolute import AbsoluteSite, PositionTable
from rope_ext.hooks.attention import AttentionSite
from rope_ext.hooks.base import Sites
from rope_ext.patches.attention import attention_site
from rope_ext.patches.base import FamilyAdapter, modules_deriving_from, register_family

_MODULE = "transformers.models.opt.modeling_opt"


class OPTPositionTable(PositionTable):
    """OPT's table as its decoder calls it: position ids from the attention mask (OPT's own rule) when none are
    given; padded tokens (id -1) read row 1 as in OPT, every other position goes through the method."""

    offset = 2

    def forward(
        self,
        attention_mask: torch.Tensor,
        past_key_values_length: int = 0,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:  # (OPTLearnedPositionalEmbedding's rule)
            position_ids = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
            position_ids = position_ids[:, past_key_values_length:]
        embedded = self.read(position_ids.clamp(min=0))
        padded = position_ids < 0
        if padded.any() and not self.off:
            rows = nn.functional.embedding(position_ids.clamp(min=-self.offset) + self.offset, self.weight)
            embedded = torch.where(padded[..., None], rows, embedded)
        return embedded


class OPTFamily(FamilyAdapter):
    name = "opt"
    site_kinds = frozenset({AbsoluteSite.kind, AttentionSite.kind})

    def _decoders(self, model: nn.Module) -> list[nn.Module]:
        return modules_deriving_from(model, _MODULE, "OPTDecoder")

    def matches(self, model: nn.Module) -> bool:
        return bool(self._decoders(model))

    def locate(self, model: nn.Module) -> Sites:
        found = self._decoders(model)
        if len(found) != 1:
            raise ValueError(f"opt: found {len(found)} OPTDecoder modules; rope_ext patches a model with one")
        decoder = found[0]
        table = AbsoluteSite(self.name, decoder, "embed_positions", decoder.embed_positions, OPTPositionTable)
        sites: dict[str, list] = {AbsoluteSite.kind: [table]}
        attention = attention_site(self.name, model, decoder.config)
        if attention is not None:
            sites[AttentionSite.kind] = [attention]
        return Sites(getattr(model, "config", decoder.config), sites, model)


register_family(OPTFamily())
