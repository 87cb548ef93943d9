"""ERNIE 4.5 family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("ernie4_5", (Ernie4_5RotaryEmbedding,)))
