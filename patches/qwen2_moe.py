"""Qwen2-MoE / Qwen1.5-MoE family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("qwen2_moe", (Qwen2MoeRotaryEmbedding,)))
