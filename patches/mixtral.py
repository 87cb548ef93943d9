"""Mixtral (mixture of experts) family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("mixtral", (MixtralRotaryEmbedding,)))
