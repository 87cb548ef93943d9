"""The rotation moved into attention, for the hook kinds that rotate there (position rules, xPos, the
cache-consistent dynamic methods): the rotary replacement returns the identity for the chosen layer types, and each
attention program rotates its queries and keys (a ``PositionRule``, plain RoPE until a method sets its rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from rope_ext.attention.program import AttentionProgram, PositionRule
from rope_ext.installers.attention import AttentionLayer, program_setup
from rope_ext.installers.base import PlanBuilder
from rope_ext.installers.rotary import RopeExtRotaryEmbedding, RotarySite
from rope_ext.methods import HOOK_FREQUENCY


@dataclass(eq=False)
class AttentionRotation:
    """The layers whose queries and keys a plan rotates at attention time: the rotary replacement returns the
    identity for their layer types, and each program holds a ``PositionRule`` (plain RoPE until a method sets
    its rule). ``full`` are the full-attention layers (a method's rule goes there); sliding-window layers keep
    plain RoPE, rotated here because one rotary module serves them too."""

    rotary: RopeExtRotaryEmbedding
    full: list[tuple[AttentionLayer, AttentionProgram, PositionRule]]


def rotate_in_attention(builder: PlanBuilder, method_name: str) -> AttentionRotation:
    """Move the rotation of the chosen layer types from the rotary module into the attention programs (once per
    plan) and return the layers a position rule applies to."""
    setup = program_setup(builder, method_name)
    done = builder.memo.get(("rotate_in_attention", id(setup)))
    if done is not None:
        return done
    if setup.site.rotation_refused is not None:
        raise ValueError(
            f"{method_name}: {setup.site.family}: {setup.site.rotation_refused}; methods that rotate in attention "
            "(attention rewrites, cache_consistent dynamic methods) are refused for it, frequency methods and logn work"
        )
    sites = builder.sites.get(RotarySite.kind)
    if len(sites) != 1:
        raise ValueError(f"{method_name}: this model has {len(sites)} rotary embeddings; rope_ext rotates one in attention")
    rotary_site = sites[0]
    rotary = rotary_site.replacement(builder)
    chosen = rotary_site.layer_types(builder.option("layer_types"))
    with_frequency = HOOK_FREQUENCY in builder.kinds
    specs = {}
    for layer_type in chosen:
        rope_type = rotary_site.params(layer_type).get("rope_type", "default")
        if not with_frequency and rope_type in ("dynamic", "longrope"):
            raise ValueError(
                f"{rotary_site.family}: this checkpoint's {rope_type!r} RoPE scaling depends on the sequence length; "
                "an attention method needs fixed frequencies: combine it with a frequency method and "
                "replace_scaling=True (e.g. ['yarn', 'dca'])"
            )
        specs[layer_type] = rotary_site.spec(layer_type, None, True)
    check_chosen_layers(setup.site.family, [layer for layer, _ in setup.programs], specs)
    rotary.set_identity(specs)
    if not with_frequency:
        rotary.set_base(rotary_site, specs)
    full = []
    for layer, program in setup.programs:
        if not layer.rotary:  # NoPE: positions never reach it
            continue
        if layer.layer_type in specs or None in specs:
            key = layer.layer_type if layer.layer_type in specs else None  # one rotary embedding serves every layer
            term = PositionRule(
                None, rotary, key, rotary.specs[key].original_max_position_embeddings,
                rotary_site.native_length(key),
            )
            program.add(term)
            if layer.sliding_window is None:
                full.append((layer, program, term))
    if not full:
        raise ValueError(no_layer_to_rewrite(setup.site.family, [layer for layer, _ in setup.programs]))
    done = AttentionRotation(rotary, full)
    builder.memo[("rotate_in_attention", id(setup))] = done
    return done


def check_chosen_layers(family: str, layers: list[AttentionLayer], chosen) -> None:
    """Layer types the user (or the default) chose must not be sliding-window ones."""
    if None in chosen:
        return
    sliding = sorted({l.layer_type for l in layers if l.layer_type in chosen and l.sliding_window is not None}, key=str)
    if sliding:
        full = sorted({l.layer_type for l in layers if l.sliding_window is None and l.rotary}, key=str)
        if not full:  # (the full-attention layers have no positions: Beam's, EXAONE 4's hybrid)
            raise ValueError(no_layer_to_rewrite(family, layers))
        raise ValueError(
            f"{family}: layer types {sliding} use sliding-window attention, which attention methods do not rewrite; "
            f"choose layer_types among the full-attention ones: {full}"
        )


def no_layer_to_rewrite(family: str, layers: list[AttentionLayer]) -> str:
    no_rope = sum(1 for layer in layers if not layer.rotary)
    if no_rope == len(layers):
        return f"{family}: all {no_rope} of its layers use no positional encoding (NoPE): no layer to rewrite"
    if no_rope:
        return (
            f"{family}: {no_rope} of its {len(layers)} layers use no positional encoding (NoPE) and the others "
            "sliding-window attention, which attention methods leave alone: no layer to rewrite"
        )
    return (
        f"{family}: every layer of this model uses sliding-window attention; attention methods apply to "
        "full-attention layers"
    )
