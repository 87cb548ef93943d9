"""Hook installers and the undo log they write.

A *site* is a place where a model keeps part of its position encoding: the shared rotary module, the
attention modules and their implementation, a bias module, an absolute table. Family adapters
(``rope_ext.families``) locate a model's sites; a *hook installer*, one per hook kind, turns those sites
plus a method config into edits. Several installers may configure one site (frequency and attention
hooks share the rotary module): a site's replacement object is built once per plan and handed to each.

``PlanBuilder`` collects every edit first, touching nothing; ``PatchPlan.apply`` then makes them (rolling
back if anything fails) and ``PatchPlan.revert`` puts every original object and value back, so
``unpatch`` is exact. The model mirrors peft: a method-config registry, an installer per kind, a
per-architecture table of locators.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from rope_ext.installers.combination import kind_traits, refuse_conflicts
from rope_ext.methods import HOOK_POSITION_RULE, MethodConfig
from rope_ext.registry import Registry


class _Missing:
    """The marker of an attribute an edit found absent; one object even through ``copy.deepcopy`` and pickle."""

    def __reduce__(self) -> str:
        return "_MISSING"  # pickled (and deep-copied) by reference to this module's singleton

    def __repr__(self) -> str:
        return "<absent>"


_MISSING = _Missing()


def instance_attribute(obj: Any, name: str) -> Any:
    """``obj``'s own value for ``name`` (a submodule or buffer counts), ignoring class-level defaults."""
    if isinstance(obj, nn.Module):
        for table in (obj._modules, obj._buffers, obj._parameters):
            if name in table:
                return table[name]
    return vars(obj).get(name, _MISSING)


def _same_value(current: Any, new: Any) -> bool:
    if current is new:
        return True
    if isinstance(new, (nn.Module, torch.Tensor)) or callable(new):
        return False  # (objects: the very one the patch set)
    try:
        return bool(current == new)
    except Exception:  # noqa: BLE001  (a value that cannot be compared is not the same)
        return False


def _describe_value(value: Any, other: Any = None) -> str:
    if isinstance(value, dict) and isinstance(other, dict):  # (the keys that differ from ``other``'s, not the whole)
        value = {k: value.get(k, "absent") for k in sorted({*value, *other}, key=str) if value.get(k) != other.get(k)}
    if value is _MISSING:
        return "absent"
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class AttrEdit:
    """Set ``obj.name = new``; remembers the old value (or its absence) for ``revert``, which first checks that
    the attribute still holds what the patch set (``changed``)."""

    obj: Any
    name: str
    new: Any
    old: Any = field(default=_MISSING, init=False)
    #: a copy of a container value as set (a dict edited in place afterwards is still the same object)
    applied: Any = field(default=_MISSING, init=False, repr=False)

    def apply(self) -> None:
        self.old = instance_attribute(self.obj, self.name)
        setattr(self.obj, self.name, self.new)
        if isinstance(self.new, (dict, list, set)):
            self.applied = copy.deepcopy(self.new)

    def changed(self) -> str | None:
        """What was done to the attribute since the patch set it (``None``: nothing)."""
        current = instance_attribute(self.obj, self.name)
        if current is self.new and self.applied is not _MISSING and current != self.applied:
            return (
                f"{type(self.obj).__name__}.{self.name} was edited in place since the patch set it "
                f"(now {_describe_value(current, self.applied)}, set as {_describe_value(self.applied, current)})"
            )
        if _same_value(current, self.new):
            return None
        return (
            f"{type(self.obj).__name__}.{self.name} is {_describe_value(current)}, not the "
            f"{_describe_value(self.new)} the patch set"
        )

    def revert(self) -> None:
        if self.old is _MISSING:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.old)


