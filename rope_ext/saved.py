"""The ``rope_ext`` block a patched model's config carries (so ``save_pretrained`` records the patch) and its
reading back: the methods, the site options, the config values the patch replaced and the names it added."""

from __future__ import annotations

import copy
from typing import Any

from rope_ext.families import CONFIG_KEY
from rope_ext.installers.base import PlanBuilder
from rope_ext.methods import MethodConfig


def saved_patch(config: Any) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], list[str]] | None:
    """``(methods, site options, replaced config values by path, added names)`` recorded in a config's
    ``rope_ext`` block, or ``None``."""
    block = getattr(config, CONFIG_KEY, None)
    if block is None:
        return None
    if "method" in block:  # the block of rope_ext 0.1: one method, layer_types, no base values
        options = {"layer_types": block["layer_types"]} if block.get("layer_types") is not None else {}
        return [block["method"]], options, {"rope_parameters": unscaled(config.rope_parameters)}, []
    return block["methods"], block.get("options", {}), block.get("base", {}), block.get("absent", [])


def unscaled(rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` with every scaling removed (what rope_ext 0.1 replaced with a native method)."""
    if all(isinstance(value, dict) for value in rope_parameters.values()):  # per layer type (Gemma 3)
        return {layer_type: unscaled(params) for layer_type, params in rope_parameters.items()}
    kept = {key: rope_parameters[key] for key in ("rope_theta", "partial_rotary_factor") if key in rope_parameters}
    return {"rope_type": "default", **kept}


def saved_block(builder: PlanBuilder, configs: tuple[MethodConfig, ...], given: dict[str, Any]) -> dict[str, Any]:
    """What the model config carries under ``rope_ext``: the methods, the site options, and the values the
    patch replaces in that config or its sub-configs (by attribute path, e.g. ``text_config.rope_parameters``)
    with the names it adds, so a reload can rebuild the unpatched model before patching it."""
    top = builder.sites.config
    base: dict[str, Any] = {}
    absent: list[str] = []
    for edit in builder.config_edits:
        owner = "" if edit.obj is top else next((f"{k}." for k, v in vars(top).items() if v is edit.obj), None)
        if owner is None:
            continue  # not reachable from the saved config: nothing a reload could restore
        if hasattr(edit.obj, edit.name):
            base[owner + edit.name] = copy.deepcopy(getattr(edit.obj, edit.name))
        else:
            absent.append(owner + edit.name)
    block = {"methods": [c.to_dict() for c in configs], "options": copy.deepcopy(given), "base": base}
    return block | ({"absent": absent} if absent else {})

