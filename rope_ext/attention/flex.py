"""A bias of the distance alone as one fused attention call on CUDA: ``torch``'s flex attention with the bias as a
score modification.

On CUDA every call of the blockwise path costs tens of microseconds of launches, whatever its size: ALiBi's far
blocks and causal squares (``plain._key_bias_blocks``, about 150 calls a layer at 16k) took 72 times SDPA's time on
an H200, and a bias written out per block costs memory the size of the scores. A bias that depends on ``i - j``
alone (``Bias.of_distance``: ALiBi, KERPLE, Sandwich) is instead read from one table of its values at every
distance, ``table[h, i - j]`` (``n`` values a head: the bias at the last query over every key), and added to the
float32 scores inside the kernel (``flex_attention``'s ``score_mod``, compiled by ``torch.compile`` into one
Triton kernel), under a causal block mask: one call a layer, no bias in memory, the bias never rounded to the
call's dtype. Inference on rows at positions ``0..m-1`` only (the queries the last ``n`` keys, no sliding window);
everything else keeps the blockwise path.

A bias that is a closed form of the distance ``d = i - j`` (its ``distance_form``, ``FORMS``: ALiBi's ``-s_h d``)
is computed from the distance in the kernel instead: the table's float32 values (the compiled kernel may fuse the
multiply and subtract into one rounding), with no gather from memory per score. KERPLE's ``-r1_h log(1 + r2_h d)``
computed so was slower than its table on an H200 (the op at 16k 3.94x SDPA against 3.71x, 4.49x against 3.52x with
one stage: a logarithm per score costs more than the gather; ``docs/results/cuda/h200_third``): KERPLE and
Sandwich read their table.

The first call compiles (seconds) for its shape; a call of another shape compiles once more, for every shape
(``DYNAMIC``; the causal offset is a tensor). Where the
compiled call fails, a warning says so and the blockwise path runs from then on for that dtype, head size and
form (a closed form's name or ``"table"``: a failed closed form falls back to the table first).
``COMPILE = False`` runs the same function uncompiled (tests on the CPU: flex attention's own eager implementation,
which writes out the scores).
"""

from __future__ import annotations

import functools
import warnings

import torch

#: run flex attention through ``torch.compile`` (False: its eager implementation, for tests on small inputs)
COMPILE = True
#: ``torch.compile``'s ``dynamic``: ``None`` compiles the first shape static and, once a shape changes, one kernel for
#: every length (on an H200 at 16k, bf16: the whole model with ALiBi 1.53x SDPA static, 2.06x dynamic,
#: ``docs/results/cuda/h200_second/run1/flex_configs.json``); ``True`` dynamic from the start; ``False`` one
#: compile per shape
DYNAMIC: bool | None = None
#: a bias of the distance that is a closed form (``FORMS``) computed in the kernel (False: read from its table)
CLOSED_FORMS = True
#: the closed forms of the distance ``d`` a kernel computes, ``(a, b) [h]`` per head: ALiBi's ``-a d``
FORMS = ("linear",)
#: ``(dtype, head size, form)`` whose compiled call failed in this process, form one of ``FORMS`` or ``"table"``
#: (the blockwise path runs for them instead; on an H200 flex's default options compiled the one and not the other)
FAILED: set[tuple[torch.dtype, int, str]] = set()
#: flex attention's ``kernel_options``: with its defaults the default model's shape (bf16, head size 64) did not
#: compile on an H200 (the kernel asked for 240 KiB of shared memory, the chip has 227); of the options tried there
#: (``docs/results/cuda/flex_configs.json``) these compiled and ran fastest
KERNEL_OPTIONS: dict | None = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4}
#: a form's own options where they differ: on an H200 (bf16, 16k, static shapes) two stages ran ALiBi's closed form
#: 7% faster at the op (2.10x SDPA against 2.26x) and 5% faster in the whole model (1.46x against 1.53x at 16k, 1.59x
#: against 1.69x at 32k), and the table 5% slower (3.71x against 3.52x; ``docs/results/cuda/h200_third``)
FORM_OPTIONS: dict[str, dict] = {"linear": {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4}}


def available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused call runs here: CUDA, no gradients, one head size (a power of two, 16 to 256) for queries,
    keys and values, half or single precision, torch's flex attention importable with Triton, and no compile of it
    failed in this process for that dtype and head size in both forms."""
    if q.device.type != "cuda" or {(q.dtype, q.shape[-1], form) for form in (*FORMS, "table")} <= FAILED:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    d = q.shape[-1]
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return False
    return k.shape[-1] == v.shape[-1] == d and 16 <= d <= 256 and d & (d - 1) == 0 and _with_triton()


@functools.lru_cache(maxsize=None)
def _with_triton() -> bool:
    """Whether flex attention and Triton (which ``torch.compile`` writes its kernel in) are importable."""
    try:
        import triton  # noqa: F401
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex():
    """``(flex_attention, create_block_mask)``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_attention, create_block_mask


