"""Seed-OSS family: one shared rotary embedding (HF rotate_half convention)."""

from transformers.models.seed_oss.modeling_seed_oss import SeedOssRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("seed_oss", (SeedOssRotaryEmbedding,)))
