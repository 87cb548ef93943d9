"""Qwen3-MoE family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("qwen3_moe", (Qwen3MoeRotaryEmbedding,)))
