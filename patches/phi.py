"""Phi-1/1.5/2 family: partial rotary (partial_rotary_factor, 0.5 by default)."""

from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("phi", (PhiRotaryEmbedding,)))