@dataclass
class ForwardPreHookEdit:
    """Register ``hook`` as a forward pre-hook of ``module`` (with the call's keyword arguments); ``revert``
    removes it. The handle survives ``copy.deepcopy`` and pickle of the model together with its plan."""

    obj: nn.Module
    hook: Callable[..., Any]
    handle: Any = field(default=None, init=False)

    def apply(self) -> None:
        self.handle = self.obj.register_forward_pre_hook(self.hook, with_kwargs=True)

    def changed(self) -> str | None:
        if self.handle is not None and self.handle.id in self.obj._forward_pre_hooks:
            return None
        return f"the forward pre-hook rope_ext registered on {type(self.obj).__name__} was removed"

    def revert(self) -> None:
        self.handle.remove()
        self.handle = None


@dataclass
class AttnImplementationEdit:
    """Set the attention implementation of ``model`` (a transformers model) to ``new`` through its
    ``set_attn_implementation`` (transformers checks the key is registered and the model dispatches through the
    attention interface), remembering every config it changed; ``revert`` puts each config's own value back."""

    model: nn.Module
    new: str
    configs: list[Any]
    #: every config the setter may change (the model's modules' and their sub-configs) and its own value before
    old: list[tuple[Any, Any]] = field(default_factory=list, init=False)

    def apply(self) -> None:
        self.old = [(config, instance_attribute(config, "_attn_implementation_internal")) for config in self._reachable()]
        try:
            setter = getattr(self.model, "set_attn_implementation", None)
            if callable(setter):
                setter(self.new)
            for config in self.configs:  # (configs of modules the model's own setter does not reach)
                config._attn_implementation_internal = self.new
        except BaseException:
            self.revert()
            raise

    def _reachable(self) -> list[Any]:
        found: dict[int, Any] = {id(c): c for c in self.configs}
        stack = [m.config for m in self.model.modules() if getattr(m, "config", None) is not None]
        while stack:
            config = stack.pop()
            if id(config) in found or not hasattr(config, "to_dict"):
                continue
            found[id(config)] = config
            stack += [getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {}]
            stack = [c for c in stack if c is not None]
        return list(found.values())

    def changed(self) -> str | None:
        for config in self.configs:
            current = instance_attribute(config, "_attn_implementation_internal")
            if current != self.new:
                return (
                    f"the attention implementation was changed to {current!r} after patching (rope_ext set "
                    f"{self.new!r}); set it back with model.set_attn_implementation({self.new!r}) before unpatching"
                )
        return None

    def revert(self) -> None:
        for config, old in self.old:
            if old is _MISSING:
                vars(config).pop("_attn_implementation_internal", None)
            else:
                config._attn_implementation_internal = old


@dataclass
class PatchPlan:
    edits: list[AttrEdit | ForwardPreHookEdit | AttnImplementationEdit] = field(default_factory=list)

    def apply(self) -> None:
        done: list[AttrEdit] = []
        try:
            for edit in self.edits:
                edit.apply()
                done.append(edit)
        except BaseException:
            for edit in reversed(done):
                edit.revert()
            raise

    def changes(self) -> list[str]:
        """What was changed since the plan was applied, edit by edit (empty: each still holds its value)."""
        return [found for edit in self.edits if (found := edit.changed()) is not None]

    def revert(self) -> None:
        """Put every original object and value back; raises ``RuntimeError`` (changing nothing) when something
        the plan set was changed since, since a blind restore would undo that change."""
        changes = self.changes()
        if changes:
            raise RuntimeError(
                "cannot unpatch exactly: what rope_ext set was changed after patching (" + "; ".join(changes) + "). "
                "Undo those changes first (e.g. unwrap or unload what was added on top of the patched model)"
            )
        for edit in reversed(self.edits):
            edit.revert()


class RopeExtModule(nn.Module):
    """Base of every module rope_ext installs in a model (so a patched part of a model is recognised)."""


class RopeExtCallable:
    """Base of the callables rope_ext sets as a module's attribute in place of one of its methods (T5's
    ``compute_bias``, DeBERTa's ``get_rel_pos``), so a patched part of a model is recognised by them too."""


