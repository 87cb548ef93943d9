"""GPT-NeoX (Pythia) family: partial rotary: only the first rotary_pct of each head rotates."""

from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

from rope_ext.patches.base import register_family
from rope_ext.patches.rotary import RotaryFamily

register_family(RotaryFamily("gpt_neox", (GPTNeoXRotaryEmbedding,)))
