"""Mistral family: one shared rotary embedding, full head dimension."""

from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("mistral", (MistralRotaryEmbedding,)))
