"""The hook kind ``wrapper``: a term around the whole attention call of every full-attention layer (S2-Attn).

Its configs come last in a combination (``HOOK_ORDER``), so this installer sees the terms the others added. S2-Attn
regroups the tokens, so it runs only where the kernel needs no positions: alone (plain RoPE, applied by the model
before attention), after a frequency method, or beside an absolute table (read at the embeddings, before any
attention: ``abs_interp+s2_attn`` on GPT-2), not beside a position rule (attention methods, ``cache_consistent``
dynamic methods) or a query scale (``logn``). Sliding-window layers are left without the term: S2-Attn groups full
attention (LongLoRA's target), a sliding layer is local already. NoPE layers take it (the groups need no positions).
"""

from __future__ import annotations

from rope_ext.attention.shifted import ShiftedGroups
from rope_ext.installers.attention import AttentionSite, program_setup
from rope_ext.installers.base import HookInstaller, PlanBuilder, register_hook
from rope_ext.installers.combination import ROTATES_IN_ATTENTION
from rope_ext.methods import (
    HOOK_BIAS,
    HOOK_PAIR_SCALE,
    HOOK_POSITION_RULE,
    HOOK_QUERY_SCALE,
    HOOK_WRAPPER,
    MethodConfig,
    S2AttnConfig,
)

#: why S2-Attn does not combine with what needs the tokens' positions inside attention
_NEEDS_POSITIONS = "{method}'s groups lose the tokens' positions, which {other} needs inside attention"


class WrapperInstaller(HookInstaller):
    """Shifted sparse attention: a ``ShiftedGroups`` term in every full-attention layer's program."""

    kind = HOOK_WRAPPER
    site_kinds = frozenset({AttentionSite.kind})
    conflicts = dict.fromkeys((HOOK_POSITION_RULE, HOOK_QUERY_SCALE, HOOK_PAIR_SCALE, HOOK_BIAS), _NEEDS_POSITIONS) | {
        ROTATES_IN_ATTENTION: "{method}'s groups lose the tokens' positions, which {other} needs to rotate queries and "
                              "keys there; with cache_consistent=false a frequency method rotates them before attention",
    }

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, S2AttnConfig)
        setup = program_setup(builder, method.method)
        added = 0
        for layer, program in setup.programs:
            if layer.sliding_window is not None:
                continue  # local already: S2-Attn groups full attention
            program.add(ShiftedGroups(method))
            added += 1
        if not added:
            raise ValueError(
                f"{setup.site.family}: every layer of this model uses sliding-window attention; {method.method} "
                "applies to full-attention layers"
            )


register_hook(WrapperInstaller())
