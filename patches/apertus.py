"""Apertus family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.apertus.modeling_apertus import ApertusRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("apertus", (ApertusRotaryEmbedding,)))
