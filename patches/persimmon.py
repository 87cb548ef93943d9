"""Persimmon / Fuyu text family: partial rotary (partial_rotary_factor, 0.5 by default)."""

from transformers.models.persimmon.modeling_persimmon import PersimmonRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("persimmon", (PersimmonRotaryEmbedding,)))
