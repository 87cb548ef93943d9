"""Phi-3 family: one rotary embedding, optionally partial (partial_rotary_factor); the pre-training length lives in config.original_max_position_embeddings.
Its config class accepts only ``longrope`` (it rewrites ``yarn`` to ``longrope``), so other methods are
saved in the ``rope_ext`` block alone."""

from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("phi3", (Phi3RotaryEmbedding,), native_rope_types=frozenset({"longrope"})))
