"""StableLM family: partial rotary (partial_rotary_factor, 0.25 by default)."""

from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("stablelm", (StableLmRotaryEmbedding,)))
