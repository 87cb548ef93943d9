"""What a model folder saved patched, or a GGUF, states for serving: the config fields a GGUF's keys give, and whether
plain transformers (without rope_ext) computes the patch from a saved config.json's own rope keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rope_ext.methods import MethodConfig
from rope_ext.serving.plan import frequency_methods, measured_difference, rotary_spec, served_length


def config_from_gguf(metadata: dict) -> dict:
    """The config fields a plan reads, from a GGUF's keys."""
    arch = str(metadata["general.architecture"])
    heads = metadata[f"{arch}.attention.head_count"]
    heads = heads[0] if isinstance(heads, list) else heads
    hidden = int(metadata[f"{arch}.embedding_length"])
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // int(heads)))
    rotated = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    return {
        "model_type": arch, "hidden_size": hidden, "num_attention_heads": int(heads), "head_dim": head_dim,
        "partial_rotary_factor": rotated / head_dim, "max_position_embeddings": int(metadata[f"{arch}.context_length"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 1e4))},
    }


def plain_transformers_gap(folder: str | os.PathLike) -> str | None:
    """Why plain transformers (without rope_ext) loads a model saved patched otherwise than rope_ext computes it, or
    ``None`` where its config.json's own rope keys give the patch's rotation (checked by transformers' reader)."""
    from rope_ext.serving.engines import hf

    config = json.loads((Path(folder) / "config.json").read_text())
    block = config.get("rope_ext")
    if not isinstance(block, dict):
        return None
    methods = tuple(MethodConfig.from_dict(m) for m in block.get("methods", []))
    frequency, others = frequency_methods(methods)
    names = "+".join(method.method for method in methods)
    if others:
        return f"{names}: plain transformers has no such attention, and loads the model without it"
    unpatched = {**config, **{key: value for key, value in block.get("base", {}).items() if "." not in key}}
    spec = rotary_spec(unpatched, frequency[0])
    served = served_length(frequency[0], spec, None)
    try:
        gap = measured_difference(frequency[0], spec, served, lambda positions, n: hf.rotation(config, positions))
    except (ValueError, KeyError) as error:
        return f"{names}: transformers does not read its config ({error})"
    if gap:
        rope = config.get("rope_parameters", {}).get("rope_type", "default")
        return (f"{names}: its config.json states rope_type {rope!r} (no rope type that a {config.get('model_type')} "
                f"config accepts gives it), so plain transformers computes another rotation (cos/sin up to {gap:.3g} "
                "apart)")
    return None
