"""Llama (also SmolLM2, TinyLlama, Llama 2/3) family: one shared rotary embedding, full head dimension."""

from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("llama", (LlamaRotaryEmbedding,)))
