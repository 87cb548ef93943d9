"""Modules that stand in for a model's own position modules while a patch is active."""

from rope_ext.hooks.rotary import RopeExtRotaryEmbedding

__all__ = ["RopeExtRotaryEmbedding"]
