"""Arcee (AFM) family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.arcee.modeling_arcee import ArceeRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("arcee", (ArceeRotaryEmbedding,)))
