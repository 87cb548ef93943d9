"""Which methods combine: the rules of a combination, checked in one place.

Each hook installer declares what its methods cannot be combined with (``HookInstaller.conflicts``): hook kinds,
or *traits* a method may have whatever its kind (``ROTATES_IN_ATTENTION``: its installer moves the rotation of
queries and keys into attention, ``HookInstaller.rotates_in_attention``, or a frequency method with
``cache_consistent``), each with the reason. ``PlanBuilder.install`` runs ``refuse_conflicts`` before any installer
plans: a pair is refused when either side declares the other's kind or one of its traits, with one line naming
the pair, why, and what the declaring method combines with on this model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from rope_ext.methods import MethodConfig, methods_with_hooks

#: the trait of a method that rotates queries and keys inside attention (a key of ``HookInstaller.conflicts``)
ROTATES_IN_ATTENTION = "rotates_in_attention"
#: how a refusal names what a trait is
TRAITS = {ROTATES_IN_ATTENTION: "it rotates queries and keys inside attention"}


class Declares(Protocol):
    """What the rules read of a hook installer (``HookInstaller``)."""

    kind: str
    conflicts: Mapping[str, str]
    rotates_in_attention: bool

    def traits(self, method: MethodConfig) -> frozenset[str]: ...


def refuse_conflicts(
    methods: Sequence[tuple[MethodConfig, Declares]], provided: Iterable[Declares]
) -> None:
    """Raise ``ValueError`` naming the first pair of ``methods`` (each with its installer, in the combination's order)
    that one of them declares it cannot be combined with; ``provided``: the installers this model's sites serve (what
    the refused method combines with is listed among them)."""
    for method, installer in methods:
        for other, other_installer in methods:
            if other is method:
                continue
            traits = other_installer.traits(other)
            key = next((k for k in [other.hook, *sorted(traits - {other.hook})] if k in installer.conflicts), None)
            if key is None:
                continue
            what = f"{key!r} methods: {', '.join(methods_with_hooks(key))}" if key == other.hook else TRAITS.get(key, key)
            reason = installer.conflicts[key].format(method=method.method, other=other.method)
            raise ValueError(
                f"{method.method} cannot be combined with {other.method} ({what}): {reason}; {method.method} combines "
                f"with {partners(method, installer, provided)}"
            )


def partners(method: MethodConfig, installer: Declares, provided: Iterable[Declares]) -> str:
    """The methods of the other kinds in ``provided`` that neither side refuses beside ``method``."""
    traits = installer.traits(method)
    kinds = sorted(
        other.kind for other in provided
        if other.kind != installer.kind and not kind_traits(other) & installer.conflicts.keys()
        and not traits & other.conflicts.keys()
    )
    named = [f"{kind!r} methods ({', '.join(names)})" for kind in kinds if (names := methods_with_hooks(kind))]
    return " and ".join(named) or "nothing on this model"


def kind_traits(installer: Declares) -> frozenset[str]:
    """What every method of ``installer``'s kind is."""
    return frozenset({installer.kind, ROTATES_IN_ATTENTION} if installer.rotates_in_attention else {installer.kind})
