"""Every other RoPE family of transformers: a row of the rotary table found from transformers itself, not kept by hand.

A model that no registered family matches, but that holds a transformers ``*RotaryEmbedding`` module of its own
modeling package, gets a ``RotaryFamily`` row named after that package, registered on first use (``discover``).
Listings (``rope-ext families``, the docs table) first add a row for every causal-LM model type of
transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose modeling file defines such a class (``discover_all``: the
files are read as text, no modeling module is imported).

A discovered row claims nothing it has not measured on the model it patches: the rotary installer compares the
module's cos/sin with standard RoPE before any edit (a family in another convention or layout is refused, with
why), and the attention probes read the family's attention code as for any row. ``tests/test_conformance.py``
builds a tiny model of every causal-LM model type and records what each one supports, and why it refuses the rest.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from torch import nn

from rope_ext.families.base import get_family, list_families, modules_outside_rope_ext, register_family
from rope_ext.families.rotary import RotaryFamily

_PREFIX = "transformers.models."
ROTARY_CLASS = re.compile(r"^class (\w+RotaryEmbedding)\b", re.MULTILINE)
#: rotary classes of a model's other towers (a vision encoder's 2-D positions), never the text model's
OTHER_TOWERS = ("Vision", "Visual", "Audio", "Image", "Speech", "Video", "Patch", "Encoder")


#: the layer types a discovered row patches by default where a model has several (a sliding layer never sees long
#: distances: Gemma 3's and OLMo 3's rows do the same); every type where none of these is among them
DEFAULT_LAYER_TYPES = ("full_attention",)


def _package(module_path: str) -> str:
    return module_path[len(_PREFIX):].split(".")[0]


def _text_rotary(names: list[str]) -> list[str]:
    return [name for name in dict.fromkeys(names) if not any(tower in name for tower in OTHER_TOWERS)]


def _covered(module_path: str) -> bool:
    """Whether a registered family already reads this modeling module's rotary class."""
    return any(getattr(get_family(name), "module", None) == module_path for name in list_families())


def _row(module_path: str, class_name: str) -> RotaryFamily | None:
    """A new row for ``class_name`` of ``module_path`` under the package's name (``None`` where that name is taken by
    a family of another module: the registered one stays)."""
    name = _package(module_path)
    if name in list_families():
        return None
    row = RotaryFamily(name, module_path[len(_PREFIX):], class_name, default_layer_types=DEFAULT_LAYER_TYPES)
    row.discovered = True
    return row


def discover(model: nn.Module) -> RotaryFamily | None:
    """The rotary row of ``model``'s own modeling package, registered (``None``: ``model`` holds no transformers
    rotary module, or several text ones, or one a registered family covers); a model whose modeling code has one but
    that holds none (its config turns RoPE off) is refused, saying so."""
    found = {(type(child).__module__, type(child).__name__) for _, _, child in modules_outside_rope_ext(model)
             if type(child).__name__.endswith("RotaryEmbedding") and type(child).__module__.startswith(_PREFIX)}
    text = [(module, name) for module, name in found if _text_rotary([name])]
    from transformers import PreTrainedModel

    own = type(model).__module__  # (a whole model only: a part of one is told to patch the whole)
    if (not found and isinstance(model, PreTrainedModel) and own.startswith(_PREFIX)
            and (classes := modeling_file_classes(_package(own))) and classes[1]):
        raise ValueError(
            f"{type(model).__name__}: its modeling code has a rotary embedding ({classes[1][0]}), but this model holds "
            "none: its config leaves positions out (a NoPE setting, e.g. position_embedding_type or use_mem_rope), so "
            "there is no RoPE to extend"
        )
    if len(text) != 1 or _covered(text[0][0]):
        return None
    row = _row(*text[0])
    return None if row is None else register_family(row)


def modeling_file_classes(package: str) -> tuple[str, list[str]] | None:
    """``(module path, text rotary classes)`` of ``transformers.models.<package>.modeling_<package>``, read as text
    (``None``: no such file)."""
    module_path = f"{_PREFIX}{package}.modeling_{package}"
    try:
        spec = importlib.util.find_spec(module_path)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return module_path, _text_rotary(ROTARY_CLASS.findall(Path(spec.origin).read_text(encoding="utf-8")))


def causal_lm_packages() -> list[str]:
    """The modeling packages of transformers' causal-LM model types, sorted."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted({model_type_to_module_name(model_type) for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES})


def rope_causal_lm_types() -> list[str]:
    """The causal-LM model types whose modeling file defines one text rotary class, sorted (what
    tests/test_conformance.py builds, and what the README's summary counts)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        classes = modeling_file_classes(model_type_to_module_name(model_type))
        if classes is not None and len(classes[1]) == 1:
            found.append(model_type)
    return sorted(found)


def discover_all() -> list[str]:
    """Register a row for every causal-LM package whose modeling file defines one text rotary class and that no
    family covers yet; the names registered (once: a second call finds them registered)."""
    added = []
    for package in causal_lm_packages():
        found = modeling_file_classes(package)
        if found is None or len(found[1]) != 1 or _covered(found[0]):
            continue
        row = _row(found[0], found[1][0])
        if row is not None:
            added.append(register_family(row).name)
    return added
