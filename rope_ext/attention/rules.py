"""The position-rule kernel: RoPE's scores evaluated at remapped positions, on unrotated queries and keys.

A position rule keeps RoPE's scores but evaluates them at remapped positions; every rule is, region by region,
``(query rotated at one position) . (key rotated at another)``, so each region is an exact attention call on
rotated copies and the regions merge through their log-sum-exp (``merge.Accumulator``), never ``n x n``.

Which path a row group takes is decided in one place, ``run_rule``:

* rows whose positions are the keys' own (``0..m-1``, the common case) take the *fast runner* registered for the
  rule's class or its nearest base class (``register_fast_runner``; ``fast_runner_for`` walks the class's MRO):
  region kernels over index ranges, with the rotated keys kept on the cache while decoding (``key_cache``).
  Registered here: plain RoPE (``type(None)``), ``WindowConfig`` (every window rule) and ``DualChunkConfig``;
* other rows (``position_ids`` with jumps, offsets), and every row of a rule whose class has no fast runner, take
  the *general path* (``blocks.masked_blocks``): the rule's ``regions()`` as explicitly masked calls over query
  blocks. It is exact, only slower: a new rule runs correctly before it has a runner of its own.

Biases are added block by block (``Bias.bias(q_pos, k_pos)``), query scales multiply the queries first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import rope_ext.attention.blocks as blocks
import rope_ext.attention.kernels as kernels
from rope_ext.attention.key_cache import NOWHERE, KeyRotation, shared_tables
from rope_ext.attention.program import Bias, Call, Kernel, PositionRule, RowGroup, register_kernel
from rope_ext.methods.dual_chunk import DualChunkConfig
from rope_ext.methods.position_rules import WindowConfig, plain_regions, same_position
from rope_ext.methods.rope import rotate_at_zero

#: ``runner(acc, rule, q, k, v, scale, q_pos, keys, bias, far_limit)``: a rule's attention over rows at positions
#: ``0..m-1`` (queries the last ``n`` keys), merged into ``acc``
FastRunner = Callable[..., None]
#: the fast runner of each rule class (``type(None)``: plain RoPE), by ``register_fast_runner``
FAST_RUNNERS: dict[type, FastRunner] = {}


def register_fast_runner(rule_class: type, runner: FastRunner | None = None) -> Any:
    """Make ``runner`` the fast runner of the rules of ``rule_class`` and of its subclasses (a subclass may register
    its own, which then wins: the lookup walks the class's MRO). Usable as a decorator,
    ``@register_fast_runner(MyRule)``. A class without one along its MRO runs on the general path."""

    def register(run: FastRunner) -> FastRunner:
        if rule_class in FAST_RUNNERS:
            raise ValueError(f"a fast runner for {rule_class.__name__} is registered already")
        FAST_RUNNERS[rule_class] = run
        return run

    return register if runner is None else register(runner)


def unregister_fast_runner(rule_class: type) -> None:
    if rule_class not in FAST_RUNNERS:
        raise ValueError(f"no fast runner is registered for {rule_class.__name__}")
    del FAST_RUNNERS[rule_class]


def fast_runner_for(rule: Any) -> FastRunner | None:
    """The fast runner registered for ``rule``'s class or its nearest base class (``rule=None``: plain RoPE's);
    ``None`` when none is: every row of the rule then runs on the general path (``run_rule``)."""
    for cls in type(rule).__mro__:
        runner = FAST_RUNNERS.get(cls)
        if runner is not None:
            return runner
    return None


def run_rule(call: Call) -> torch.Tensor:
    """A program with a position rule: per row group, the fast runner of the rule's class (``fast_runner_for``) for
    rows at positions ``0..m-1``; the general path (its ``regions()`` as masked calls) for other rows, and for every
    row when no fast runner is registered along the rule's MRO."""
    term = call.program.position_rule
    device = call.q.device
    inv_freq, attention_factor = term.frequencies(call.position_ids, call.k.shape[2], device)
    bias = blocks.bias_function(call)
    far_limit = None if call.sliding_window is None else call.sliding_window - 1
    fast = fast_runner_for(term.config)  # (None: no runner for this rule's class, the general path)
    shared = None if torch.is_grad_enabled() else shared_tables(call.position_ids, inv_freq, attention_factor)

    def attend(group: RowGroup) -> torch.Tensor:
        q, k, v = blocks.scaled_queries(call, group), group.k, group.v
        acc = blocks.accumulator_for(call, q, k, v, bias)
        if group.contiguous and fast is not None:
            keys = KeyRotation(term, group.keep, inv_freq, attention_factor, shared)
            fast(acc, term.config, q, k, v, call.scale, group.q_pos, keys, bias, far_limit)
        else:
            regions = [(r.allowed, r.query, r.key) for r in _regions(term.config)]
            rotation = KeyRotation(term, NOWHERE, inv_freq, attention_factor)
            blocks.masked_blocks(acc, q, k, v, call.scale, group, regions, bias, far_limit, rotation)
        return acc.out.to(q.dtype)

    return call.run_rows(attend)


def _regions(rule):
    return plain_regions() if rule is None else rule.regions()


# --- fast runners (rows at positions 0..m-1) ------------------------------------------------------------


