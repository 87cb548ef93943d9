"""Parameters a patch owns: one container on the patched model, under a fixed state-dict prefix.

Learned biases (FIRE's MLP, KERPLE's ``r1, r2``), grown tables (a longer T5 bucket table, GPT-2 position rows):
a patch that brings weights of its own puts them in ``PatchParameters``, a ``RopeExtModule`` set on the patched
model as ``model.rope_ext`` (state-dict keys ``rope_ext.<name>.<parameter>``), as peft keeps its adapters. So
they move with ``.to()``, are saved by ``save_pretrained`` (and restored by ``rope_ext.from_pretrained``), and
train: trainable by name (``requires_grad`` stays on; peft's ``get_peft_model`` after patching freezes them
like every base weight, so list ``"rope_ext"`` in ``LoraConfig.modules_to_save``, or set ``requires_grad``).

A term never holds its parameters directly: it calls ``OwnedModule(name)`` at run time, which reaches the
container through the model (``model.rope_ext(name, *args)``). peft's ``modules_to_save`` replaces the container
by a wrapper whose forward dispatches to the trainable copy; going through the model's attribute follows it.

``unpatch`` removes the container. Parameters that changed since patching (trained) are not discarded
silently: ``unpatch`` refuses unless called with ``discard_trained=True`` (save them first if they matter).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rope_ext.installers.base import AttrEdit, PlanBuilder, RopeExtModule, instance_attribute

#: the attribute of the patched model that holds the container (and the prefix of its state-dict keys)
PARAMS_ATTR = "rope_ext"


class PatchParameters(RopeExtModule):
    """The modules of a patch's learnable terms, by name; ``forward(name, *args)`` runs one of them."""

    def forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._modules[name](*args, **kwargs)

    def initial(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self.state_dict().items()}


@dataclass
class ContainerEdit(AttrEdit):
    """Set the container on the model; remembers its initial values, to tell whether they were trained."""

    initial: dict[str, torch.Tensor] | None = None

    def apply(self) -> None:
        super().apply()
        self.initial = self.new.initial()

    def changed(self) -> str | None:
        current = instance_attribute(self.obj, self.name)
        if isinstance(current, PatchParameters) or isinstance(getattr(current, "original_module", None), PatchParameters):
            return None  # (ours, a trained copy of it, or peft's wrapper of it: told apart by ``trained``)
        return super().changed()

    def trained(self) -> list[str]:
        """The parameters whose values differ from their values at patch time."""
        container = container_of(self.obj)
        if container is None or self.initial is None:
            return []
        now = container.state_dict()
        # (compared in the current dtype: a model cast to bf16 after patching holds the initial values, rounded)
        return [key for key, value in self.initial.items()
                if key not in now or not torch.equal(now[key].detach().cpu(), value.cpu().to(now[key].dtype))]


@dataclass(eq=False)
class OwnedModule:
    """A handle on one module of the container of ``model`` (weakly held: a term does not keep the model
    alive); calling it runs that module's forward through the model's attribute."""

    model_ref: weakref.ref
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model_ref()
        container = None if model is None else model._modules.get(PARAMS_ATTR)
        if container is None:
            raise RuntimeError(f"the parameters of rope_ext term {self.name!r} are gone (the model was unpatched)")
        return container(self.name, *args, **kwargs)

    def module(self) -> nn.Module:
        """The module itself (the trainable copy when peft wraps the container)."""
        container = self.model_ref()._modules[PARAMS_ATTR]
        copies = getattr(container, "modules_to_save", None)  # (peft's ModulesToSaveWrapper)
        if copies is not None and getattr(container, "active_adapter", None) in copies:
            container = copies[container.active_adapter]
        elif copies is not None:
            container = getattr(container, "original_module", container)
        return container._modules[self.name]

    def __deepcopy__(self, memo: dict) -> OwnedModule:  # (a copied model's terms reach the copied model)
        from copy import deepcopy

        model = self.model_ref()
        copied = deepcopy(model, memo) if model is not None else None
        return OwnedModule(weakref.ref(copied) if copied is not None else self.model_ref, self.name)

    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model_ref(), "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_ref = weakref.ref(state["model"])
        self.name = state["name"]


def own(builder: PlanBuilder, name: str, module: nn.Module) -> OwnedModule:
    """Put ``module`` (a term's learnable part) into the patched model's container under ``name`` and return the
    handle the term calls. The container is made on first use (one per patch)."""
    model = builder.sites.model
    if model is None:
        raise ValueError("this model's sites name no model to keep a patch's parameters on")
    container = builder.memo.get(PARAMS_ATTR)
    if container is None:
        if PARAMS_ATTR in model._modules or PARAMS_ATTR in vars(model):
            raise ValueError(f"the model already has an attribute {PARAMS_ATTR!r}; rope_ext keeps its parameters there")
        container = PatchParameters()
        builder.plan.edits.append(ContainerEdit(model, PARAMS_ATTR, container))
        builder.memo[PARAMS_ATTR] = container
    if name in container._modules:
        raise ValueError(f"two terms of this patch keep parameters under the name {name!r}")
    placement = next((p for p in model.parameters() if p.is_floating_point()), None)
    if placement is not None:
        module = module.to(device=placement.device, dtype=placement.dtype)
    container.add_module(name, module)
    return OwnedModule(weakref.ref(model), name)


def container_of(model: nn.Module) -> PatchParameters | None:
    """The patch's container on ``model`` (unwrapping peft's ``modules_to_save`` wrapper), or ``None``."""
    container = model._modules.get(PARAMS_ATTR)
    if container is None:
        return None
    copies = getattr(container, "modules_to_save", None)
    if copies is not None:
        active = getattr(container, "active_adapter", None)
        return copies[active] if active in copies else container.original_module
    return container if isinstance(container, PatchParameters) else None
