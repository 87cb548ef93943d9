"""DeBERTa-v2 and v3 (``deberta-v2``): disentangled attention over log-bucketed relative positions, computed once
per forward by the encoder (``DebertaV2Encoder.get_rel_pos``); the site of the ``log_bucket`` methods.

A model that also adds an absolute position table (``position_biased_input=True``, the config class's default;
v3 turns it off) is refused: the table stops it at ``max_position_embeddings`` tokens whatever its relative
positions do.
A model without relative attention has nothing for these methods.
"""

from __future__ import annotations

from torch import nn

from rope_ext.installers.base import Sites
from rope_ext.installers.buckets import LogBucketSite
from rope_ext.families.base import OwnerFamily, register_family


class DebertaV2Family(OwnerFamily):
    name = "deberta_v2"
    site_kinds = frozenset({LogBucketSite.kind})
    causal = False
    owner_module = "transformers.models.deberta_v2.modeling_deberta_v2"
    owner_class = "DebertaV2Encoder"

    def locate(self, model: nn.Module) -> Sites:
        encoder = self.owner(model)
        config = self.whole_model_config(model)
        if not encoder.relative_attention:
            raise ValueError(f"{self.name}: this model has no relative attention (relative_attention=False)")
        layers = [m for m in encoder.modules() if hasattr(m, "pos_att_type")]
        if layers and not any(layers[0].pos_att_type):
            raise ValueError(
                f"{self.name}: this model's attention reads no relative positions (pos_att_type is empty; "
                "'c2p' and 'p2c' read them)"
            )
        if getattr(config, "position_biased_input", False):
            raise ValueError(
                f"{self.name}: this model adds an absolute position table too (position_biased_input=True, "
                f"{config.max_position_embeddings} rows), which stops it at {config.max_position_embeddings} tokens; "
                "the log-bucket methods extend relative positions only (DeBERTa-v3 configs have no table)"
            )
        return Sites(config, {LogBucketSite.kind: [LogBucketSite(self.name, encoder)]}, model)


register_family(DebertaV2Family())
