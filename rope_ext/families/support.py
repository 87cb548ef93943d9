"""Support: the hook kinds and methods a family takes for one model type, and why it refuses the others.

One predicate, read by ``patch`` (before it touches the model), by ``FamilyAdapter.hooks`` and ``.methods`` (what
``rope-ext families`` lists) and by the families table of the docs (``rope_ext.families.support_table``). It
combines, for a family and one of its model types:

* the site kinds the family provides: a hook kind is supported when its installer needs only those
  (``hook_kinds_for``); a family whose attention does not run transformers' ``AttentionInterface`` (Falcon) has
  no attention site;
* each installer's ``refusal`` of a method on those site kinds (T5's bucket sites take biases of the distance only);
* what the family's code refuses for the model type (``Refusals``, read once by the family's probes): a site no
  hook kind may use (Gemma 2's config class caps attention logits) and a rotation that cannot move into attention
  (GLM-4's pair layout, HunYuan's norm after RoPE), which the kinds that rotate in attention need.

What depends on one checkpoint's config rather than on its class (every layer sliding, DeBERTa's absolute table,
softcapping switched on in a Gemma 3 config, a cache_consistent option) is refused by ``locate`` and the installers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from rope_ext.installers.base import HookInstaller, get_hook, hook_kinds_for
from rope_ext.methods import get_method_class, list_methods


@dataclass(frozen=True)
class Refusals:
    """What a family's code refuses for one model type, whatever the checkpoint."""

    #: site kind -> why no hook kind may use it (softcapped attention: ``"attention"``)
    sites: Mapping[str, str] = field(default_factory=dict)
    #: why queries and keys cannot be rotated at attention time (``None``: they can)
    rotation: str | None = None

    def of(self, installer: HookInstaller, site_kinds: frozenset[str]) -> str | None:
        """Why ``installer``'s kind is refused on a family with these site kinds (``None``: it is not)."""
        options = (installer.site_kinds, *installer.alternative_site_kinds)
        needed = next((kinds for kinds in options if kinds <= site_kinds), frozenset())
        refused = [self.sites[kind] for kind in sorted(needed) if kind in self.sites]
        if refused:
            return refused[0]
        return self.rotation if installer.rotates_in_attention else None


@dataclass(frozen=True)
class Support:
    """What one family supports for some of its model types: the hook kinds, the registered methods that fit, and
    why each other registered method is refused."""

    family: str
    #: the model types this holds for
    model_types: tuple[str, ...]
    #: the hook kinds supported (their installer's sites provided, and no refusal of the family's code)
    kinds: frozenset[str]
    #: the registered methods that fit, sorted
    methods: tuple[str, ...]
    #: every other registered method -> why (a clause: "its attention caps logits ...")
    refused: Mapping[str, str]
    #: the hook kinds whose installer's sites the family provides (``kinds`` and the kinds its code refuses)
    provided: frozenset[str]
    #: how messages name it: the family, and the model types where the family's model types differ
    label: str

    def fits(self, method: str) -> bool:
        return method in self.methods

    def reason(self, method: str) -> str | None:
        """The one-line refusal of ``method`` (what ``patch`` raises), ``None`` if it fits or is not registered."""
        why = self.refused.get(method)
        if why is None:
            return None
        fitting = f"methods for {self.label}: {', '.join(self.methods) or 'none'}"
        if get_method_class(method).hook not in self.provided:
            return f"method {method!r} {why}; {fitting}"
        return f"method {method!r} does not fit {self.label}: {why}; {fitting}"

    def check(self, method: str, hook: str | None = None) -> None:
        """Raise ``ValueError`` (the reason and the methods that fit) when ``method`` is refused; a method that is
        not registered is judged by its hook kind alone."""
        message = self.reason(method)
        if message is None and method not in self.methods and hook is not None and hook not in self.kinds:
            fitting = ", ".join(self.methods) or "none"
            message = f"method {method!r} {_lacking(hook, self.family)}; methods for {self.label}: {fitting}"
        if message is not None:
            raise ValueError(message)

    def same_as(self, other: Support) -> bool:
        return (self.kinds, self.methods, dict(self.refused)) == (other.kinds, other.methods, dict(other.refused))


def _lacking(hook: str, family: str) -> str:
    article = "an" if hook[:1] in "aeiou" else "a"
    return f"needs {article} {hook!r} hook, which family {family!r} does not support"


def support_for(family: str, site_kinds: frozenset[str], refusals: Refusals, model_type: str) -> Support:
    """The support of a family with these site kinds and refusals, for one model type (the registries as they are
    now: a method or hook kind registered later is counted)."""
    provided = hook_kinds_for(site_kinds)
    kind_refused = {kind: refusals.of(get_hook(kind), site_kinds) for kind in provided}
    methods, refused = [], {}
    for name in list_methods():
        method_class = get_method_class(name)
        hook = method_class.hook
        if hook not in provided:
            refused[name] = _lacking(hook, family)
        elif (why := kind_refused[hook] or get_hook(hook).refusal(method_class, site_kinds)) is not None:
            refused[name] = why
        else:
            methods.append(name)
    kinds = frozenset(kind for kind, why in kind_refused.items() if why is None)
    return Support(family, (model_type,), kinds, tuple(methods), refused, provided, f"{family} ({model_type})")


def merged(family: str, supports: list[Support]) -> Support:
    """What every one of ``supports`` (one family's, for its model types) supports: the kinds and methods they all
    take; a method any refuses, with the first reason."""
    first = supports[0]
    methods = tuple(m for m in first.methods if all(s.fits(m) for s in supports))
    refused: dict[str, str] = {}
    for support in supports:
        for name, why in support.refused.items():
            refused.setdefault(name, why)
    refused = {name: refused[name] for name in sorted(refused)}
    return Support(
        family, tuple(t for s in supports for t in s.model_types), frozenset.intersection(*(s.kinds for s in supports)),
        methods, refused, frozenset.intersection(*(s.provided for s in supports)), family,
    )


def grouped(family: str, supports: list[Support]) -> list[Support]:
    """One family's supports by model type, the model types that agree merged into one (named by the family alone
    when all agree)."""
    groups: list[list[Support]] = []
    for support in supports:
        group = next((g for g in groups if g[0].same_as(support)), None)
        if group is None:
            groups.append([support])
        else:
            group.append(support)
    if len(groups) == 1:
        return [merged(family, groups[0])]
    return [replace(merged(family, g), label=f"{family} ({', '.join(t for s in g for t in s.model_types)})")
            for g in groups]


def model_type_of(of: Any) -> str | None:
    """The model type of a model, model class, config or config class (class-level: a model's class says it)."""
    if isinstance(of, str):
        return of
    instance = of if isinstance(of, nn.Module) else None
    if instance is not None:
        of = type(of)
    config = getattr(of, "config_class", None) or of
    found = getattr(config, "model_type", None)
    if not found and instance is not None:
        found = getattr(getattr(instance, "config", None), "model_type", None)
    return found if isinstance(found, str) and found else None


def model_types_of(module_path: str) -> tuple[str, ...]:
    """The model types whose modeling code is the package of ``transformers.models.<package>.<module>``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    package = module_path.split(".")[2]
    return tuple(sorted(t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) == package))


def config_class_of(model_type: str) -> type | None:
    """transformers' config class of ``model_type`` (``None`` if it has none)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except (KeyError, ImportError, ValueError):
        return None
