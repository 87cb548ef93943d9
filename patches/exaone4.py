"""EXAONE 4 family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.exaone4.modeling_exaone4 import Exaone4RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("exaone4", (Exaone4RotaryEmbedding,)))
