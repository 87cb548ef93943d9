"""Qwen3 family: one shared rotary embedding, full head dimension."""

from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("qwen3", (Qwen3RotaryEmbedding,)))
