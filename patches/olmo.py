"""OLMo family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.olmo.modeling_olmo import OlmoRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("olmo", (OlmoRotaryEmbedding,)))
