"""transformers' rotation from a config.json: its own config class and rope functions run on it (the installed
version, 5.23), so this reader is transformers itself, not a re-implementation.

The config class reads both layouts (``rope_parameters``; the legacy ``rope_scaling`` with a top-level ``rope_theta``)
and warns about keys its validation does not know ("Unrecognized keys in `rope_parameters`"): those are ``ignored``.
``max_length`` is ``max_position_embeddings`` (transformers' generation reminder, and what engines read first).
Dynamic NTK and dynamic YaRN depend on the sequence length: the rotation at ``max_model_len`` (or the longest
position asked, whichever is larger) is given, as a forward of that many tokens computes it.
"""

from __future__ import annotations

import copy
import logging

import torch

from rope_ext.serving.rotation import Rotation, cos_sin

LOGGER = "transformers.modeling_rope_utils"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def config_object(config: dict):
    """transformers' config class for ``config['model_type']`` built from the dict, and the warnings its rope
    validation gave."""
    from transformers import AutoConfig

    values = copy.deepcopy({k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
    handler = _Warnings()
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # (collected into ``ignored``, not printed)
    try:
        built = AutoConfig.for_model(config.get("model_type", "llama"), **values)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    return built, handler.messages


def rope_parameters(config) -> dict:
    """The rope parameters of a config's full-attention layers (a per-layer-type dict's ``full_attention``)."""
    params = config.rope_parameters
    if params and all(isinstance(value, dict) for value in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    return dict(params)


def rotation(config: dict, positions: torch.Tensor, max_model_len: int | None = None) -> Rotation:
    """What transformers computes for ``config`` (a config.json as a dict) at ``positions``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    built, warnings = config_object(config)
    if not getattr(built, "rope_parameters", None):
        raise ValueError(f"a {config.get('model_type')} config states no rotary embedding")
    params = rope_parameters(built)
    rope_type = params.get("rope_type", "default")
    ignored = [f"rope_parameters.{key.strip(chr(39))}: transformers' {rope_type} does not read it"
               for message in warnings if "Unrecognized keys" in message
               for key in message.split(": ", 1)[1].strip("{}").split(", ")]
    longest = max(int(positions.max()) + 1, max_model_len or 0)
    if rope_type == "default":
        dim = int(getattr(built, "head_dim", None) or built.hidden_size // built.num_attention_heads)
        dim = int(dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq, factor = 1.0 / (params["rope_theta"] ** exponents), 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](built, None, seq_len=longest)
    else:
        raise ValueError(f"transformers has no rope type {rope_type!r}; types: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    notes = []
    if rope_type == "dynamic":
        notes.append(f"dynamic: the rotation of a {longest}-token forward (it follows the sequence length)")
    if rope_type == "longrope":
        notes.append("longrope: long factors for a sequence longer than original_max_position_embeddings, per forward")
    cos, sin = cos_sin(inv_freq, positions, float(factor))
    return Rotation(cos, sin, ignored=ignored, max_length=getattr(built, "max_position_embeddings", None), notes=notes)
