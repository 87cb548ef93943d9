"""Family adapters and the undo log they produce.

An adapter knows where one Hugging Face architecture family keeps its position module, which hook kinds
it supports and how to install them. ``plan`` builds every replacement object and config value first,
touching nothing; ``PatchPlan.apply`` then swaps them in (rolling back if anything fails) and
``PatchPlan.revert`` puts every original object back, so ``unpatch`` is exact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from rope_ext.methods import MethodConfig
from rope_ext.registry import Registry

#: The config attribute that records a patch, so ``save_pretrained`` carries it into ``config.json``.
CONFIG_KEY = "rope_ext"
_MISSING = object()


def _own_attribute(obj: Any, name: str) -> Any:
    """``obj``'s own value for ``name`` (a submodule counts), ignoring class-level defaults."""
    if isinstance(obj, nn.Module) and name in obj._modules:
        return obj._modules[name]
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
class PatchPlan:
    edits: list[AttrEdit] = field(default_factory=list)

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


def saved_block(method: MethodConfig, layer_types: list[str] | None) -> dict[str, Any]:
    """What a patched model's config carries under ``rope_ext``."""
    return {"method": method.to_dict(), "layer_types": layer_types}


class FamilyAdapter(ABC):
    """One architecture family: detection, supported hook kinds, and patch planning."""

    name: str
    hooks: frozenset[str]

    @abstractmethod
    def matches(self, model: nn.Module) -> bool:
        """True if this adapter can find its position modules in ``model``."""

    @abstractmethod
    def plan(self, model: nn.Module, method: MethodConfig, layer_types: list[str] | None) -> PatchPlan:
        """Every edit ``method`` needs, built without touching ``model``; raise ``ValueError`` if it cannot."""

    @abstractmethod
    def saved_block(self, model: nn.Module) -> tuple[Any, dict[str, Any]] | None:
        """``(config, block)`` if a loaded model's config records a patch, else ``None``."""


_FAMILIES: Registry[FamilyAdapter] = Registry("family", "supported families")


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    return _FAMILIES.register(adapter.name, adapter)


def list_families() -> list[str]:
    return _FAMILIES.names()


def get_family(name: str) -> FamilyAdapter:
    return _FAMILIES.get(name)


def find_family(model: nn.Module) -> FamilyAdapter:
    """The adapter whose position modules ``model`` contains; raises listing the supported families."""
    found = [adapter for adapter in _FAMILIES if adapter.matches(model)]
    if len(found) == 1:
        return found[0]
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "?")
    if not found:
        raise ValueError(
            f"rope_ext does not support {type(model).__name__} (model_type {model_type!r}); "
            f"supported families: {', '.join(list_families())}"
        )
    raise ValueError(
        f"{type(model).__name__} matches several families ({', '.join(a.name for a in found)}); "
        "rope_ext patches one family at a time"
    )
