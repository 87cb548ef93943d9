"""Granite family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.granite.modeling_granite import GraniteRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("granite", (GraniteRotaryEmbedding,)))
