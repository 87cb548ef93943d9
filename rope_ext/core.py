"""``patch`` / ``unpatch`` / ``patched`` / ``get_patch``: in-place, recorded on the model, exactly undone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from rope_ext.methods import MethodConfig, get_method_class, list_methods, make_config
from rope_ext.patches import PatchPlan, find_family

STATE_ATTR = "_rope_ext_state"
ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass
class PatchState:
    """What an active patch changed: enough to undo it exactly."""

    method: MethodConfig
    family: str
    layer_types: list[str] | None
    plan: PatchPlan


def patch(
    model: ModelT,
    method: MethodConfig | str | dict[str, Any],
    *,
    layer_types: list[str] | None = None,
    **options: Any,
) -> ModelT:
    """Swap ``model``'s position encoding for ``method`` in place and return the same object.

    ``method`` is a registered name (``rope_ext.list_methods()``) with its options as keyword arguments,
    a dict with a ``"method"`` key, or a config object such as ``rope_ext.methods.YarnConfig(factor=4)``.
    ``layer_types`` picks the layer types of models with several (Gemma 3; default ``["full_attention"]``).
    Raises ``ValueError`` on bad input and ``RuntimeError`` if ``model`` is already patched; on any error
    the model is left untouched.
    """
    config = make_config(method, **options)
    current = get_patch(model)
    if current is not None:
        raise RuntimeError(
            f"model is already patched with {current!r}; call rope_ext.unpatch(model) before patching again"
        )
    family = find_family(model)
    if config.hook not in family.hooks:
        raise ValueError(
            f"method {config.method!r} needs a {config.hook!r} hook, which family {family.name!r} does not support; "
            f"methods for {family.name}: {', '.join(methods_for(family.hooks))}"
        )
    plan = family.plan(model, config, list(layer_types) if layer_types is not None else None)
    plan.apply()
    setattr(model, STATE_ATTR, PatchState(config, family.name, layer_types, plan))
    return model


def unpatch(model: ModelT) -> ModelT:
    """Restore every module and config value ``patch`` replaced; raises if ``model`` is not patched."""
    state: PatchState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        raise RuntimeError("model is not patched by rope_ext; nothing to unpatch")
    state.plan.revert()
    delattr(model, STATE_ATTR)
    return model


def get_patch(model: nn.Module) -> MethodConfig | None:
    """The active method config, or ``None``."""
    state: PatchState | None = getattr(model, STATE_ATTR, None)
    return state.method if state is not None else None


@contextlib.contextmanager
def patched(
    model: ModelT,
    method: MethodConfig | str | dict[str, Any],
    *,
    layer_types: list[str] | None = None,
    **options: Any,
) -> Iterator[ModelT]:
    """``with rope_ext.patched(model, "ntk", factor=2): ...`` -- patched inside, restored on exit."""
    patch(model, method, layer_types=layer_types, **options)
    try:
        yield model
    finally:
        unpatch(model)


def methods_for(hooks: frozenset[str]) -> list[str]:
    """Registered methods whose hook kind is in ``hooks``."""
    return [name for name in list_methods() if get_method_class(name).hook in hooks]
