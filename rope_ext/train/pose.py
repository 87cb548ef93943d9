"""PoSE: positional skip-wise training (Zhu et al. 2024, arXiv:2309.10400; dwzhu-pku/PoSE ``train_pose.py``,
``train_preprocess_function_pose``).

A training window of ``W`` tokens is split into two chunks whose position ids skip ahead, so a short window
teaches the positions of a long target context ``T``: the first chunk is ``1..ceil(W/2)`` tokens long (uniform) at
positions ``0..``; the second chunk takes the rest of the window and starts ``s`` positions later, ``s`` uniform in
``0..T - W``. Every id is below ``T``; ids increase, with one jump.

Beware transformers' packed-sequence detection: with no attention mask and no cache (a training step),
``create_causal_mask`` reads any jump in ``position_ids`` as the start of a new packed sequence and masks the
second chunk off the first (``masking_utils.find_packed_sequence_indices``). ``pose_batch`` therefore passes an
all-ones ``attention_mask`` (as the reference's collator does, ``input_ids != pad``), which turns that detection
off; rope_ext's own attention never reads jumps as packing.
"""

from __future__ import annotations

import torch


def pose_position_ids(window: int, target: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[window]`` position ids for one PoSE training window aimed at ``target`` positions (int64)."""
    for name, value in (("window", window), ("target", target)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"pose: {name} must be an int, got {value!r}")
    if window < 2:
        raise ValueError(f"pose: window must be >= 2 tokens (two chunks), got {window}")
    if target < window:
        raise ValueError(f"pose: target={target} must be at least the window ({window}); valid: {window}..")
    first = int(torch.randint(1, (window + 1) // 2 + 1, (), generator=generator))  # the first chunk's length
    skip = int(torch.randint(0, target - window + 1, (), generator=generator))  # how far the second chunk jumps
    ids = torch.arange(window)
    ids[first:] += skip
    return ids


def pose_batch(input_ids: torch.Tensor, target: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """A PoSE training batch for ``input_ids [b, W]``: each row its own position ids (``pose_position_ids``), an
    all-ones attention mask (see the module's note), and the labels (the inputs)."""
    if input_ids.dim() != 2:
        raise ValueError(f"pose: input_ids must be [batch, window], got shape {tuple(input_ids.shape)}")
    batch, window = input_ids.shape
    positions = torch.stack([pose_position_ids(window, target, generator) for _ in range(batch)])
    return {
        "input_ids": input_ids,
        "position_ids": positions.to(input_ids.device),
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids,
    }
