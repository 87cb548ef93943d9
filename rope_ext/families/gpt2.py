"""GPT-2: a learned absolute position table (``transformer.wpe``, ``n_positions`` rows) and attention modules that
run transformers' ``AttentionInterface`` (no rotary module); the sites of ``families/tables.py``.

A GPT-2 with cross-attention (``add_cross_attention``) is refused: its cross-attention modules take encoder
positions, which no method here describes.
"""

from __future__ import annotations

from torch import nn

from rope_ext.families.base import register_family
from rope_ext.families.tables import LearnedTableFamily


class GPT2Family(LearnedTableFamily):
    name = "gpt2"
    owner_module = "transformers.models.gpt2.modeling_gpt2"
    owner_class = "GPT2Model"
    table_attribute = "wpe"

    def refuse(self, owner: nn.Module) -> None:
        if getattr(owner.config, "add_cross_attention", False):
            raise ValueError("gpt2: a GPT-2 with cross-attention (add_cross_attention=True) is not supported")


register_family(GPT2Family())
