"""Family adapters: locators that say where a model keeps its position sites.

An adapter recognises one Hugging Face architecture family and returns its ``Sites`` (the rotary module
and its layer types, the config, later the attention modules, bias modules and absolute tables). The
hook kinds a family supports follow from the site kinds it provides: a kind is supported when its
installer (``rope_ext.installers``) needs only sites the family has, unless the family's code refuses it
(``refusals``); ``support`` says which, per model type (``rope_ext.families.support``). Adapters never edit a model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torch import nn

from rope_ext.families.attention import chunking, chunking_refused, softcapping, softcapping_refused
from rope_ext.families.support import (
    Refusals,
    Support,
    config_class_of,
    grouped,
    merged,
    model_type_of,
    model_types_of,
    support_for,
)
from rope_ext.installers.attention import AttentionSite
from rope_ext.installers.base import RopeExtModule, Sites
from rope_ext.registry import Registry

#: The config attribute that records a patch, so ``save_pretrained`` carries it into ``config.json``.
CONFIG_KEY = "rope_ext"


class FamilyAdapter(ABC):
    """One architecture family: detection and the location of its position sites."""

    name: str
    #: the site kinds ``locate`` can return for this family
    site_kinds: frozenset[str]
    #: whether the family's models predict the next token from the ones before (what ``rope-ext eval`` scores)
    causal: bool = True
    #: a row found from transformers' model list at run time (``rope_ext.families.discovered``), not kept by hand
    discovered: bool = False

    @property
    def hooks(self) -> frozenset[str]:
        """Hook kinds this family supports for every one of its model types (``support()``)."""
        return self.support().kinds

    @property
    def methods(self) -> list[str]:
        """The registered methods that run on every one of this family's model types (``support()``)."""
        return list(self.support().methods)

    @property
    def model_types(self) -> tuple[str, ...]:
        """The transformers model types this family covers: those whose modeling code is the package of its
        ``module`` (or ``owner_module``); its name where it names none."""
        if "_model_types" not in vars(self):
            module = getattr(self, "module", None) or getattr(self, "owner_module", None)
            vars(self)["_model_types"] = (model_types_of(module) if isinstance(module, str) else ()) or (self.name,)
        return vars(self)["_model_types"]

    def refusals(self, model_type: str) -> Refusals:
        """What this family's code refuses for models of ``model_type``, whatever the checkpoint (read once per
        model type: ``support`` caches it). Here: softcapping that the model type's config class sets, on a family
        with attention sites; a family with probes of its own extends it."""
        if AttentionSite.kind not in self.site_kinds:
            return Refusals()
        config_class = config_class_of(model_type)
        cap, chunk = softcapping(config_class), chunking(config_class)
        if cap is not None:
            return Refusals({AttentionSite.kind: softcapping_refused(cap)})
        return Refusals() if chunk is None else Refusals({AttentionSite.kind: chunking_refused(chunk)})

    def supports(self) -> list[Support]:
        """This family's support, one entry per group of its model types that agree (one entry when all do)."""
        return grouped(self.name, [self._support_of(model_type) for model_type in self.model_types])

    def support(self, of: Any = None) -> Support:
        """What this family supports: for ``of`` (a model, model class, config or model type; a model of another
        type that holds this family's modules counts as the family's first), or, ``None``, for every model type
        it covers. ``patch`` refuses what it refuses, with the reason and the methods that fit."""
        if of is None:
            return merged(self.name, [self._support_of(model_type) for model_type in self.model_types])
        model_type = model_type_of(of)
        if model_type not in self.model_types:
            if isinstance(of, str):
                known = ", ".join(self.model_types)
                raise ValueError(f"{self.name}: unknown model type {of!r}; its model types: {known}")
            model_type = self.model_types[0]
        return next(s for s in self.supports() if model_type in s.model_types)

    def _support_of(self, model_type: str) -> Support:
        cache = vars(self).setdefault("_refusals", {})
        if model_type not in cache:
            cache[model_type] = self.refusals(model_type)
        return support_for(self.name, self.site_kinds, cache[model_type], model_type)

    @abstractmethod
    def matches(self, model: nn.Module) -> bool:
        """True if this adapter can find its position sites in ``model``."""

    @abstractmethod
    def locate(self, model: nn.Module) -> Sites:
        """The model's sites; raise ``ValueError`` if they cannot be found."""


