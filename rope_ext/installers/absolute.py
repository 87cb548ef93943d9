"""The absolute site (a learned position table such as GPT-2's ``wpe``) and the hook kind ``absolute``.

``PositionTable`` stands in for the table's ``nn.Embedding``: it holds the *same* parameter under the same name
(``weight``), so the state dict keeps the key and shape, and reads it at call time through the method's
``embed`` (``rope_ext.methods.absolute``). A bias method switches it off (zeros: the bias is then the model's only
position information). The model config is left alone: its ``n_positions`` sizes the table when the model is
rebuilt from ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from rope_ext.installers.base import HookInstaller, PlanBuilder, RopeExtModule, Site, register_hook
from rope_ext.methods import HOOK_ABSOLUTE, AbsoluteConfig, MethodConfig


class PositionTable(RopeExtModule):
    """A learned position table read by an absolute-table method, or switched off (zeros).

    ``offset``: rows before position 0 (OPT keeps 2 there); the method reads the rows from ``offset`` on, which
    ``rows`` counts. A family whose table module takes other arguments subclasses this and calls ``read``."""

    offset = 0

    def __init__(self, original: nn.Embedding) -> None:
        super().__init__()
        self.weight = original.weight  # the table's own parameter: same key, shape and values
        self.method: AbsoluteConfig | None = None
        self.off = False

    def switch_off(self) -> None:
        self.off = True

    @property
    def rows(self) -> int:
        return self.weight.shape[0] - self.offset

    def read(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of positions ``position_ids`` (>= 0)."""
        if self.off:
            return self.weight.new_zeros(*position_ids.shape, self.weight.shape[1])
        table = self.weight[self.offset :] if self.offset else self.weight
        if self.method is None:
            return nn.functional.embedding(position_ids, table)
        return self.method.embed(table, position_ids)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.read(position_ids)

    def extra_repr(self) -> str:
        what = "off (a bias replaces it)" if self.off else (self.method.method if self.method else "as trained")
        return f"{self.rows} rows, {what}"


@dataclass(eq=False)
class AbsoluteSite(Site):
    """A learned position table (``parent.name``, an ``nn.Embedding`` read at the position ids)."""

    kind: ClassVar[str] = "absolute"

    family: str
    parent: nn.Module
    name: str
    table: nn.Embedding
    reader: type[PositionTable] = PositionTable  # (a family whose table takes other arguments gives a subclass)

    def replacement(self, builder: PlanBuilder) -> PositionTable:
        return builder.replacement(self, lambda: (self.parent, self.name, self.reader(self.table)))


class AbsoluteInstaller(HookInstaller):
    """Absolute-table methods: the table read through the method."""

    kind = HOOK_ABSOLUTE
    site_kinds = frozenset({AbsoluteSite.kind})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, AbsoluteConfig)
        for site in builder.sites.get(AbsoluteSite.kind):
            site.replacement(builder).method = method


register_hook(AbsoluteInstaller())
