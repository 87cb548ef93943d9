"""Falcon (rotary variants; ALiBi checkpoints are not RoPE) family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.falcon.modeling_falcon import FalconRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("falcon", (FalconRotaryEmbedding,)))
