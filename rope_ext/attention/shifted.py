"""Shifted sparse attention (S2-Attn, LongLoRA) as a ``Wrapper`` term: the call regrouped, run by the kernel inside.

On a training forward, ``ShiftedGroups.wrap`` cuts the sequence into groups of ``g`` tokens (``g`` from the method's
``group_size_ratio``) and hands the kernel one call whose batch is every group of every row: plain causal attention
on ``[b * G, h, g, d]`` is causal attention within each group. The shifted heads (``h//2..h-1``) are rolled by
``-s`` (``s = g // 2``) first and rolled back after, as LongLoRA's code does; their first ``s`` tokens, which the
roll puts in a group after the last tokens, are then recomputed alone (a second, ``s``-token call), so that no token
sees a later one (the groups of LongLoRA's flash-attention path: ``[0, s), [s, s + g), ..., [n - g + s, n)``).
Formula and options: ``rope_ext.methods.wrappers.S2AttnConfig``.

Keys and values stay grouped-query where the split of the heads falls between key heads (``h//2`` a multiple of
``h / h_kv``), else they are repeated to the query heads first, as LongLoRA's ``repeat_kv`` does. Outside training
(``module.training`` false) the call runs unchanged: full attention.

Pure torch: nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rope_ext.attention.program import Bias, Call, PositionRule, QueryScale, Wrapper
from rope_ext.methods.wrappers import s2_group_size


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[b, heads, n, d]`` -> ``[b * n/g, heads, g, d]``: each group of ``g`` tokens its own row."""
    b, heads, n, d = x.shape
    return x.reshape(b, heads, n // g, g, d).transpose(1, 2).reshape(b * (n // g), heads, g, d)


def _ungrouped(x: torch.Tensor, b: int) -> torch.Tensor:
    """``[b * G, heads, g, d]`` -> ``[b, heads, G * g, d]`` (``_grouped`` undone)."""
    rows, heads, g, d = x.shape
    groups = rows // b
    return x.reshape(b, groups, heads, g, d).transpose(1, 2).reshape(b, heads, groups * g, d)


@dataclass(eq=False)
class ShiftedGroups(Wrapper):
    """S2-Attn around a layer's kernel (``method``: an ``S2AttnConfig``); training forwards only."""

    method: Any
    name: ClassVar[str] = "s2_attn"

    def describe(self) -> str:
        return f"s2_attn(group_size_ratio={self.method.group_size_ratio}, shift={self.method.shift}; in training)"

    def wrap(self, call: Call, inner: Callable[[Call], torch.Tensor]) -> torch.Tensor:
        if not getattr(call.module, "training", False):
            return inner(call)  # inference: full attention
        q, k, v = call.q, call.k, call.v
        b, h, n, _ = q.shape
        hk, m = k.shape[1], k.shape[2]
        self._check(call, n, m)
        g = s2_group_size(n, self.method.group_size_ratio)
        if g >= n:
            return inner(call)  # one group: full attention (a shift would only split it)
        s = g // 2 if self.method.shift else 0

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # causal by index within each row: no positions, padding or cache link inside a group
            return inner(call.replace(q=q, k=k, v=v, rows=None, position_ids=None, link=None))

        if s == 0:  # (no shift, or groups of one token)
            return _ungrouped(run(_grouped(q, g), _grouped(k, g), _grouped(v, g)), b)  # [b, h, n, dv]
        half = h // 2  # heads 0..half-1 keep their groups, half..h-1 are shifted (LongLoRA: num_heads // 2)
        per_key = h // hk
        if half % per_key == 0:  # the split falls between key heads: keys stay grouped-query
            k_all, v_all, split = k, v, half // per_key
        else:
            k_all, v_all, split = k.repeat_interleave(per_key, dim=1), v.repeat_interleave(per_key, dim=1), half

        def rolled(x: torch.Tensor, first: int) -> torch.Tensor:  # heads first.. rolled by -s along the tokens
            return torch.cat([x[:, :first], x[:, first:].roll(-s, dims=2)], dim=1)

        out = _ungrouped(
            run(_grouped(rolled(q, half), g), _grouped(rolled(k_all, split), g), _grouped(rolled(v_all, split), g)), b
        )  # [b, h, n, dv]; heads half.. in rolled order (index i is token i + s)
        head = run(q[:, half:, :s], k_all[:, split:, :s], v_all[:, split:, :s])  # [b, h - half, s, dv]: [0, s) alone
        shifted = torch.cat([head, out[:, half:, : n - s]], dim=2)  # rolled back, the first s tokens recomputed
        return torch.cat([out[:, :half], shifted], dim=1)  # [b, h, n, dv]

    def _check(self, call: Call, n: int, m: int) -> None:
        if n != m:
            raise ValueError(
                f"s2_attn groups the tokens of a training forward, but this call continues a KV cache ({n} new "
                f"queries over {m} keys); generate in eval mode (model.eval()), where S2-Attn is full attention, or "
                "train without a cache (use_cache=False)"
            )
        if call.rows is not None:
            raise ValueError(
                "s2_attn got a padding mask on a training forward: its groups cut every row at the same places, so "
                "training batches must be unpadded (sequences packed or cut to one length, a multiple of the group "
                "size; an all-ones attention_mask is fine)"
            )
        others = [t.name for t in call.program.terms if isinstance(t, (PositionRule, QueryScale, Bias))]
        if others:
            raise ValueError(
                f"s2_attn cannot run with {', '.join(others)} in one layer: its groups lose the tokens' positions those "
                "terms need"
            )
