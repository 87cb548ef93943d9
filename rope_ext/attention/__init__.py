"""The attention program and its kernels (pure torch, never transformers).

``program``: the terms a layer's attention is made of, the kernel table, one call. The kernels (``plain``,
``rules``, ``pair_scale``, ``relative``) cover position regions with exact calls (``kernels``: the tiling;
``dispatch``: one call on the op the device runs; ``merge``: the log-sum-exp merging; ``recorder``: the calls of a
training step), beside a plain reference (``reference``: full score matrices, written for clarity) that they are
tested against. Importing any part of the package registers every kernel.
"""

# (each kernel module registers its kernel when imported)
import rope_ext.attention.pair_scale
import rope_ext.attention.plain
import rope_ext.attention.relative
import rope_ext.attention.rules
from rope_ext.attention.reference import reference_attention, remapped_rope_scores

__all__ = ["reference_attention", "remapped_rope_scores"]
