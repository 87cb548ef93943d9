"""Gemma 2 family: one rotary embedding shared by the sliding-window and global layers."""

from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("gemma2", (Gemma2RotaryEmbedding,)))
