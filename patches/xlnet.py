"""XLNet: Transformer-XL's sinusoidal relative distances, embedded once per forward by the model
(``XLNetModel.relative_positional_encoding``); the site of the ``distance`` methods."""

from __future__ import annotations

from torch import nn

from rope_ext.hooks.base import Sites
from rope_ext.hooks.distances import DistanceSite
from rope_ext.patches.base import FamilyAdapter, modules_deriving_from, register_family

_MODULE = "transformers.models.xlnet.modeling_xlnet"


class XLNetFamily(FamilyAdapter):
    name = "xlnet"
    site_kinds = frozenset({DistanceSite.kind})
    causal = False  # (without a permutation mask its attention sees both ways)

    def matches(self, model: nn.Module) -> bool:
        return bool(modules_deriving_from(model, _MODULE, "XLNetModel"))

    def locate(self, model: nn.Module) -> Sites:
        found = modules_deriving_from(model, _MODULE, "XLNetModel")
        if len(found) != 1:
            raise ValueError(f"{self.name}: found {len(found)} XLNetModel modules; rope_ext patches a model with one")
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"{self.name}: patch the whole model, not its {type(model).__name__} (it has no config)")
        return Sites(config, {DistanceSite.kind: [DistanceSite(self.name, found[0])]}, model)


register_family(XLNetFamily())
