"""Retrieval trials that share their prompt's beginning (the same task text and haystack up to the needle, at one
length and depth) reuse its keys and values through the KV cache: the previous prompt's cache cut back to the tokens
both prompts share (``DynamicCache.crop``), and only the rest computed. Exact where the method's cache is (rope_ext
tests every method's cached generation against the full forward), and only for methods whose frequencies do not
follow the current length (a dynamic method's prefix would keep the frequencies of the previous, longer prompt).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: the fewest shared tokens worth reusing (below it the prompt runs whole)
MIN_SHARED = 64
#: the least share of the prompt worth reusing: the rest then runs with an explicit mask (its queries start past the
#: cache), which SDPA's causal kernel cannot take; on the 2-core CPU a 16k prompt reusing its first 10% took 130 s
#: against 90 s whole, a 32k one reusing half 262 s against 297 s, reusing 90% 54 s (the default model, float32):
#: even at about 40% (below half, so that a key at depth 0.5 is reused whatever the task text's length)
MIN_SHARED_FRACTION = 0.4


class PrefixCache:
    """The last prompt's token ids and the cache it left (``enabled=False``: every prompt runs whole)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.ids: torch.Tensor | None = None
        self.cache: Any = None

    def shared(self, ids: torch.Tensor) -> int:
        """How many leading tokens ``ids [1, n]`` shares with the last prompt (at most ``n - 1``: one token is always
        computed, the one whose logits start the answer); 0 below ``MIN_SHARED`` tokens or ``MIN_SHARED_FRACTION``
        of the prompt."""
        if not self.enabled or self.ids is None or self.cache is None:
            return 0
        n = min(self.ids.shape[-1], ids.shape[-1] - 1)
        same = (self.ids[0, :n] == ids[0, :n].to(self.ids.device)).to(torch.int64)
        count = int(same.cumprod(0).sum()) if n > 0 else 0
        return count if count >= max(MIN_SHARED, MIN_SHARED_FRACTION * ids.shape[-1]) else 0

    @torch.no_grad()
    def generate(self, model: nn.Module, ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, int]:
        """``model.generate(ids, ...)`` with the shared beginning's cache reused; ``(output ids, tokens reused)``."""
        from transformers import DynamicCache

        if not self.enabled:
            return model.generate(ids, **kwargs), 0
        reused, cache = self.shared(ids), None
        if reused:
            try:  # (transformers 5 crops by the count of tokens removed, given negative)
                extra = self.cache.get_seq_length() - reused
                if extra > 0:
                    self.cache.crop(-extra)
                cache = self.cache
            except (RuntimeError, ValueError):  # (a sliding-window layer past its window keeps no past: run whole)
                reused = 0
        if cache is None:
            cache = DynamicCache(config=model.config)
        out = model.generate(ids, past_key_values=cache, **kwargs)
        self.ids, self.cache = ids.detach().clone(), cache
        return out, reused


@torch.no_grad()
def greedy_answer(model: nn.Module, tokenizer: Any, ids: torch.Tensor, max_new_tokens: int,
                  prefix: PrefixCache | None = None) -> tuple[str, int]:
    """The model's greedy continuation of ``ids [1, n]`` (at most ``max_new_tokens`` tokens, decoded) and the tokens
    of its beginning reused from ``prefix``'s last prompt (none without one)."""
    ids = ids.to(next(model.parameters()).device)
    out, reused = (prefix or PrefixCache(enabled=False)).generate(
        model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[-1]:], skip_special_tokens=True), reused
