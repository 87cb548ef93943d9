"""Perplexity against context length, three protocols, each returning plain records.

* ``fixed`` -- fixed targets: the same last ``target_tokens`` tokens of a document's first ``E`` tokens,
  scored with a growing context ``L`` (input = the ``L`` tokens ending there). ``E`` is the longest
  length of the run the document provides: fixed by the document and the run's length list, never by
  which records a resumed run already has. An ideal model never gets worse with more context; the
  README's headline protocol.
* ``curve`` -- position curve: one forward over the first ``max(lengths)`` tokens, per-token losses
  averaged over the buckets ``(L_prev, L]``. Causal attention makes one forward serve every length for
  static methods; methods whose frequencies depend on the total length (``dynamic``) get one forward
  per length, scoring that length's bucket. The buckets come from the run's whole length list.
* ``sliding`` -- sliding window of ``L`` tokens moved by ``stride``, scoring only tokens no earlier
  window scored (the YaRN reference evaluation, and transformers' perplexity guide).
* ``masked-lm`` and ``span-corruption`` -- the fixed-target protocol for a masked LM (DeBERTa) and T5: the same
  tokens of the same last ``target_tokens`` masked, or the same spans corrupted, at every length, the context in
  front of them growing (``rope_ext.eval.objectives``).

Every record names the positions it scored, ``start .. end - 1``; records scoring different positions
are never averaged into one table (``summarize`` raises).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rope_ext.eval.data import Document
from rope_ext.eval.intervals import bootstrap, mean_nll_ppl, ppl_ratio
from rope_ext.eval.objectives import (
    CAUSAL_PROTOCOLS,
    FIXED_TARGET_PROTOCOLS,
    OBJECTIVE_PROTOCOLS,
    document_generator,
    model_protocols,
    objective_nll,
)
from rope_ext.runs.results import in_order
from rope_ext.runs.values import MAX_LENGTH, parse_length, parse_lengths  # noqa: F401  (the lengths of runs)

PROTOCOLS = (*CAUSAL_PROTOCOLS, *OBJECTIVE_PROTOCOLS)
def peak_memory_mb() -> float:
    """Peak memory so far: CUDA's allocator peak when on GPU, else this process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


@torch.no_grad()
def token_nll(model: nn.Module, input_ids: torch.Tensor, start: int = 1) -> torch.Tensor:
    """NLL of tokens ``start .. L-1`` of ``input_ids [1, L]``, each predicted from all tokens before it.

    Only the scored logits are computed (``logits_to_keep``), saving the ``L x vocab`` projection.
    """
    length = input_ids.shape[-1]
    if not 1 <= start < length:
        raise ValueError(f"start must be in [1, {length - 1}], got {start}")
    keep = length - start + 1  # logits at positions start-1 .. L-1
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), logits_to_keep=keep, use_cache=False).logits[0, :-1]  # [n, V]
    targets = input_ids[0, start:].to(device)  # [n]
    return F.cross_entropy(logits.float(), targets, reduction="none").cpu()


def fixed_target_nll(
    model: nn.Module, protocol: str, ids: torch.Tensor, target_tokens: int, tokenizer: Any = None,
    fingerprint: str | None = None,
) -> torch.Tensor:
    """Per-token NLL of the targets in the last ``target_tokens`` of ``ids [1, L]`` under a fixed-target protocol:
    ``fixed`` the next tokens; ``masked-lm`` / ``span-corruption`` the tokens the document's corruption picks there
    (drawn from its ``fingerprint``, the same at every length; the ``tokenizer`` gives the mask token and sentinels)."""
    if protocol == "fixed":
        return token_nll(model, ids, start=ids.shape[-1] - target_tokens)
    if tokenizer is None or fingerprint is None:
        raise ValueError(f"the {protocol} protocol needs the model's tokenizer and the document's fingerprint")
    return objective_nll(model, protocol, tokenizer, ids, target_tokens, document_generator(fingerprint))


@dataclass
class PerplexityRecord:
    method: str  # the spec as given, e.g. "yarn:factor=4", "dca+yarn:factor=4" or "none"
    config: list[dict[str, Any]]  # the method configs (to_dict), [] for the unpatched model
    protocol: str
    document: str
    length: int  # context length L (curve: the bucket's end)
    start: int  # first scored position in the document
    end: int  # one past the last scored position
    tokens_scored: int
    mean_nll: float
    perplexity: float
    seconds: float  # the forward(s) that produced it (curve, static: the one shared forward)
    peak_memory_mb: float  # CUDA allocator peak on GPU, else the process's peak RSS so far

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, found: dict[str, Any]) -> PerplexityRecord:
        """A record from its JSON line (the fields a record has; others, such as a later version's, left out)."""
        return cls(**{key: value for key, value in found.items() if key in cls.__dataclass_fields__})


