"""GLM-4 family: partial rotary whose attention applies cos/sin to interleaved pairs; the frequencies are the same."""

from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("glm4", (Glm4RotaryEmbedding,)))
