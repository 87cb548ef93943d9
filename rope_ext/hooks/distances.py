"""The distance site (XLNet's model, which embeds relative distances as sinusoids) and the hook kind ``distance``.

``XLNetModel.relative_positional_encoding`` builds the distances of a forward (``klen .. -qlen``, both directions
with ``bi_data``), clamps them at the model's ``clamp_len`` and embeds them with ``positional_embedding(pos_seq,
inv_freq, bsz)``. The installer sets ``positional_embedding`` on the model to a ``ScaledDistances`` (the same
sinusoid at the method's distances, clamped after at the model's own ``clamp_len`` if it has one), or ``clamp_len``
to the method's: attributes of the instance, put back by ``unpatch``; the weights are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from rope_ext.hooks.base import HookInstaller, PlanBuilder, RopeExtCallable, Site, register_hook
from rope_ext.methods import HOOK_DISTANCE, DistanceConfig, MethodConfig, XlnetClampConfig


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
    #: the model's own ``clamp_len``, applied here after the method (``<= 0``: none)
    clamp: int = -1

    def __call__(self, pos_seq: torch.Tensor, inv_freq: torch.Tensor, bsz: int | None = None) -> torch.Tensor:
        distances = self.method.distances(pos_seq)
        if self.clamp > 0:
            distances = distances.clamp(-self.clamp, self.clamp)
        return self.embed(distances, inv_freq, bsz)

    def __repr__(self) -> str:
        return f"{self.method.method}(factor={self.method.factor:g}) distances"


class DistanceInstaller(HookInstaller):
    """XLNet's distances through the method: ``clamp_len`` set, or ``positional_embedding`` replaced."""

    kind = HOOK_DISTANCE
    site_kinds = frozenset({DistanceSite.kind})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, DistanceConfig)
        for site in builder.sites.get(DistanceSite.kind):
            if isinstance(method, XlnetClampConfig):
                builder.edit(site.model, "clamp_len", method.clamp_len)
            else:
                embed = type(site.model).positional_embedding  # (a staticmethod: the plain function)
                # (the model's own clamp moves after the method: it clamps the distances the sinusoid reads)
                builder.edit(site.model, "positional_embedding", ScaledDistances(embed, method, site.model.clamp_len))
                builder.edit(site.model, "clamp_len", -1)


register_hook(DistanceInstaller())
