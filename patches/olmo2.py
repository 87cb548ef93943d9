"""OLMo 2 family: one shared rotary embedding, full head dimension."""

from transformers.models.olmo2.modeling_olmo2 import Olmo2RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("olmo2", (Olmo2RotaryEmbedding,)))
