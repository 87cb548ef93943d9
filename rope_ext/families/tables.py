"""Families whose positions are one learned absolute table (GPT-2's ``wpe``, OPT's ``embed_positions``) in one
module of the model, with attention modules that run transformers' ``AttentionInterface``: the table site
(``absolute``: ``abs_interp``, ``abs_hierarchical``, ``sinusoidal`` read it past its rows) and the attention site
(``bias``: ALiBi and the other biases replace the table, which then adds nothing).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from rope_ext.installers.absolute import AbsoluteSite, PositionTable
from rope_ext.installers.attention import AttentionSite
from rope_ext.installers.base import Sites
from rope_ext.families.attention import attention_site
from rope_ext.families.base import OwnerFamily


class LearnedTableFamily(OwnerFamily):
    """A family found by the module that holds its table (``owner_class``), whose ``table_attribute`` is the table,
    read through ``reader``."""

    site_kinds = frozenset({AbsoluteSite.kind, AttentionSite.kind})
    table_attribute: ClassVar[str]
    reader: ClassVar[type[PositionTable]] = PositionTable

    def refuse(self, owner: nn.Module) -> None:
        """Raise ``ValueError`` where the model is one of the family's that rope_ext does not support."""

    def locate(self, model: nn.Module) -> Sites:
        owner = self.owner(model)
        self.refuse(owner)
        table = AbsoluteSite(self.name, owner, self.table_attribute, getattr(owner, self.table_attribute), self.reader)
        sites: dict[str, list] = {AbsoluteSite.kind: [table]}
        attention = attention_site(self.name, model, owner.config)
        if attention is not None:
            sites[AttentionSite.kind] = [attention]
        return Sites(getattr(model, "config", owner.config), sites, model)
