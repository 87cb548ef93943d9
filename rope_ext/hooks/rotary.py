"""The frequency hook: a drop-in for a family's shared ``rotary_emb`` module.

It keeps transformers' contract -- ``forward(x, position_ids[, layer_type]) -> (cos, sin)`` with
``cos = cat(freqs, freqs).cos() * attention_factor`` -- and takes its ``(inv_freq, attention_factor)``
from a frequency method. Static methods compute them once (a non-persistent buffer, so state dicts are
unchanged); dynamic ones recompute from the current length ``max(position_ids) + 1`` on every call,
with no hidden cache, so a forward's result depends only on its inputs. Layer types the patch does not
cover (Gemma 3's sliding-window layers by default) go to the original module, kept as ``.original``.
"""

from __future__ import annotations

import torch
from torch import nn

from rope_ext.methods.frequency import FrequencyConfig, RotarySpec


def _buffer_name(layer_type: str | None) -> str:
    return "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"


class RopeExtRotaryEmbedding(nn.Module):
    def __init__(
        self,
        original: nn.Module,
        method: FrequencyConfig,
        specs: dict[str | None, RotarySpec],
    ) -> None:
        super().__init__()
        self.original = original
        self.method = method
        self.specs = specs
        self.config = getattr(original, "config", None)
        device = next((b.device for b in original.buffers()), None)
        self.attention_scaling: dict[str | None, float] = {}
        for layer_type, spec in specs.items():
            method.check_spec(spec)
            if method.dynamic:
                continue  # recomputed on every call
            inv_freq, attention_factor = method.frequencies(spec, None, device=device)
            self.register_buffer(_buffer_name(layer_type), inv_freq, persistent=False)  # [d/2]
            self.attention_scaling[layer_type] = attention_factor

    def frequencies(
        self, position_ids: torch.Tensor, layer_type: str | None, device: torch.device
    ) -> tuple[torch.Tensor, float]:
        """``(inv_freq [d/2], attention_factor)`` in effect for this call."""
        if self.method.dynamic:
            seq_len = int(position_ids.max()) + 1
            return self.method.frequencies(self.specs[layer_type], seq_len, device=device)
        return getattr(self, _buffer_name(layer_type)), self.attention_scaling[layer_type]

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_type not in self.specs:
            if layer_type is None:
                return self.original(x, position_ids)
            return self.original(x, position_ids, layer_type)
        inv_freq, attention_factor = self.frequencies(position_ids, layer_type, x.device)
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)  # [b, q, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, q, d]
        cos = emb.cos() * attention_factor
        sin = emb.sin() * attention_factor
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        layer_types = [lt for lt in self.specs if lt is not None]
        suffix = f", layer_types={layer_types}" if layer_types else ""
        return f"method={self.method.method}{suffix}"