class OwnerFamily(FamilyAdapter):
    """A family found by the one module that holds its position sites: ``owner_class`` of ``owner_module`` (compared
    by name, so the modeling module is not imported)."""

    owner_module: ClassVar[str]
    owner_class: ClassVar[str]

    def _owners(self, model: nn.Module) -> list[nn.Module]:
        return modules_deriving_from(model, self.owner_module, self.owner_class)

    def matches(self, model: nn.Module) -> bool:
        return bool(self._owners(model))

    def owner(self, model: nn.Module) -> nn.Module:
        """The owner module of ``model``; raises unless there is exactly one."""
        found = self._owners(model)
        if len(found) != 1:
            raise ValueError(
                f"{self.name}: found {len(found)} {self.owner_class} modules; rope_ext patches a model with one"
            )
        return found[0]

    def whole_model_config(self, model: nn.Module):
        """``model``'s config; raises for a part of a model (no config of its own, where a patch would not be saved)."""
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"{self.name}: patch the whole model, not its {type(model).__name__} (it has no config)")
        return config


def derives_from(module: nn.Module, module_path: str, class_name: str) -> bool:
    """Whether ``module``'s class is, or derives from, the class ``class_name`` of ``module_path`` (compared by name,
    so the modeling module is not imported)."""
    return any(c.__module__ == module_path and c.__name__ == class_name for c in type(module).__mro__)


def modules_deriving_from(model: nn.Module, module_path: str, class_name: str) -> list[nn.Module]:
    """``model`` and its submodules outside rope_ext's that ``derives_from`` the class."""
    candidates = [model] + [child for _, _, child in modules_outside_rope_ext(model)]
    return [module for module in candidates if derives_from(module, module_path, class_name)]


def modules_outside_rope_ext(model: nn.Module):
    """``(parent, attribute, child)`` for every submodule, not descending into modules rope_ext installed."""
    stack = [model]
    while stack:
        parent = stack.pop()
        for name, child in parent.named_children():
            yield parent, name, child
            if not isinstance(child, RopeExtModule):
                stack.append(child)


_FAMILIES: Registry[FamilyAdapter] = Registry("family", "supported families")


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    return _FAMILIES.register(adapter.name, adapter)


def unregister_family(name: str) -> None:
    _FAMILIES.unregister(name)


def list_families() -> list[str]:
    return _FAMILIES.names()


def get_family(name: str) -> FamilyAdapter:
    return _FAMILIES.get(name)


#: functions that find an adapter for a model no registered family matches (``rope_ext.families.discovered``:
#: a row of the rotary table read off the model's own transformers modeling package); they register what they find
DISCOVERERS: list = []


def find_family(model: nn.Module) -> FamilyAdapter:
    """The adapter whose position sites ``model`` contains (a registered family, else one a discoverer finds for it);
    raises listing the supported families."""
    found = [adapter for adapter in _FAMILIES if adapter.matches(model)]
    if not found:
        found = [adapter for discover in DISCOVERERS if (adapter := discover(model)) is not None][:1]
    if len(found) == 1:
        return found[0]
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "?")
    if not found:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise ValueError(
                f"rope_ext patches a whole model (a transformers PreTrainedModel with a config, or a peft model around "
                f"one); got a {type(model).__name__}, which no supported family is: if it is part of a model, patch the "
                f"model that contains it. Supported families: {', '.join(list_families())}"
            )
        raise ValueError(
            f"rope_ext does not support {type(model).__name__} (model_type {model_type!r}); "
            f"supported families: {', '.join(list_families())}"
        )
    raise ValueError(
        f"{type(model).__name__} matches several families ({', '.join(a.name for a in found)}); "
        "rope_ext patches one family at a time"
    )
