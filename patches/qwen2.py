"""Qwen2 / Qwen2.5 family: one shared rotary embedding, full head dimension."""

from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("qwen2", (Qwen2RotaryEmbedding,)))
