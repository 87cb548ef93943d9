"""What a fine-tune trains: LoRA through peft (never a hand-written LoRA), with per-family defaults read from the
family's own locator, plus LongLoRA's "LoRA+" (embeddings and norms trained in full, as peft's ``modules_to_save``).

* LoRA targets default to the linear layers of the family's attention modules (``q_proj, k_proj, v_proj, o_proj``
  on Llama; ``query_key_value, dense`` on GPT-NeoX; ``qkv_proj, o_proj`` on Phi-3), as LongLoRA adapts q, k, v, o;
  a family without an attention site falls back to peft's own table for its ``model_type``.
* ``embeddings`` is the module ``get_input_embeddings`` returns; ``norms`` are the leaf modules whose parameters are
  all vectors (LayerNorm, RMSNorm: every family's norm classes differ, their shape does not). A model whose output
  embedding is tied to its input embedding keeps them tied (peft's ``ensure_weight_tying``).
* Parameters the patch owns (FIRE's MLP, KERPLE's ``r1, r2``: the ``rope_ext`` container) are trained in full too,
  as ``modules_to_save`` (peft freezes every base weight, theirs included).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from rope_ext.installers.params import PARAMS_ATTR, container_of
from rope_ext.runs.models import quiet_peft

TASK_TYPE = "CAUSAL_LM"


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def linear_names(model: nn.Module) -> list[str]:
    """The last names of the model's linear layers (what LoRA can target), in model order."""
    names = [name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, _linear_types()) and name]
    return list(dict.fromkeys(names))


def default_targets(model: nn.Module) -> list[str]:
    """The linear layers of the family's attention modules; else peft's table for the model type (``model``
    unpatched: a family locates its sites on the model as transformers built it)."""
    from rope_ext.core import anchor_of
    from rope_ext.families import find_family

    anchor = anchor_of(model)
    try:
        sites = find_family(anchor).locate(anchor).get("attention")
    except ValueError:
        sites = []
    if sites and sites[0].layers:
        module = sites[0].layers[0].module
        names = [name for name, m in module.named_children() if isinstance(m, _linear_types())]
        if names:
            return names
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    found = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(getattr(anchor.config, "model_type", None))
    if not found:
        raise ValueError(
            f"no default LoRA targets for {type(anchor).__name__}; give --lora-targets, from its linear layers: "
            f"{', '.join(linear_names(anchor))}"
        )
    return list(found)


def norm_names(model: nn.Module) -> list[str]:
    """The last names of the leaf modules whose parameters are all vectors (the norms)."""
    names = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if name and not list(module.children()) and params and all(p.dim() == 1 for p in params):
            names.append(name.rsplit(".", 1)[-1])
    return list(dict.fromkeys(names))


def _names_of(model: nn.Module, module: nn.Module | None) -> list[str]:
    """The last names under which ``module`` sits in ``model``."""
    return [name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is module and name]


def modules_to_save(model: nn.Module, trainable: list[str]) -> list[str]:
    names: list[str] = []
    if "embeddings" in trainable:
        names += _names_of(model, model.get_input_embeddings())
    if "norms" in trainable:
        found = norm_names(model)
        if not found:
            raise ValueError(f"--trainable norms: {type(model).__name__} has no norm layer (a module of vector weights)")
        names += found
    return list(dict.fromkeys(names))


def lora_model(model: nn.Module, r: int, alpha: float, dropout: float, targets: list[str] | None,
               trainable: list[str]) -> nn.Module:
    """``model`` wrapped by peft's LoRA (``get_peft_model``), with the modules of ``trainable`` trained in full."""
    from peft import LoraConfig, get_peft_model

    valid = linear_names(model)
    targets = list(targets) if targets else default_targets(model)
    unknown = [t for t in targets if t not in valid]
    if unknown:
        raise ValueError(
            f"--lora-targets: {type(model).__name__} has no linear layer named {unknown[0]!r}; its linear layers: "
            f"{', '.join(valid)}"
        )
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    saved = modules_to_save(model, trainable)
    if tied and "embeddings" in trainable:
        tied_names = _names_of(model, model.get_output_embeddings())
        if any(name in targets for name in tied_names):
            raise ValueError(
                f"--lora-targets {','.join(targets)}: {tied_names[0]} is tied to the input embeddings, which "
                "--trainable embeddings trains in full; leave it out of the LoRA targets"
            )
    if container_of(model) is not None:  # (the patch's own learnable parameters)
        saved.append(PARAMS_ATTR)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
        modules_to_save=saved or None, task_type=TASK_TYPE,
        ensure_weight_tying=tied and "embeddings" in trainable,
    )
    with quiet_peft():
        return get_peft_model(model, config)


def count_parameters(model: nn.Module) -> dict[str, Any]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "fraction": trainable / total if total else 0.0}
