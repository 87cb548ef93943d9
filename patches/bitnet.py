"""BitNet family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.bitnet.modeling_bitnet import BitNetRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("bitnet", (BitNetRotaryEmbedding,)))
