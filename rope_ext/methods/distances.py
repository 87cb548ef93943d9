"""XLNet's relative positions (Transformer-XL's sinusoids of the distance) read past the trained distances.

XLNet (Yang et al. 2019) embeds each relative distance ``d`` (from ``klen`` down to ``-qlen``) as Transformer-XL's
sinusoid ``[sin(d w), cos(d w)]``, ``w_k = 10000^(-2k/d_model)``, projected per layer with two learned biases
(``r_w_bias``, ``r_r_bias``); the sinusoid itself has no table and takes any distance, but a model trained at ``N``
tokens has never seen distances past ``N``. Its own ``clamp_len`` (config; ``-1``: none) clamps them.

* ``xlnet_interp`` -- relative-position interpolation: the distances divided by ``factor`` before the sinusoid
  (PI's idea on XLNet's positions; rope_ext's own, no paper proposes it for XLNet), so ``factor x N`` tokens see
  distances up to ``N``.
* ``xlnet_clamp`` -- every distance beyond ``clamp_len`` read as ``clamp_len`` (XLNet's own option, set on a loaded
  model): nearby tokens keep their exact distances, far ones look ``clamp_len`` away.

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import HOOK_DISTANCE, MethodConfig, register_method
from rope_ext.methods.options import factor_range, integer, option


class DistanceConfig(MethodConfig):
    """Base of the methods on XLNet's distances (hook kind ``distance``): ``distances(d)`` is what the sinusoid
    reads before ``clamp(own)`` clamps it (``own``: the model's ``clamp_len``); ``config_values()`` are the model
    config's own fields the method sets (saved, so a plain reload does the same)."""

    hook: ClassVar[str] = HOOK_DISTANCE

    def distances(self, distance: torch.Tensor) -> torch.Tensor:
        return distance

    def clamp(self, own: int) -> int:
        return own

    def config_values(self) -> dict[str, int]:
        return {}


@register_method
@dataclass(frozen=True)
class XlnetInterpConfig(DistanceConfig):
    """XLNet's distances divided by ``factor`` before the sinusoid."""

    method: ClassVar[str] = "xlnet_interp"
    summary: ClassVar[str] = (
        "XLNet's relative distances (Yang et al. 2019) divided by factor before its sinusoid (PI's idea on XLNet, "
        "rope_ext's own), so ``factor x N`` tokens see distances up to ``N``."
    )
    required_options: ClassVar[frozenset[str]] = frozenset({"factor"})

    factor: float | None = option(
        None, factor_range("the distances are divided by it", "shrink the distances it covers"),
        meaning="the distances are divided by it before the sinusoid (1: the trained distances)")

    def distances(self, distance):
        return distance / float(self.factor)


@register_method
@dataclass(frozen=True)
class XlnetClampConfig(DistanceConfig):
    """XLNet's distances clamped at ``clamp_len`` (its own ``clamp_len``, set on a loaded model)."""

    method: ClassVar[str] = "xlnet_clamp"
    summary: ClassVar[str] = (
        "XLNet's relative distances (Yang et al. 2019) clamped at clamp_len, its own option set on a loaded model: "
        "nearby tokens keep their exact distances, far ones look clamp_len away."
    )

    clamp_len: int | None = option(
        None, integer(1, hint="the longest distance kept, e.g. xlnet_clamp:clamp_len=512"),
        meaning="the longest distance kept: every distance beyond it is read as clamp_len (written to the model "
                "config's clamp_len)")

    def clamp(self, own):
        return self.clamp_len

    def config_values(self):
        return {"clamp_len": self.clamp_len}
