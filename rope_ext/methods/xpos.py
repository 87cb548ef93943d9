"""xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer", arXiv:2212.10554; microsoft/torchscale
``torchscale/component/xpos_relative_position.py``): RoPE whose rotary pair ``i`` of ``r/2`` also decays with the
distance. The query at position ``m`` is scaled by ``zeta_i^(m/B)`` and the key at ``n`` by ``zeta_i^(-n/B)``, so
pair ``i`` of the score carries ``zeta_i^((m - n)/B)``:

    zeta_i = (2i/r + gamma) / (1 + gamma),  i = 0 .. r/2 - 1,  gamma = 0.4,  B = 512 (the scale base).

The reference pairs adjacent dims (``rotate_every_two``); rope_ext applies it in the model's own layout (HF's
``rotate_half``: pair ``i`` is dims ``i`` and ``i + r/2``), pair ``i`` with frequency ``theta_i`` and scale
``zeta_i`` as in the reference. ``zeta^(m/B)`` overflows at long lengths (``zeta_0^(-n/B)`` is ``3.5^(n/512)``), so
the fast path scales relative to each query block's first position, blocks short enough that no factor passes
``e^8`` (``safe_block``: 6.4 B tokens for the default gamma; ``rope_ext.attention.pair_scale``); the plain
reference multiplies each pair's score by ``zeta^((m - n)/B)`` directly. Meant for training from scratch (a
pretrained RoPE model has not learned the decay).

Pure math: imports torch, never transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.methods.base import HOOK_PAIR_SCALE, MethodConfig, register_method
from rope_ext.methods.options import option, positive


def xpos_zeta(rotary_dim: int, gamma: float = 0.4) -> torch.Tensor:
    """``zeta_i = (2i/r + gamma)/(1 + gamma)`` for the ``r/2`` rotary pairs (float64)."""
    pairs = torch.arange(0, rotary_dim, 2, dtype=torch.float64)
    return (pairs + gamma * rotary_dim) / ((1 + gamma) * rotary_dim)


@register_method
@dataclass(frozen=True)
class XposConfig(MethodConfig):
    """xPos (Sun et al. 2022, arXiv:2212.10554), RoPE whose rotary pair ``i`` also decays with the distance, as
    ``zeta_i^((m - n)/scale_base)`` (``gamma`` 0.4, ``scale_base`` 512: torchscale's defaults)."""

    method: ClassVar[str] = "xpos"
    hook: ClassVar[str] = HOOK_PAIR_SCALE
    summary: ClassVar[str] = (
        "xPos (Sun et al. 2022, arXiv:2212.10554), RoPE whose rotary pair ``i`` also decays with the distance, as "
        "``zeta_i^((m - n)/scale_base)``; meant for training from scratch."
    )

    gamma: float = option(
        0.4, positive(),
        meaning="``gamma`` in the decay bases ``zeta_i = (2i/r + gamma) / (1 + gamma)``: a larger gamma brings them "
                "nearer 1, a slower decay (torchscale's 0.4)")
    scale_base: float = option(
        512.0, positive(),
        meaning="``B``: pair ``i`` of a score carries ``zeta_i^((m - n)/B)``, so a larger B decays more slowly "
                "(torchscale's 512)")

    def zeta(self, rotary_dim: int) -> torch.Tensor:
        return xpos_zeta(rotary_dim, self.gamma)

    def safe_block(self, rotary_dim: int, exponent: float = 8.0) -> int:
        """The longest query block whose factors stay within ``e^+-exponent`` (``zeta^(+-block/B)`` for the smallest
        ``zeta``): queries and keys scaled relative to a block's start neither overflow nor lose their digits, in
        float16 too (``e^8`` is about 3,000)."""
        smallest = float(self.zeta(rotary_dim).min())
        return max(1, int(exponent * self.scale_base / -math.log(smallest)))

    def factors(self, offsets: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """``zeta^(offsets / B)`` -> ``[*offsets.shape, r/2]`` (float32; ``offsets`` small: relative to a block)."""
        zeta = self.zeta(rotary_dim).to(offsets.device)
        return torch.pow(zeta, offsets.to(torch.float64)[..., None] / self.scale_base).float()
