"""Nemotron family: partial rotary (partial_rotary_factor, 0.5 by default)."""

from transformers.models.nemotron.modeling_nemotron import NemotronRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("nemotron", (NemotronRotaryEmbedding,)))
