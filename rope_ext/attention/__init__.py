"""Attention with remapped relative positions: a plain reference per method (full score matrices, written
for clarity) that the fast kernels are tested against."""

from rope_ext.attention.reference import reference_attention, remapped_rope_scores

__all__ = ["reference_attention", "remapped_rope_scores"]
