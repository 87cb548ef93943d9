"""Gemma family: one shared rotary embedding, full head dimension."""

from transformers.models.gemma.modeling_gemma import GemmaRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("gemma", (GemmaRotaryEmbedding,)))
