"""The hook kind ``wrapper``: a term around the whole attention call of every full-attention layer (S2-Attn).

Its configs come last in a combination (``HOOK_ORDER``), so this installer sees the terms the others added. S2-Attn
regroups the tokens, so it runs only where the kernel needs no positions: alone (plain RoPE, applied by the model
before attention) or after a frequency method, not beside a position rule (attention methods, ``cache_consistent``
dynamic methods) or a query scale (``logn``). Sliding-window layers are left without the term: S2-Attn groups full
attention (LongLoRA's target), a sliding layer is local already. NoPE layers take it (the groups need no positions).
"""

from __future__ import annotations

from rope_ext.attention.program import PositionRule
from rope_ext.attention.shifted import ShiftedGroups
from rope_ext.installers.attention import AttentionSite, program_setup
from rope_ext.installers.base import HookInstaller, PlanBuilder, register_hook
from rope_ext.methods import HOOK_FREQUENCY, HOOK_WRAPPER, MethodConfig, S2AttnConfig, methods_with_hooks


def _methods_of(kind: str) -> str:
    return ", ".join(methods_with_hooks(kind))


class WrapperInstaller(HookInstaller):
    """Shifted sparse attention: a ``ShiftedGroups`` term in every full-attention layer's program."""

    kind = HOOK_WRAPPER
    site_kinds = frozenset({AttentionSite.kind})

    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        assert isinstance(method, S2AttnConfig)
        combines = f"it combines with the frequency methods ({_methods_of(HOOK_FREQUENCY)}) or runs alone"
        others = sorted(builder.kinds - {HOOK_FREQUENCY, HOOK_WRAPPER})
        if others:
            named = " or ".join(f"{kind!r} methods ({_methods_of(kind) or 'none registered'})" for kind in others)
            raise ValueError(
                f"{method.method} cannot be combined with {named}: its groups lose the tokens' positions, which those "
                f"need inside attention; {combines}"
            )
        setup = program_setup(builder, method.method)
        if any(program.of_type(PositionRule) for _, program in setup.programs):
            raise ValueError(
                f"{method.method} cannot be combined with a frequency method that rotates queries and keys inside "
                "attention (cache_consistent=true): its groups lose the tokens' positions; use cache_consistent=false"
            )
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
