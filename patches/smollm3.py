"""SmolLM3 family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.smollm3.modeling_smollm3 import SmolLM3RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("smollm3", (SmolLM3RotaryEmbedding,)))