def record_key(method: str, protocol: str, document: str, length: int) -> tuple:
    return (method, protocol, document, int(length))


def _record(method, config, protocol, document, length, span, nll: torch.Tensor, seconds) -> PerplexityRecord:
    start, end = span
    mean = float(nll.double().mean())
    return PerplexityRecord(
        method=method,
        config=config,
        protocol=protocol,
        document=document,
        length=int(length),
        start=int(start),
        end=int(end),
        tokens_scored=int(nll.numel()),
        mean_nll=mean,
        perplexity=math.exp(mean),
        seconds=seconds,
        peak_memory_mb=peak_memory_mb(),
    )


def usable_lengths(document: Document, lengths: list[int], protocol: str, target_tokens: int) -> list[int]:
    """The lengths this document can provide; the rest are skipped (reported by the caller), never padded."""
    if protocol in FIXED_TARGET_PROTOCOLS:
        return sorted(L for L in lengths if target_tokens < L <= document.num_tokens)
    return sorted(L for L in lengths if L <= document.num_tokens)


def target_spans(
    document: Document, lengths: list[int], protocol: str, target_tokens: int
) -> dict[int, tuple[int, int]]:
    """``{L: (start, end)}``: the positions ``start .. end - 1`` scored at each length the document provides.

    A function of the document and the run's whole length list only: fixed (and the objective protocols) -- the
    last ``target_tokens`` before the longest usable length; curve -- ``[previous usable length, L)`` (the first
    from 1); sliding -- the whole document.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; valid protocols: {', '.join(PROTOCOLS)}")
    usable = usable_lengths(document, lengths, protocol, target_tokens)
    if not usable:
        return {}
    if protocol in FIXED_TARGET_PROTOCOLS:
        return {L: (usable[-1] - target_tokens, usable[-1]) for L in usable}
    if protocol == "curve":
        return {hi: (lo, hi) for lo, hi in zip([1, *usable], usable)}
    return {L: (1, document.num_tokens) for L in usable}


def evaluate_document(
    model: nn.Module,
    document: Document,
    lengths: list[int],
    *,
    method: str = "none",
    config: list[dict[str, Any]] | None = None,
    dynamic: bool = False,
    protocol: str = "fixed",
    target_tokens: int = 1024,
    stride: int = 256,
    skip: Callable[[int], bool] = lambda length: False,
    tokenizer: Any = None,
) -> Iterator[PerplexityRecord]:
    """Records for one document under the model's current patch, lengths ascending.

    ``lengths`` is the run's whole length list (it decides the targets, see ``target_spans``); ``skip``
    only leaves out lengths already recorded. The objective protocols need the ``tokenizer`` (its mask token, T5's
    sentinels).
    """
    valid = model_protocols(model)
    if protocol not in valid:
        raise ValueError(f"a {type(model).__name__} is evaluated with protocol {' or '.join(valid)}, not {protocol!r}")
    spans = target_spans(document, lengths, protocol, target_tokens)
    todo = [L for L in spans if not skip(L)]
    if not todo:
        return
    ids = document.input_ids
    args = (method, [] if config is None else config, protocol, document.title)
    if protocol in FIXED_TARGET_PROTOCOLS:
        fingerprint = document.fingerprint() if protocol in OBJECTIVE_PROTOCOLS else None
        for length in todo:
            end = spans[length][1]
            began = time.perf_counter()
            nll = fixed_target_nll(model, protocol, ids[:, end - length : end], target_tokens, tokenizer, fingerprint)
            yield _record(*args, length, spans[length], nll, time.perf_counter() - began)
    elif protocol == "curve":
        if dynamic:
            for length in todo:
                start, end = spans[length]
                began = time.perf_counter()
                nll = token_nll(model, ids[:, :end], start=start)
                yield _record(*args, length, spans[length], nll, time.perf_counter() - began)
        else:
            began = time.perf_counter()
            nll = token_nll(model, ids[:, : max(todo)], start=1)  # nll[i] is position i + 1
            seconds = time.perf_counter() - began
            for length in todo:
                start, end = spans[length]
                yield _record(*args, length, spans[length], nll[start - 1 : end - 1], seconds)
    else:
        for length in todo:
            began = time.perf_counter()
            nll = sliding_window_nll(model, ids, length, stride)
            yield _record(*args, length, spans[length], nll, time.perf_counter() - began)


def sliding_window_nll(model: nn.Module, input_ids: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """Per-token NLL over the whole of ``input_ids``: windows of ``window`` tokens every ``stride``
    tokens, each scoring only the tokens the previous windows did not. A window's first token has no
    context inside it, so with ``stride == window`` it goes unscored (as in transformers' guide)."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    total = input_ids.shape[-1]
    pieces, scored_until = [], 1
    for begin in range(0, total, stride):
        end = min(begin + window, total)
        if end <= scored_until:
            continue
        pieces.append(token_nll(model, input_ids[:, begin:end], start=max(1, scored_until - begin)))
        scored_until = end
        if end == total:
            break
    return torch.cat(pieces)


def check_same_targets(records: list[PerplexityRecord]) -> None:
    """Raise unless records that share a table score the same positions: per document, one span for
    every length under the fixed-target protocols, and one span per length (for every method) otherwise."""
    spans: dict[tuple, set[tuple[int, int]]] = {}
    for r in records:
        fixed = r.protocol in FIXED_TARGET_PROTOCOLS
        where = (r.protocol, r.document) if fixed else (r.protocol, r.document, r.length)
        spans.setdefault(where, set()).add((r.start, r.end))
    for where, found in spans.items():
        if len(found) > 1:
            at = f" at length {where[2]}" if len(where) > 2 else ""
            scored = ", ".join(f"[{a}, {b})" for a, b in sorted(found))
            raise ValueError(
                f"{where[0]}-protocol records of document {where[1]!r}{at} score different positions ({scored}): "
                "they come from runs with different length lists and cannot share one table; "
                "re-run with --overwrite (or into another --out)"
            )


def paired(records: Iterable[PerplexityRecord], base: Iterable[PerplexityRecord]) -> dict[str, Any] | None:
    """``records``' perplexity over the documents ``base`` scored too, and its ratio to ``base``'s there, paired per
    document (each document's NLL on both sides resampled together: what the documents share cancels), with 95%
    bootstrap intervals: ``documents``, ``tokens_scored``, ``perplexity`` (``low``, ``high``), ``ratio``
    (``ratio_low``, ``ratio_high``); None where they share no document. ``base``'s mean NLL is weighted by
    ``records``' own target tokens (the same tokens where both score the same targets). Either side may be anything
    with ``document``, ``mean_nll`` and ``tokens_scored`` (records read back as plain objects)."""
    theirs = {r.document: r for r in base}
    units = [(r.mean_nll * r.tokens_scored, theirs[r.document].mean_nll * r.tokens_scored, r.tokens_scored)
             for r in records if r.document in theirs]
    if not units:
        return None
    nll, ref, tokens = (sum(u[i] for u in units) for i in range(3))
    low, high = bootstrap([(u[0], u[2]) for u in units], mean_nll_ppl)
    ratio_low, ratio_high = bootstrap(units, ppl_ratio)
    return {"documents": len(units), "tokens_scored": tokens, "perplexity": math.exp(nll / tokens), "low": low,
            "high": high, "ratio": math.exp((nll - ref) / tokens), "ratio_low": ratio_low, "ratio_high": ratio_high}


def summarize(records: list[PerplexityRecord], methods: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Token-weighted mean NLL over documents, per (method, protocol, length), the perplexity with its 95% bootstrap
    interval over the documents (``low``, ``high``: target windows, ``--windows``; one document: the point), and
    beside the unpatched model scored on the same documents its ratio to it, paired per document (``ratio_to_none``,
    ``ratio_low``, ``ratio_high``); raises on mixed targets. Rows by method (``methods`` first, as given), protocol
    and length (``in_order``)."""
    check_same_targets(records)
    groups: dict[tuple, list[PerplexityRecord]] = {}
    for record in records:
        groups.setdefault((record.method, record.protocol, record.length), []).append(record)
    rows = []
    for (method, protocol, length), group in groups.items():
        tokens = sum(r.tokens_scored for r in group)
        mean = sum(r.mean_nll * r.tokens_scored for r in group) / tokens
        units = [(r.mean_nll * r.tokens_scored, r.tokens_scored) for r in group]
        low, high = bootstrap(units, mean_nll_ppl)
        row = {"method": method, "protocol": protocol, "length": length, "documents": len(group),
               "tokens_scored": tokens, "mean_nll": mean, "perplexity": math.exp(mean), "low": low, "high": high,
               "ratio_to_none": None, "ratio_low": None, "ratio_high": None}
        # (against the unpatched model on the same documents, paired: each document's NLL on both sides)
        base = groups.get(("none", protocol, length), [])
        if method != "none" and base and {r.document for r in group} <= {r.document for r in base}:
            pair = paired(group, base)
            row |= {"ratio_to_none": pair["ratio"], "ratio_low": pair["ratio_low"], "ratio_high": pair["ratio_high"]}
        rows.append(row)
    return in_order(rows, methods, lambda row: (row["protocol"], row["length"]))
