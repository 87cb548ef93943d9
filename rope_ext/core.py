"""``patch`` / ``unpatch`` / ``patched`` / ``get_patch``: in place, recorded on the model, exactly undone.

``patch`` locates the model's position sites through its family adapter, lets the installer of each
method's hook kind add its edits to one plan (a combination of methods is one plan: all or nothing),
records the patch in the model config's ``rope_ext`` block, and only then applies the plan. The state
lives on the transformers model itself, so a peft wrapper around it (made before or after patching)
reaches the same patch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from rope_ext.families import CONFIG_KEY, Support, find_family
from rope_ext.guards import RangeWarning, refuse_shared_configs, warn_beyond_range
from rope_ext.installers.attention import installed_programs
from rope_ext.installers.base import PatchPlan, PlanBuilder, RopeExtCallable, RopeExtModule, get_hook
from rope_ext.installers.frequency import TEMPERATURE_KEYS
from rope_ext.installers.params import PARAMS_ATTR, ContainerEdit, PatchParameters, container_of
from rope_ext.methods import HOOK_FREQUENCY, MethodConfig, make_configs
from rope_ext.methods.base import get_method_class
from rope_ext.methods.spec import parse_spec, split_spec
from rope_ext.saved import saved_block

STATE_ATTR = "_rope_ext_state"
ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass
class PatchState:
    """What an active patch changed: enough to undo it exactly."""

    methods: tuple[MethodConfig, ...]
    plan: PatchPlan


def _named_hooks(method: Any) -> list[tuple[str, str]]:
    """(name, hook kind) of each registered method that ``method`` (a spec, dict, config or list of those) names,
    read without building its config; what is not readable is left to ``make_configs`` to report."""
    if isinstance(method, (list, tuple)):
        return [pair for item in method for pair in _named_hooks(item)]
    if isinstance(method, MethodConfig):
        return [(method.method, method.hook)]
    names: list[Any] = []
    if isinstance(method, dict):
        names = [method.get("method")]
    elif isinstance(method, str):
        try:
            names = [name for part in split_spec(method.strip(), "+") for name, _ in parse_spec(part)]
        except ValueError:
            return []
    return [(name, get_method_class(name).hook) for name in names if isinstance(name, str) and get_method_class(name)]


def _check_hooks(support: Support, methods: list[tuple[str, str]]) -> None:
    """Refuse a method the model's family does not support: the one predicate ``rope-ext families`` lists
    (``FamilyAdapter.support``), raising the reason and the methods that fit."""
    for name, hook in methods:
        support.check(name, hook)


def patch(model: ModelT, method: Any, **options: Any) -> ModelT:
    """Swap ``model``'s position encoding in place and return the same object.

    ``method`` is a registered name (``rope_ext.list_methods()``) with its options as keyword arguments,
    a spec as the CLI writes it (``"yarn:factor=4"``, a combination ``"yarn:factor=4+dca"``), a dict with a
    ``"method"`` key, a config object such as ``rope_ext.methods.YarnConfig(factor=4)``, or a list of those
    combining methods of different hook kinds (each with its options in its own spec, dict or config).
    Site options go in the keyword arguments too: ``layer_types=[...]`` picks the layer types of models
    with several (Gemma 3; default ``["full_attention"]``) and ``replace_scaling=True`` lets a method
    replace the RoPE scaling a checkpoint already has.

    Raises ``ValueError`` on bad input, ``TypeError`` if ``model`` is not a module and ``RuntimeError`` if
    it (or part of it) is already patched; on any error the model is left untouched.
    """
    _check_model(model)
    current = _find_state(model)
    if current is not None:
        owner, state = current
        where = "" if owner is anchor_of(model) else f" (through its submodule {type(owner).__name__})"
        raise RuntimeError(
            f"model is already patched{where} with {_describe(state.methods)!r}; call rope_ext.unpatch(model) "
            "before patching again"
        )
    replaced = _replaced_part(model)
    if replaced is not None:
        raise RuntimeError(
            f"part of this model ({replaced!r}) is already patched by rope_ext through a model that contains it; "
            "unpatch that model first"
        )
    anchor = anchor_of(model)
    family = find_family(anchor)
    support = family.support(anchor)
    _check_hooks(support, _named_hooks(method))  # (before the sites: a model the family cannot take names no method)
    sites = family.locate(anchor)
    if sites.model is None:
        sites.model = anchor
    site_options = {
        name: default for kind in sites.by_kind.values() for site in kind for name, default in site.options.items()
    }
    given = {name: options.pop(name) for name in list(options) if name in site_options}
    for kind in sites.by_kind.values():
        for site_class in {type(site) for site in kind}:
            site_class.check_options(given)
    try:
        configs = make_configs(method, **options)
    except ValueError as error:
        if "unknown option" not in str(error) or not site_options:
            raise
        raise ValueError(
            f"{error}; this model's site options (keyword arguments of patch, not part of a method's options): "
            f"{', '.join(site_options)}"
        ) from None
    _check_hooks(support, [(config.method, config.hook) for config in configs])
    if given.get("replace_scaling") and not any(config.hook == HOOK_FREQUENCY for config in configs) and not (
        any(config.method == "temperature" for config in configs) and _reads_temperature(sites)
    ):  # (said; a temperature replaces Ministral 3's own)
        warnings.warn(f"rope_ext: replace_scaling has no effect on {'+'.join(c.method for c in configs)}: only a "
                      "frequency method replaces the checkpoint's own RoPE scaling (and a temperature Ministral 3's "
                      "llama_4_scaling_beta)", UserWarning, stacklevel=2)

    builder = PlanBuilder(sites, site_options | given, frozenset(config.hook for config in configs))
    builder.install(configs)
    if anchor is not model and any(isinstance(edit, ContainerEdit) for edit in builder.plan.edits):
        learned = ", ".join(c.method for c in configs if getattr(c, "learnable", False)) or "this patch"
        raise ValueError(
            f"{learned} brings parameters of its own, and this model is wrapped ({type(model).__name__}): they would "
            "train but the wrapper would not save them. Patch the model before wrapping it, and list 'rope_ext' in "
            "LoraConfig(modules_to_save=[...]) so peft trains and saves them"
        )
    builder.edit_config(sites.config, CONFIG_KEY, saved_block(builder, configs, given))
    warn_beyond_range(builder, anchor)
    refuse_shared_configs(model, builder)
    builder.plan.apply()
    setattr(anchor, STATE_ATTR, PatchState(configs, builder.plan))
    return model


def unpatch(model: ModelT, *, discard_trained: bool = False) -> ModelT:
    """Restore every module and config value ``patch`` replaced; raises if ``model`` is not patched.

    Raises ``RuntimeError`` (changing nothing) when something the patch set was changed since (another value
    set on a config attribute, a module replaced or wrapped, the attention implementation switched): restoring
    blindly would undo that change. Parameters the patch owns (``model.rope_ext``) are removed with it; if they
    were trained since patching, ``unpatch`` refuses unless ``discard_trained=True`` (save them first with
    ``save_pretrained`` if they matter), as peft distinguishes ``unload`` from ``merge_and_unload``.
    """
    _check_model(model)
    if not isinstance(discard_trained, bool):
        raise TypeError(f"discard_trained must be True or False, got {discard_trained!r}")
    found = _find_state(model)
    if found is None:
        replaced = _replaced_part(model)
        if replaced is not None:
            raise RuntimeError(
                f"this module is not patched itself, but part of it ({replaced!r}) was replaced by rope_ext "
                "through a model that contains it; unpatch that model"
            )
        raise RuntimeError("model is not patched by rope_ext; nothing to unpatch")
    owner, state = found
    trained = [key for edit in state.plan.edits if isinstance(edit, ContainerEdit) for key in edit.trained()]
    if trained and not discard_trained:
        raise RuntimeError(
            f"the parameters this patch owns were trained since patching ({', '.join(trained[:6])}"
            f"{', ...' if len(trained) > 6 else ''}); unpatching removes them. Save the model first "
            "(save_pretrained; rope_ext.from_pretrained restores them), then call "
            "rope_ext.unpatch(model, discard_trained=True)"
        )
    state.plan.revert()
    del owner.__dict__[STATE_ATTR]
    return model


def get_patch(model: nn.Module, *, resolved: bool = False) -> MethodConfig | tuple[MethodConfig, ...] | None:
    """The active method config (a tuple of configs for a combination), or ``None``.

    The configs are as given (options left at ``None`` are derived from the model when it is patched, and
    again when a saved patch is reloaded). ``resolved=True`` returns them with what was derived from the model
    filled in: every method's ``L`` and the attention methods' windows (``dca``'s ``chunk_size``...). A value
    computed from the options alone (YaRN's ``attention_factor``) stays ``None``, and so does an ``L`` that
    differs between layer types (Gemma 3 with both patched). Patching an identical model with the resolved
    configs gives the same model.
    """
    _check_model(model)
    if not isinstance(resolved, bool):
        raise TypeError(f"resolved must be True or False, got {resolved!r}")
    found = _find_state(model)
    if found is None:
        return None
    owner, state = found
    methods = state.methods
    if resolved:
        methods = tuple(get_hook(config.hook).in_use(owner, config) for config in methods)
    return _describe(methods)


@contextlib.contextmanager
def patched(model: ModelT, method: Any, *, discard_trained: bool = False, **options: Any) -> Iterator[ModelT]:
    """``with rope_ext.patched(model, "ntk", factor=2): ...`` -- patched inside, restored on exit (``unpatch``'s
    rules: parameters trained inside the block are discarded on exit only with ``discard_trained=True``)."""
    patch(model, method, **options)
    ours = _find_state(model)[1]

    def still_ours() -> bool:  # (the body may have unpatched, or unpatched and patched anew: that patch stays)
        found = _find_state(model)
        return found is not None and found[1] is ours

    try:
        yield model
    except BaseException as error:
        if still_ours():  # keep the body's exception (an unpatch refused is told in a note on it)
            try:
                unpatch(model, discard_trained=discard_trained)
            except Exception as refused:  # noqa: BLE001
                error.add_note(
                    f"rope_ext.patched could not unpatch on the way out; the model is still patched: {refused}"
                )
        raise
    if still_ours():
        unpatch(model, discard_trained=discard_trained)


def summary(model: nn.Module) -> str:
    """What the patch on ``model`` changed, as text (peft's ``print_trainable_parameters`` for rope_ext): the
    methods with the values in use, the rotary module replaced, each group of attention layers with its
    program, and the parameters the patch owns."""
    _check_model(model)
    found = _find_state(model)
    if found is None:
        return "not patched by rope_ext"
    owner, state = found
    methods = [get_hook(config.hook).in_use(owner, config) for config in state.methods]
    lines = [f"rope_ext patch: {' + '.join(_spec_of(config) for config in methods)}"]
    for name, module in owner.named_modules():
        if isinstance(module, RopeExtModule) and not isinstance(module, PatchParameters):  # a replaced module
            lines.append(f"  {name}: {type(module).__name__}({module.extra_repr()})")
        for attribute, value in _installed_attributes(module):  # a method of the module replaced by the patch
            lines.append(f"  {name}.{attribute}: {value!r}")
    programs: dict[str, list[int]] = {}
    for module, program in installed_programs(owner):
        key = f"{program.layer_type or 'layers'}: {program.describe()}"
        programs.setdefault(key, []).append(getattr(module, "layer_idx", -1))
    for key, indices in programs.items():
        lines.append(f"  attention {_ranges(indices)} ({key})")
    container = container_of(owner)
    if container is not None:
        total = sum(p.numel() for p in container.parameters())
        trainable = sum(p.numel() for p in container.parameters() if p.requires_grad)
        lines.append(f"  parameters owned: {total:,} ({trainable:,} trainable) under '{PARAMS_ATTR}.'")
    return "\n".join(lines)


def patched_length(model: nn.Module) -> int | None:
    """The longest sequence the active patch's methods were made for (past it rope_ext warns once); ``None`` without
    a patch, or where its methods follow any length (dynamic ones)."""
    found = _find_state(model)
    hooks = [getattr(edit, "hook", None) for edit in found[1].plan.edits] if found is not None else []
    return max((hook.limit for hook in hooks if isinstance(hook, RangeWarning)), default=None)


def _reads_temperature(sites: Any) -> bool:
    """Whether the model's attention reads a temperature from its rope parameters (Ministral 3's)."""
    rotary = sites.get("rotary")
    params = getattr(rotary[0].config, "rope_parameters", None) if rotary else None
    return isinstance(params, dict) and TEMPERATURE_KEYS[0] in params


def _spec_of(config: MethodConfig) -> str:
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    values = config.to_dict()
    options = [f"{k}={values[k]}" for k in config.option_names() if values[k] != defaults.get(k)]
    return ":".join([config.method, *options])


def _ranges(indices: list[int]) -> str:
    indices = sorted(indices)
    parts, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ("layer " if len(indices) == 1 else "layers ") + ",".join(parts)


# --- helpers ---------------------------------------------------------------------------------------


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"rope_ext expects a loaded model (a torch.nn.Module such as a transformers or peft model), got "
            f"{type(model).__name__} {model!r:.80}; load it first, e.g. AutoModelForCausalLM.from_pretrained(...)"
        )


def anchor_of(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (where the patch state lives), else ``model``."""
    get_base_model = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if callable(get_base_model) else model


def _find_state(model: nn.Module) -> tuple[nn.Module, PatchState] | None:
    """``(owner, state)`` of the patch on ``model`` or on one of its submodules."""
    for module in model.modules():
        state = module.__dict__.get(STATE_ATTR)
        if state is not None:
            return module, state
    return None


def loaded_as_patched(model: nn.Module) -> None:
    """Take the current values of the parameters the patch owns as their values at patch time (after a reload
    gave them their saved values), so ``unpatch`` counts only what is trained after this."""
    _, state = _find_state(model)
    for edit in state.plan.edits:
        if isinstance(edit, ContainerEdit):
            edit.initial = container_of(edit.obj).initial()


def _replaced_part(model: nn.Module) -> str | None:
    """The name of the first module inside ``model`` that rope_ext installed (or whose method it replaced by an
    attribute), or ``None``."""
    for name, module in model.named_modules():
        if isinstance(module, RopeExtModule):
            return name or "the module itself"
        attribute = next((k for k, _ in _installed_attributes(module)), None)
        if attribute is not None:
            return f"{name}.{attribute}" if name else attribute
    return None


def _installed_attributes(module: nn.Module):
    """``(attribute, value)`` for each of ``module``'s methods that rope_ext replaced by an attribute."""
    return [(k, v) for k, v in vars(module).items() if isinstance(v, RopeExtCallable)]


def _describe(methods: tuple[MethodConfig, ...]) -> MethodConfig | tuple[MethodConfig, ...]:
    """A single method's config, or the tuple of a combination (what ``get_patch`` returns)."""
    return methods[0] if len(methods) == 1 else methods


# --- the intended range of a patch ---------------------------------------------------------------------

