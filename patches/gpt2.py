"""GPT-2: a learned absolute position table (``transformer.wpe``, ``n_positions`` rows) and attention modules that
run transformers' ``AttentionInterface`` (no rotary module).

Its sites: the table (``absolute``: ``abs_interp``, ``abs_hierarchical``, ``sinusoidal`` read it past its rows) and
the attention modules (``bias``: ALiBi and the other biases replace the table, which then adds nothing). A
GPT-2 with cross-attention (``add_cross_attention``) is refused: its cross-attention modules take encoder
positions, which no method here describes.
"""

from __future__ import annotations

from torch import nn

from rope_ext.hooks.absolute import AbsoluteSite
from rope_ext.hooks.attention import AttentionSite
from rope_ext.hooks.base import Sites
from rope_ext.patches.attention import attention_site
from rope_ext.patches.base import FamilyAdapter, modules_deriving_from, register_family

_MODULE = "transformers.models.gpt2.modeling_gpt2"


class GPT2Family(FamilyAdapter):
    name = "gpt2"
    site_kinds = frozenset({AbsoluteSite.kind, AttentionSite.kind})

    def _transformers(self, model: nn.Module) -> list[nn.Module]:
        return modules_deriving_from(model, _MODULE, "GPT2Model")

    def matches(self, model: nn.Module) -> bool:
        return bool(self._transformers(model))

    def locate(self, model: nn.Module) -> Sites:
        found = self._transformers(model)
        if len(found) != 1:
            raise ValueError(f"gpt2: found {len(found)} GPT2Model modules; rope_ext patches a model with one")
        transformer = found[0]
        config = transformer.config
        if getattr(config, "add_cross_attention", False):
            raise ValueError("gpt2: a GPT-2 with cross-attention (add_cross_attention=True) is not supported")
        sites: dict[str, list] = {AbsoluteSite.kind: [AbsoluteSite(self.name, transformer, "wpe", transformer.wpe)]}
        attention = attention_site(self.name, model, config)
        if attention is not None:
            sites[AttentionSite.kind] = [attention]
        return Sites(getattr(model, "config", config), sites, model)


register_family(GPT2Family())
