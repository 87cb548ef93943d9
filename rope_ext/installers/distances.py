"""The distance site (XLNet's model, which embeds relative distances as sinusoids) and the hook kind ``distance``.

``XLNetModel.relative_positional_encoding`` builds the distances of a forward (``klen .. -qlen``, both directions
with ``bi_data``), clamps them at the model's ``clamp_len`` and embeds them with ``positional_embedding(pos_seq,
inv_freq, bsz)``. The installer sets ``positional_embedding`` on the model to a ``ScaledDistances`` (the same
sinusoid at the method's distances, then clamped: at ``xlnet_clamp``'s ``clamp_len``, else at the model's own if it has
one) and the model's ``clamp_len`` to -1: attributes of the instance, put back by ``unpatch``; the weights are
untouched. ``xlnet_clamp`` also writes its ``clamp_len`` into the config (transformers' own field, so a plain
``from_pretrained`` of a saved model clamps too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from rope_ext.installers.base import HookInstaller, PlanBuilder, RopeExtCallable, Site, register_hook
from rope_ext.methods import HOOK_DISTANCE, DistanceConfig, MethodConfig


@dataclass(eq=False)
class DistanceSite(Site):
    """A model that embeds relative distances with ``positional_embedding`` after clamping at ``clamp_len``."""

    kind: ClassVar[str] = "distance"

    family: str
    model: nn.Module


@dataclass(eq=False)
class ScaledDistances(RopeExtCallable):
    """``positional_embedding`` at the method's distances: ``embed(method.distances(pos_seq), inv_freq, bsz)``."""

    embed: Any  # the class's own static function
    method: DistanceConfig
    #: the clamp applied after the method (the method's, else the model's own ``clamp_len``; ``<= 0``: none)
    clamp: int = -1

    def __call__(self, pos_seq: torch.Tensor, inv_freq: torch.Tensor, bsz: int | None = None) -> torch.Tensor:
        distances = self.method.distances(pos_seq)
        if self.clamp > 0:
            distances = distances.clamp(-self.clamp, self.clamp)
        return self.embed(distances, inv_freq, bsz)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v:g}" for k, v in self.method.to_dict().items() if k != "method")
        return f"{self.method.method}({options}) distances"


class DistanceInstaller(HookInstaller):
    """XLNet's distances through the method: ``positional_embedding`` replaced, the clamp moved into it."""

    kind = HOOK_DISTANCE
    site_kinds = frozenset({DistanceSite.kind})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, DistanceConfig)
        for site in builder.sites.get(DistanceSite.kind):
            for name, value in method.config_values().items():  # (transformers' own fields: saved with the model)
                builder.edit_config(builder.sites.config, name, value)
            embed = type(site.model).positional_embedding  # (a staticmethod: the plain function)
            # the clamp moves after the method: it clamps the distances the sinusoid reads
            clamp = method.clamp(site.model.clamp_len)
            builder.edit(site.model, "positional_embedding", ScaledDistances(embed, method, clamp))
            builder.edit(site.model, "clamp_len", -1)


register_hook(DistanceInstaller())
