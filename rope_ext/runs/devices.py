"""Where an evaluation runs: ``--device`` read and checked, and a loaded model placed there.

``cpu`` (the default), ``cuda``, ``cuda:N`` and ``mps`` move the whole model; ``auto`` spreads it with accelerate's
device map (``infer_auto_device_map``: the GPUs first, then the CPU; a model larger than one device), its inputs
given to its first device and accelerate's hooks moving activations between them. A device this machine lacks is
refused in one line naming those it has.
"""

from __future__ import annotations

import re

import torch
from torch import nn

#: what ``--device`` takes
DEVICE_FORMS = ("cpu", "cuda", "cuda:N", "mps", "auto")


def parse_device(text: str) -> str:
    """``--device`` as given, checked for its form (not yet for this machine: ``check_device``)."""
    if re.fullmatch(r"cpu|cuda(:\d+)?|mps|auto", text) is None:
        raise ValueError(f"unknown device {text!r}; give one of {', '.join(DEVICE_FORMS)} (auto: accelerate's device "
                         "map, the model spread over the GPUs, then the CPU)")
    return text


def devices_here() -> list[str]:
    """The devices this machine has, as ``--device`` names them."""
    here = ["cpu"]
    if torch.cuda.is_available():
        here += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count())), "auto"]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        here.append("mps")
    return here


def check_device(device: str) -> None:
    """Refuse a device this machine lacks (``auto`` needs a GPU: on the CPU alone it is ``cpu``)."""
    here = devices_here()
    if device == "auto" and device not in here:
        raise ValueError(f"--device auto spreads the model over the GPUs (accelerate's device map), and this machine "
                         f"has none (torch {torch.__version__}); here: {', '.join(here)}")
    if device not in here:
        raise ValueError(f"--device {device}: this machine has no such device (torch {torch.__version__}); here: "
                         f"{', '.join(here)}")


def placed(model: nn.Module, device: str) -> nn.Module:
    """``model`` on ``device`` (``check_device`` first): moved whole, or dispatched by accelerate for ``auto``."""
    check_device(device)
    if device == "cpu":
        return model
    if device != "auto":
        return model.to(device)
    from accelerate import dispatch_model, infer_auto_device_map

    no_split = getattr(model, "_no_split_modules", None) or []
    device_map = infer_auto_device_map(model, no_split_module_classes=list(no_split))
    return dispatch_model(model, device_map)

