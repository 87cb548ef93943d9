"""OLMoE family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.olmoe.modeling_olmoe import OlmoeRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("olmoe", (OlmoeRotaryEmbedding,)))
