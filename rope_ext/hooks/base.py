"""Hook installers and the undo log they write.

A *site* is a place where a model keeps part of its position encoding: the shared rotary module, the
attention modules and their implementation, a bias module, an absolute table. Family adapters
(``rope_ext.patches``) locate a model's sites; a *hook installer*, one per hook kind, turns those sites
plus a method config into edits. Several installers may configure one site (frequency and attention
hooks share the rotary module): a site's replacement object is built once per plan and handed to each.

``PlanBuilder`` collects every edit first, touching nothing; ``PatchPlan.apply`` then makes them (rolling
back if anything fails) and ``PatchPlan.revert`` puts every original object and value back, so
``unpatch`` is exact. The model mirrors peft: a method-config registry, an installer per kind, a
per-architecture table of locators.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from rope_ext.methods import MethodConfig
from rope_ext.registry import Registry

class _Missing:
    """The marker of an attribute an edit found absent; one object even through ``copy.deepcopy`` and pickle."""

    def __reduce__(self) -> str:
        return "_MISSING"  # pickled (and deep-copied) by reference to this module's singleton

    def __repr__(self) -> str:
        return "<absent>"


_MISSING = _Missing()


def _own_attribute(obj: Any, name: str) -> Any:
    """``obj``'s own value for ``name`` (a submodule or buffer counts), ignoring class-level defaults."""
    if isinstance(obj, nn.Module):
        for table in (obj._modules, obj._buffers, obj._parameters):
            if name in table:
                return table[name]
    return vars(obj).get(name, _MISSING)


@dataclass
class AttrEdit:
    """Set ``obj.name = new``; remembers the old value (or its absence) for ``revert``."""

    obj: Any
    name: str
    new: Any
    old: Any = field(default=_MISSING, init=False)

    def apply(self) -> None:
        self.old = _own_attribute(self.obj, self.name)
        setattr(self.obj, self.name, self.new)

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

    def revert(self) -> None:
        self.handle.remove()
        self.handle = None


@dataclass
class PatchPlan:
    edits: list[AttrEdit | ForwardPreHookEdit] = field(default_factory=list)

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

    def revert(self) -> None:
        for edit in reversed(self.edits):
            edit.revert()


class RopeExtModule(nn.Module):
    """Base of every module rope_ext installs in a model (so a patched part of a model is recognised)."""


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


@dataclass
class Sites:
    """Where one model keeps its position encoding: ``config`` (the model's own, saved with it; a site may
    edit a sub-config of it, such as a multimodal model's ``text_config``) and the sites by kind."""

    config: Any
    by_kind: dict[str, list[Site]] = field(default_factory=dict)

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

    def option(self, name: str) -> Any:
        return self.options[name]

    def edit(self, obj: Any, name: str, new: Any) -> None:
        self.plan.edits.append(AttrEdit(obj, name, new))

    def hook_forward(self, module: nn.Module, hook: Callable[..., Any]) -> None:
        """Run ``hook(module, args, kwargs)`` before every forward of ``module`` while patched."""
        self.plan.edits.append(ForwardPreHookEdit(module, hook))

    def edit_config(self, config: Any, name: str, new: Any) -> None:
        """An edit of a model config (or a sub-config of it) that ``save_pretrained`` writes out."""
        self.edit(config, name, new)
        self.config_edits.append(self.plan.edits[-1])

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

    @abstractmethod
    def plan(self, builder: PlanBuilder, method: MethodConfig) -> None:
        """Add ``method``'s edits to ``builder``; raise ``ValueError`` if the sites cannot take it."""

    def in_use(self, model: nn.Module, method: MethodConfig) -> MethodConfig:
        """``method`` as installed in ``model`` (patched by it): its options left at ``None`` replaced by the
        values the hooks derived from the model (``L``, windows...). The default: ``method`` itself."""
        return method


_HOOKS: Registry[HookInstaller] = Registry("hook kind", "hook kinds with an installer")


def register_hook(installer: HookInstaller) -> HookInstaller:
    return _HOOKS.register(installer.kind, installer)


def unregister_hook(kind: str) -> None:
    _HOOKS.unregister(kind)


def get_hook(kind: str) -> HookInstaller:
    return _HOOKS.get(kind)


def hook_kinds_for(site_kinds: frozenset[str] | set[str]) -> frozenset[str]:
    """The hook kinds whose installers need only sites of these kinds."""
    return frozenset(installer.kind for installer in _HOOKS if installer.site_kinds <= set(site_kinds))
