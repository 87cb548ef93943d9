"""Granite-MoE family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("granitemoe", (GraniteMoeRotaryEmbedding,)))
