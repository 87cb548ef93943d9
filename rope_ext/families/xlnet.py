"""XLNet: Transformer-XL's sinusoidal relative distances, embedded once per forward by the model
(``XLNetModel.relative_positional_encoding``); the site of the ``distance`` methods."""

from __future__ import annotations

from torch import nn

from rope_ext.installers.base import Sites
from rope_ext.installers.distances import DistanceSite
from rope_ext.families.base import OwnerFamily, register_family


class XLNetFamily(OwnerFamily):
    name = "xlnet"
    site_kinds = frozenset({DistanceSite.kind})
    causal = False  # (without a permutation mask its attention sees both ways)
    owner_module = "transformers.models.xlnet.modeling_xlnet"
    owner_class = "XLNetModel"

    def locate(self, model: nn.Module) -> Sites:
        owner = self.owner(model)
        config = self.whole_model_config(model)
        return Sites(config, {DistanceSite.kind: [DistanceSite(self.name, owner)]}, model)


register_family(XLNetFamily())
