"""OPT: a learned absolute position table (``decoder.embed_positions``, ``max_position_embeddings`` rows after 2
leading ones that OPT keeps, row 1 read at padding) and attention modules that run transformers'
``AttentionInterface``: the sites of ``families/tables.py``, as GPT-2's. Its table class takes OPT's call signature.
"""

from __future__ import annotations

import torch
from torch import nn

from rope_ext.installers.absolute import PositionTable
from rope_ext.families.base import register_family
from rope_ext.families.tables import LearnedTableFamily


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
        if padded.any() and not self.off:  # (the leading rows alone: the others may lie past the table)
            leading = position_ids.clamp(min=-self.offset, max=-1) + self.offset
            embedded = torch.where(padded[..., None], nn.functional.embedding(leading, self.weight), embedded)
        return embedded


class OPTFamily(LearnedTableFamily):
    name = "opt"
    owner_module = "transformers.models.opt.modeling_opt"
    owner_class = "OPTDecoder"
    table_attribute = "embed_positions"
    reader = OPTPositionTable


register_family(OPTFamily())
