"""Per-token negative log-likelihood from one forward pass, and perplexity of a token range.

Because attention is causal, one forward over ``L`` tokens gives every shorter prefix's per-token losses
too, for methods whose frequencies do not depend on the total length (not the dynamic ones).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def token_nll(model: nn.Module, input_ids: torch.Tensor, start: int = 1) -> torch.Tensor:
    """NLL of tokens ``start .. L-1`` of ``input_ids [1, L]`` (each predicted from all tokens before it).

    Only the logits that are scored are computed (``logits_to_keep``), which saves the
    ``L x vocab`` output projection for the context part.
    """
    length = input_ids.shape[-1]
    if not 1 <= start < length:
        raise ValueError(f"start must be in [1, {length - 1}], got {start}")
    keep = length - start + 1  # logits at positions start-1 .. L-1
    logits = model(input_ids=input_ids, logits_to_keep=keep, use_cache=False).logits[0, :-1]  # [n, vocab]
    targets = input_ids[0, start:]  # [n]
    return F.cross_entropy(logits.float(), targets, reduction="none")


@dataclass
class TailRecord:
    """Perplexity of the tokens after ``start`` in one document of ``length`` tokens."""

    method: dict[str, Any] | None
    document: str
    length: int
    start: int
    tokens_scored: int
    mean_nll: float
    perplexity: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tail_perplexity(
    model: nn.Module, input_ids: torch.Tensor, start: int, document: str = "", method: dict | None = None
) -> TailRecord:
    began = time.perf_counter()
    nll = token_nll(model, input_ids, start)
    mean = float(nll.mean())
    return TailRecord(
        method=method,
        document=document,
        length=int(input_ids.shape[-1]),
        start=start,
        tokens_scored=int(nll.numel()),
        mean_nll=mean,
        perplexity=math.exp(mean),
        seconds=time.perf_counter() - began,
    )
