"""StarCoder2 family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("starcoder2", (Starcoder2RotaryEmbedding,)))