@functools.lru_cache(maxsize=None)
def _compiled():
    flex_attention, _ = _flex()
    return torch.compile(flex_attention, dynamic=DYNAMIC)


@functools.lru_cache(maxsize=16)
def _causal_mask(n: int, m: int, device: torch.device):
    """Query ``a`` (at position ``m - n + a``) sees the keys ``0..m - n + a``: the bottom-right causal rule (the
    offset a tensor, so that the compiled call does not specialise on it)."""
    _, create_block_mask = _flex()
    offset = torch.tensor(m - n, device=device)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(causal, None, None, n, m, device=device), offset


def distance_table(bias, m: int, device: torch.device, heads: int) -> torch.Tensor:
    """``[heads, m]`` float32: entry ``d`` the bias at distance ``d`` (the bias of a query at ``m - 1`` over the keys
    ``m - 1 - d``), from ``bias(i, j) -> [h or 1, n, m]`` of a bias of the distance alone."""
    last = torch.full((1,), float(m - 1), device=device)
    row = bias(last, torch.arange(m, device=device, dtype=torch.float32))[:, 0]  # [h or 1, m], keys 0..m-1
    return row.flip(-1).float().expand(heads, m).contiguous()


def closed_form(terms, device: torch.device, heads: int) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """``(form, a [heads], b [heads] or None)`` float32 where the one bias term is a closed form of the distance
    (its ``distance_form``: ALiBi's ``("linear", slopes, None)``), else
    ``None`` (several terms, whose sum the table holds as the blockwise path adds it; or ``CLOSED_FORMS`` off)."""
    if not CLOSED_FORMS or len(terms) != 1:
        return None
    form = terms[0].distance_form(device)
    if form is None:
        return None
    name, a, b = form
    return name, *(None if t is None else t.float().expand(heads).contiguous() for t in (a, b))


def _score_mod(table: torch.Tensor | None, form, offset: torch.Tensor):
    """The score modification adding the bias at distance ``q_idx + offset - kv_idx`` (pairs the mask drops are
    read at distance 0: never outside the table)."""
    if form is None:
        def from_table(score, b, h, q_idx, kv_idx):
            return score + table[h, torch.clamp(q_idx + offset - kv_idx, min=0)]

        return from_table
    _, a, _ = form

    def linear(score, b, h, q_idx, kv_idx):  # (the same float32 product as the table's, -s * d)
        return score - a[h] * (q_idx + offset - kv_idx)

    return linear


def distance_biased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    table: torch.Tensor | None = None, form: tuple | None = None):
    """Causal attention of ``q [b, h, n, d]`` (the last ``n`` of the ``m`` keys) over ``k, v [b, hk, m, d]`` (GQA
    heads as they are) with ``table[h, i - j]`` (or a closed ``form`` of ``i - j``, one of the two) added to each
    scaled score -> ``[b, h, n, d]`` in ``q``'s dtype; ``None`` where the compiled call fails here (then
    this form returns ``None`` for the rest of the process at this dtype and head size, after one warning: the
    caller's table form or blockwise path runs)."""
    if (table is None) == (form is None):
        raise ValueError("flex.distance_biased takes a bias table or a closed form, one of the two")
    if form is not None and form[0] not in FORMS:
        raise ValueError(f"unknown closed form {form[0]!r} of the distance; valid forms: {', '.join(FORMS)}")
    failure = (q.dtype, q.shape[-1], "table" if form is None else form[0])
    if failure in FAILED:
        return None
    block_mask, offset = _causal_mask(q.shape[2], k.shape[2], q.device)
    score_mod = _score_mod(table, form, offset)

    flex_attention, _ = _flex()
    groups = q.shape[1] // k.shape[1]
    if not COMPILE:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=groups > 1)
    try:
        return _compiled()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=groups > 1,
                           kernel_options=FORM_OPTIONS.get(failure[2], KERNEL_OPTIONS))
    except Exception as error:  # (torch.compile's errors have no common class)
        FAILED.add(failure)
        warnings.warn(f"rope_ext: the fused bias attention (flex attention through torch.compile) failed here "
                      f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); biases in "
                      f"{str(q.dtype).removeprefix('torch.')} with head size {q.shape[-1]} (read from "
                      f"{'a table' if form is None else 'its ' + form[0] + ' form'}) run another way from now on",
                      RuntimeWarning, stacklevel=2)
        return None
