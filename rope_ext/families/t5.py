"""T5 and the families that share its attention code (mT5, UMT5): relative-position bucket tables, no rotary
module and no absolute table; the sites of ``rope_ext.installers.buckets``.

Patched, every attention module (self and cross) runs rope_ext's attention with the bias block by block
(``rope_ext.attention.relative``): the cross-attention modules, which have no table (no positions), are found by
name (``EncDecAttention``) and run plain attention.

T5 and mT5 keep a table in the first self-attention layer of each stack (encoder, decoder), UMT5 one in every
self-attention layer; each such module (``has_relative_attention_bias``) is a bucket site.
"""

from __future__ import annotations

from torch import nn

from rope_ext.installers.base import Sites
from rope_ext.installers.buckets import BucketSite
from rope_ext.families.base import FamilyAdapter, modules_deriving_from, register_family


class BucketFamily(FamilyAdapter):
    """A family whose attention class is ``class_name`` of ``transformers.models.<module>``, with T5's bucket
    tables."""

    site_kinds = frozenset({BucketSite.kind})
    causal = False

    def __init__(self, name: str, module: str, class_name: str) -> None:
        self.name = name
        self.module = "transformers.models." + module
        self.class_name = class_name

    def _attention(self, model: nn.Module) -> list[nn.Module]:
        return modules_deriving_from(model, self.module, self.class_name)

    def matches(self, model: nn.Module) -> bool:
        return bool(self._attention(model))

    def locate(self, model: nn.Module) -> Sites:
        from transformers import PreTrainedModel

        stack = type(model).__name__.endswith("Stack") and type(model).__module__ == self.module
        if stack or not isinstance(model, PreTrainedModel):
            raise ValueError(
                f"{self.name}: patch the whole model, not its {type(model).__name__} (a part has no config of its own, "
                "or, a stack, its own copy of it: a patch recorded there would not be saved with the model)"
            )
        found = set(map(id, self._attention(model)))
        # (in the model's order: encoder first)
        attention = [(m, name.endswith("EncDecAttention")) for name, m in model.named_modules() if id(m) in found]
        tables = [m for m, _ in attention if getattr(m, "has_relative_attention_bias", False)]
        if not tables:
            raise ValueError(f"{self.name}: found no attention module with a relative-position bias table")
        return Sites(model.config, {BucketSite.kind: [BucketSite(self.name, tables, model, attention)]}, model)


for _name, _module, _class in [
    ("t5", "t5.modeling_t5", "T5Attention"),
    ("mt5", "mt5.modeling_mt5", "MT5Attention"),
    ("umt5", "umt5.modeling_umt5", "UMT5Attention"),
]:
    register_family(BucketFamily(_name, _module, _class))