@register_fast_runner(type(None))
def plain_rope(acc, rule, q, k, v, scale, q_pos, keys: KeyRotation, bias, far_limit=None) -> None:
    """Plain RoPE rotated here: the queries at their positions over the keys at theirs (kept while decoding),
    within the layer's sliding window (``far_limit`` keys back) if it has one."""
    m, n = k.shape[2], q.shape[2]
    q0 = m - n
    start = 0 if far_limit is None else max(0, q0 - far_limit)
    k_std = keys.at("position", k, same_position, first=start)
    block = n if bias is None else kernels.query_block(q)
    for a in range(0, n, block):
        b = min(n, a + block)
        q_std = keys.rotate(q[:, :, a:b], q_pos[a:b], ("position", q0 + a, q0 + b))
        kernels.region(
            acc, q_std, k_std, v[:, :, start:], scale, q0 + a, 0, far_limit, start, kernels.TILE, out_offset=a, bias=bias
        )


@register_fast_runner(WindowConfig)
def window(acc, method: WindowConfig, q, k, v, scale, q_pos, keys: KeyRotation, bias, far_limit=None) -> None:
    """Plain RoPE for the ``w`` nearest keys (a band), the far rotation beyond (``i - j >= w``)."""
    m, n = k.shape[2], q.shape[2]
    q0 = m - n
    w = method.window
    inv_freq, attention_factor = keys.inv_freq, keys.attention_factor
    band_start = max(0, q0 - w + 1)  # the band needs only the last keys (decode rotates w of them)
    far_keys = m - w  # keys 0..m-w-1 can be w or more behind the last query
    if method.far_key_is_position and far_keys > 0:
        k_std = keys.at("position", k, same_position)
        k_band = k_std[:, :, band_start:]
    else:
        k_std = None
        k_band = keys.at("position", k, same_position, first=band_start)
    block = kernels.query_block(q)  # (in blocks: one block's rotated queries at a time)
    for a in range(0, n, block):
        b = min(n, a + block)
        q_std = keys.rotate(q[:, :, a:b], q_pos[a:b], ("position", q0 + a, q0 + b))
        kernels.region(
            acc, q_std, k_band, v[:, :, band_start:], scale, q0 + a, 0, w - 1, band_start, kernels.TILE,
            out_offset=a, bias=bias,
        )
        del q_std
    del k_band
    if far_keys <= 0 or m - 1 < w:  # (the last query is at m - 1)
        return
    if k_std is not None:
        k_far = k_std[:, :, :far_keys]
    elif method.far_key_is_zero:
        k_far = rotate_at_zero(k[:, :, :far_keys], inv_freq, attention_factor)
    else:
        k_far = keys.at(("far", method), k[:, :, :far_keys], method.far_key)
    first = max(0, w - q0)  # queries before position w have no far keys
    for a in range(first, n, block):  # (one block's rotated queries and output at a time)
        b = min(n, a + block)
        q_far = keys.rotate(q[:, :, a:b], lambda: method.far_query(q_pos[a:b]), (("far", method), q0 + a, q0 + b))
        kernels.region(acc, q_far, k_far, v[:, :, :far_keys], scale, q0 + a, w, None, out_offset=a, bias=bias)
        del q_far


@register_fast_runner(DualChunkConfig)
def dual_chunk(acc, method: DualChunkConfig, q, k, v, scale, q_pos, keys: KeyRotation, bias, far_limit=None) -> None:
    """Keys at ``j mod s``; a query at ``i mod s`` in its own chunk, at ``min(i mod s + s, chunk_size)`` over the
    previous one, at ``chunk_size`` over older ones: one chunk's queries at a time."""
    m, n = k.shape[2], q.shape[2]
    q0 = m - n
    s, size = method.chunk, method.chunk_size
    k_rot = keys.at(("chunk", method), k, lambda j: torch.remainder(j, s))
    a = 0
    while a < n:  # (rotated per chunk: one chunk's copies at a time)
        p0 = q0 + a
        start = (p0 // s) * s  # their chunk
        b = min(n, start + s - q0)
        qc, within = q[:, :, a:b], torch.remainder(q_pos[a:b], s)
        span = slice(start, q0 + b)
        q_intra = keys.rotate(qc, within, (("chunk", method), q0 + a, q0 + b))
        kernels.region(acc, q_intra, k_rot[:, :, span], v[:, :, span], scale, p0, 0, None, start, out_offset=a, bias=bias)
        del q_intra
        for name, span, query in (
            ("previous", slice(start - s, start), lambda: torch.clamp(within + s, max=size)) if start >= s else (0, 0, 0),
            ("older", slice(0, start - s), lambda: torch.full_like(within, float(size))) if start >= 2 * s else (0, 0, 0),
        ):
            if not span:
                continue
            keys_at = torch.arange(span.start, span.stop, device=q.device, dtype=torch.float32)
            block_bias = None if bias is None else bias(q_pos[a:b], keys_at)
            q_other = keys.rotate(qc, query, ((name, method), q0 + a, q0 + b))
            acc.attend(a, b, q_other, k_rot[:, :, span], v[:, :, span], scale, span.start, bias=block_bias)
            del q_other
        a = b


RULE_KERNEL = register_kernel(
    Kernel("position-rule regions", PositionRule, run_rule, rank=20, handles=(PositionRule, Bias))
)
