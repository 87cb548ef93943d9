"""How far a model's positions reach, read through its family's sites (a learned absolute table, or the method
reading it)."""

from __future__ import annotations

from torch import nn

from rope_ext.families.base import find_family
from rope_ext.installers.absolute import AbsoluteSite, PositionTable


def position_limit(model: nn.Module) -> int | None:
    """How many positions ``model`` (patched or not) can take: a learned table's rows, or what the absolute method
    reading it reaches; ``None``: no limit (a model without a table, or whose table a bias switched off)."""
    try:
        sites = find_family(model).locate(model)
    except ValueError:
        return None
    limits = []
    for site in sites.get(AbsoluteSite.kind):
        table = getattr(site.parent, site.name)
        if not isinstance(table, PositionTable) or table.method is None:
            if not getattr(table, "off", False):  # (read as trained: its rows, past OPT's 2 leading ones)
                limits.append(table.weight.shape[0] - getattr(table, "offset", 0))
        elif (covered := table.method.covers(table.rows)) is not None:
            limits.append(covered)
    return min(limits) if limits else None

