"""The spec ``saved``: evaluating a model with the patch it was saved with (its configs and trained parameters),
while every other spec starts from the unpatched model."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from rope_ext.core import get_patch, patch, patched, unpatch
from rope_ext.families import CONFIG_KEY
from rope_ext.installers.params import container_of
from rope_ext.methods import HOOK_FREQUENCY, MethodConfig


class SavedPatch(list):
    """The method spec ``saved``: the patch a model was saved with (``keep_saved_patch`` fills in its configs), with
    its parameters as saved (a bias trained with the model). Every other spec starts from the unpatched model."""

    SPEC = "saved"


#: where ``keep_saved_patch`` keeps the saved patch's parameters on the model
_SAVED_STATE = "_rope_ext_saved_state"


#: ``saved`` asked of a model saved without a patch
SAVED_WITHOUT_PATCH = (f"method {SavedPatch.SPEC!r} evaluates the patch a model was saved with; this model was saved "
                       "without one (give the methods to apply instead)")


def _local_config(model: str) -> dict | None:
    """A local model folder's ``config.json`` as read (``None``: not a local folder with one that reads as a
    dict; the load names what is wrong with it)."""
    path = Path(model) / "config.json"
    if model == "default" or not os.path.isdir(model) or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def saved_with_patch(model: str) -> bool:
    """Whether ``model`` is a local folder whose ``config.json`` records a rope_ext patch (saved while patched: a
    fine-tune, a ``rope-ext train`` run, ``save_pretrained`` of a patched model); read without loading it."""
    config = _local_config(model)
    return config is not None and isinstance(config.get(CONFIG_KEY), dict)


def saved_without_patch(model: str) -> bool:
    """Whether ``model`` is known, without loading it, to hold no rope_ext patch: the default model, or a local
    folder whose ``config.json`` records none (a hub name, or a folder that does not read, is known only once
    loaded)."""
    config = _local_config(model)
    return model == "default" or (config is not None and not isinstance(config.get(CONFIG_KEY), dict))


def keep_saved_patch(model: nn.Module, methods: dict[str, list[MethodConfig]] | None = None) -> list[MethodConfig]:
    """Unpatch a model loaded patched (``rope_ext.from_pretrained`` of a folder saved while patched), keeping its
    configs and parameters for the spec ``saved`` (filled into ``methods``' ``SavedPatch`` entries); returns the
    configs (empty: the model was not patched). ``saved`` asked of a model saved without a patch is refused."""
    found = get_patch(model)
    asked = [configs for configs in (methods or {}).values() if isinstance(configs, SavedPatch)]
    if found is None:
        if asked:
            raise ValueError(SAVED_WITHOUT_PATCH)
        return []
    configs = list(found) if isinstance(found, tuple) else [found]
    container = container_of(model)
    state = {} if container is None else {k: v.detach().clone() for k, v in container.state_dict().items()}
    unpatch(model, discard_trained=True)
    vars(model)[_SAVED_STATE] = state
    for entry in asked:
        entry[:] = configs
    return configs


def with_method(
    model: nn.Module, configs: list[MethodConfig], work: Callable[[], Any], site_options: dict[str, Any] | None = None
) -> Any:
    """``work()`` with ``model`` patched with ``configs`` (none: as it is); the spec ``saved`` with its parameters as
    saved."""
    if not configs:
        return work()
    if not any(config.hook == HOOK_FREQUENCY for config in configs):  # (--replace-scaling is for frequency methods)
        site_options = {k: v for k, v in (site_options or {}).items() if k != "replace_scaling"}
    if not isinstance(configs, SavedPatch) or not vars(model).get(_SAVED_STATE):
        with patched(model, list(configs), **(site_options or {})):
            return work()

    patch(model, list(configs), **(site_options or {}))
    try:
        container_of(model).load_state_dict(vars(model)[_SAVED_STATE])
        return work()
    finally:
        unpatch(model, discard_trained=True)