class Site:
    """One place in a model that hook installers can configure.

    ``kind`` names the site kind (``"rotary"``, ...); ``options`` are the keyword options of ``patch`` that
    configure this kind of site rather than a method (``layer_types`` for the rotary site).
    """

    kind: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}  # option name -> default

    def replacement(self, builder: PlanBuilder) -> Any:
        """The object that replaces this site in the plan (built once, then configured by each installer)."""
        raise NotImplementedError(f"site {self.kind!r} has no replacement object")

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the valid values when a site option given to ``patch`` is not one."""


@dataclass
class Sites:
    """Where one model keeps its position encoding: ``config`` (the model's own, saved with it; a site may
    edit a sub-config of it, such as a multimodal model's ``text_config``) and the sites by kind."""

    config: Any
    by_kind: dict[str, list[Site]] = field(default_factory=dict)
    #: the model the sites belong to (where a patch keeps its state and its parameters); set by ``patch``
    model: nn.Module | None = None

    def get(self, kind: str) -> list[Site]:
        return self.by_kind.get(kind, [])


class PlanBuilder:
    """Collects the edits of one ``patch`` call: installers add edits and configure shared replacements."""

    def __init__(self, sites: Sites, options: dict[str, Any], kinds: frozenset[str]) -> None:
        self.sites = sites
        self.options = options
        #: the hook kinds of the methods in this plan
        self.kinds = kinds
        self.plan = PatchPlan()
        #: the edits of config objects (recorded for reload, checked for sharing between models)
        self.config_edits: list[AttrEdit] = []
        self._replacements: dict[int, Any] = {}
        #: what installers share within one plan (keyed by their own keys), built once
        self.memo: dict[Any, Any] = {}

    def option(self, name: str) -> Any:
        return self.options[name]

    def edit(self, obj: Any, name: str, new: Any) -> None:
        self.plan.edits.append(AttrEdit(obj, name, new))

    def hook_forward(self, module: nn.Module, hook: Callable[..., Any]) -> None:
        """Run ``hook(module, args, kwargs)`` before every forward of ``module`` while patched."""
        self.plan.edits.append(ForwardPreHookEdit(module, hook))

    def edit_config(self, config: Any, name: str, new: Any) -> None:
        """An edit of a model config (or a sub-config of it) that ``save_pretrained`` writes out. A name the config
        class maps to another (``GPT2Config``: ``max_position_embeddings`` is ``n_positions``) edits the one it
        maps to."""
        name = getattr(type(config), "attribute_map", {}).get(name, name)
        self.edit(config, name, new)
        self.config_edits.append(self.plan.edits[-1])

    def pending(self, config: Any, name: str) -> Any:
        """A config attribute as this plan leaves it so far (installers that edit one build on each other's)."""
        name = getattr(type(config), "attribute_map", {}).get(name, name)
        edits = [e.new for e in self.config_edits if e.obj is config and e.name == name]
        return edits[-1] if edits else getattr(config, name, None)

    def set_attn_implementation(self, model: nn.Module, key: str, configs: list[Any]) -> None:
        """Make ``key`` the attention implementation of ``model`` and of ``configs`` (one owner per plan: a second
        call with another key is refused)."""
        owner = next((e for e in self.plan.edits if isinstance(e, AttnImplementationEdit)), None)
        if owner is not None:
            if owner.new != key:
                raise ValueError(f"two hook kinds want their own attention implementation ({owner.new!r} and "
                                 f"{key!r}); one attention program runs every kind's terms")
            return
        self.plan.edits.append(AttnImplementationEdit(model, key, list(configs)))

    def install(self, methods: Sequence[MethodConfig]) -> None:
        """Have each method's installer add its edits, once the combination's rules hold (``refuse_conflicts``)."""
        installers = [(method, get_hook(method.hook)) for method in methods]
        refuse_conflicts(installers, [get_hook(kind) for kind in hook_kinds_for(frozenset(self.sites.by_kind))])
        for method, installer in installers:
            installer.plan(self, method)

    def replacement(self, site: Site, build: Callable[[], tuple[Any, str, Any]]) -> Any:
        """The replacement object of ``site``; ``build() -> (parent, attribute, object)`` runs on first use."""
        key = id(site)
        if key not in self._replacements:
            parent, name, new = build()
            if parent is not None:  # a replacement that is not itself set on the model (it edits other objects)
                self.edit(parent, name, new)
            self._replacements[key] = new
        return self._replacements[key]


class HookInstaller(ABC):
    """Installs one hook kind: reads the sites of ``site_kinds`` and adds edits for a method config."""

    kind: ClassVar[str]
    #: the site kinds this installer needs; a family supports the kind when it provides them all
    site_kinds: ClassVar[frozenset[str]]
    #: other sets of site kinds it can work from instead (the bias kind: T5's bucket sites)
    alternative_site_kinds: ClassVar[tuple[frozenset[str], ...]] = ()
    #: whether it moves the rotation of queries and keys into attention (``rotate_in_attention``), which a family
    #: whose rotation cannot move there refuses (``rope_ext.families``' support)
    rotates_in_attention: ClassVar[bool] = False
    #: what its methods cannot be combined with: hook kinds, or traits (``ROTATES_IN_ATTENTION``), each with the
    #: reason (``{method}`` and ``{other}`` name the pair); checked in one place (``PlanBuilder.install``)
    conflicts: ClassVar[Mapping[str, str]] = {}

    @abstractmethod
    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        """Add ``method``'s edits to ``builder``; raise ``ValueError`` if the sites cannot take it."""

    def fits(self, method_class: type, site_kinds: frozenset[str]) -> bool:
        """Whether a method of this kind can run on a family with these site kinds (listed as one of its methods);
        the default: every method of the kind."""
        return True

    def refusal(self, method_class: type, site_kinds: frozenset[str]) -> str | None:
        """Why a method of this kind cannot run on a family with these site kinds (``None``: it can), as a clause
        that follows "does not fit <family>: "; the default asks ``fits``."""
        if self.fits(method_class, site_kinds):
            return None
        return f"its sites ({', '.join(sorted(site_kinds))}) cannot take this {self.kind!r} method"

    def traits(self, method: MethodConfig) -> frozenset[str]:
        """What ``method`` is to the combination rules (``combination``): by default what every method of the kind is,
        its hook kind and ``ROTATES_IN_ATTENTION`` where the installer rotates in attention."""
        return kind_traits(self)

    def in_use(self, model: nn.Module, method: MethodConfig) -> MethodConfig:
        """``method`` as installed in ``model`` (patched by it): its options left at ``None`` replaced by the
        values the hooks derived from the model (``L``, windows...). The default: ``method`` itself."""
        return method


_HOOKS: Registry[HookInstaller] = Registry("hook kind", "hook kinds with an installer")


def register_hook(installer: HookInstaller) -> HookInstaller:
    return _HOOKS.register(installer.kind, installer)


def unregister_hook(kind: str) -> None:
    _HOOKS.unregister(kind)


#: hook kinds renamed, by their old names (code written against them still finds the installer)
RENAMED_KINDS = {"attention": HOOK_POSITION_RULE}


def get_hook(kind: str) -> HookInstaller:
    return _HOOKS.get(RENAMED_KINDS.get(kind, kind))


def hook_kinds_for(site_kinds: frozenset[str] | set[str]) -> frozenset[str]:
    """The hook kinds whose installers need only sites of these kinds (or one of their alternatives)."""
    given = set(site_kinds)
    return frozenset(
        installer.kind for installer in _HOOKS
        if installer.site_kinds <= given or any(kinds <= given for kinds in installer.alternative_site_kinds)
    )
