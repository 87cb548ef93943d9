"""Gemma 3 family: one rotary module with a frequency set per layer type (``full_attention`` with a large
base, ``sliding_attention`` with base 10k). Only global layers see long distances, so rope_ext patches
``full_attention`` by default; pass ``layer_types=[...]`` to choose."""

from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("gemma3", (Gemma3RotaryEmbedding,), default_layer_types=("full_attention",)))
