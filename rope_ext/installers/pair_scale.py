"""The hook kind ``pair_scale``: xPos, RoPE whose rotary pairs also decay with the distance.

The rotation moves into attention (``rotate_in_attention``: the rotary module returns the identity, each
full-attention layer rotates with the frequencies a frequency method gives, or the checkpoint's own), and a
``PairScale`` term scales queries and keys per pair there (``rope_ext.attention.rules.run_pair_scale``). It combines
with the frequency methods (their frequencies, xPos's decay) and ``logn``; not with attention rewrites (their
remapped positions) nor with biases (another position encoding).
"""

from __future__ import annotations

from rope_ext.attention.program import PairScale
from rope_ext.installers.attention import AttentionSite
from rope_ext.installers.base import HookInstaller, PlanBuilder, register_hook
from rope_ext.installers.rotary import RotarySite
from rope_ext.installers.rotation import rotate_in_attention
from rope_ext.methods import HOOK_PAIR_SCALE, HOOK_POSITION_RULE, MethodConfig, XposConfig


class PairScaleInstaller(HookInstaller):
    """xPos: a ``PairScale`` in every full-attention layer whose rotation moved into attention."""

    kind = HOOK_PAIR_SCALE
    site_kinds = frozenset({RotarySite.kind, AttentionSite.kind})
    rotates_in_attention = True
    conflicts = {HOOK_POSITION_RULE: "{method} scales plain RoPE, and {other} remaps the positions"}

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, XposConfig)
        rotation = rotate_in_attention(builder, method.method)
        for _layer, program, term in rotation.full:
            program.add(PairScale(method, rotation.rotary.specs[term.layer_type].dim))


register_hook(PairScaleInstaller())
