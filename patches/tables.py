"""Families whose positions are one learned absolute table (GPT-2's ``wpe``, OPT's ``embed_positions``) in one
module of the model, with attention modules that run transformers' ``AttentionInterface``: the table site
(``absolute``: ``abs_interp``, ``abs_hierarchical``, ``sinusoidal`` read it past its rows) and the attention site
(``bias``: ALiBi and the other biases replace the table, which then adds nothing).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from rope_ext.hooks.absolute import AbsoluteSite, PositionTable
from rope_ext.hooks.attention import AttentionSite
from rope_ext.hooks.base import Sites
from rope_ext.patches.attention import attention_site
from rope_ext.patches.base import FamilyAdapter, modules_deriving_from


class LearnedTableFamily(FamilyAdapter):
    """A family found by the module that holds its table: ``owner_class`` of ``owner_module`` (by name), whose
    ``table_attribute`` is the table, read through ``reader``."""

    site_kinds = frozenset({AbsoluteSite.kind, AttentionSite.kind})
    owner_module: ClassVar[str]
    owner_class: ClassVar[str]
    table_attribute: ClassVar[str]
    reader: ClassVar[type[PositionTable]] = PositionTable

    def _owners(self, model: nn.Module) -> list[nn.Module]:
        return modules_deriving_from(model, self.owner_module, self.owner_class)

    def matches(self, model: nn.Module) -> bool:
        return bool(self._owners(model))

    def refuse(self, owner: nn.Module) -> None:
        """Raise ``ValueError`` where the model is one of the family's that rope_ext does not support."""

    def locate(self, model: nn.Module) -> Sites:
        found = self._owners(model)
        if len(found) != 1:
            raise ValueError(
                f"{self.name}: found {len(found)} {self.owner_class} modules; rope_ext patches a model with one"
            )
        owner = found[0]
        self.refuse(owner)
        table = AbsoluteSite(self.name, owner, self.table_attribute, getattr(owner, self.table_attribute), self.reader)
        sites: dict[str, list] = {AbsoluteSite.kind: [table]}
        attention = attention_site(self.name, model, owner.config)
        if attention is not None:
            sites[AttentionSite.kind] = [attention]
        return Sites(getattr(model, "config", owner.config), sites, model)
