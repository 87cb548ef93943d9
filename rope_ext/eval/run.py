"""Evaluation runs: every method over documents and lengths, resumable, with results files and plots."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from tqdm.auto import tqdm

from rope_ext.core import patched
from rope_ext.eval.data import Document
from rope_ext.eval.passkey import PasskeyRecord, passkey_key, passkey_trial, summarize_passkey
from rope_ext.eval.perplexity import (
    PerplexityRecord,
    evaluate_document,
    record_key,
    summarize,
    usable_lengths,
)
from rope_ext.eval.results import ResultStore
from rope_ext.methods import MethodConfig
from rope_ext.methods.base import parse_method_spec


def parse_methods(text: str) -> dict[str, MethodConfig | None]:
    """``"none,yarn:factor=4"`` -> ``{"none": None, "yarn:factor=4": YarnConfig(factor=4)}``."""
    specs = [spec.strip() for spec in text.split(",") if spec.strip()]
    if not specs:
        raise ValueError("give at least one method, e.g. none,yarn:factor=4")
    return {spec: parse_method_spec(spec) for spec in specs}


def _with_method(model: nn.Module, config: MethodConfig | None, work: Callable[[], Any]) -> Any:
    if config is None:
        return work()
    with patched(model, config):
        return work()


def run_perplexity(
    model: nn.Module,
    documents: list[Document],
    methods: dict[str, MethodConfig | None],
    lengths: list[int],
    store: ResultStore,
    *,
    protocol: str = "fixed",
    target_tokens: int = 1024,
    stride: int = 256,
    log: Callable[[str], None] = tqdm.write,
) -> list[dict[str, Any]]:
    """Evaluate every method on every document at every usable length; returns the summary rows."""
    done = {record_key(r["method"], r["protocol"], r["document"], r["length"]) for r in store.records()}
    usable_by_title = {d.title: usable_lengths(d, lengths, protocol, target_tokens) for d in documents}
    for document in documents:
        for length in sorted(set(lengths) - set(usable_by_title[document.title])):
            reason = f"target {target_tokens} tokens" if length <= target_tokens else f"{document.num_tokens} tokens"
            log(f"skipping length {length} for {document.title!r}: it provides {reason}, not enough (no padding)")
    work = [(spec, document) for spec in methods for document in documents]
    bar = tqdm(total=sum(len(usable_by_title[d.title]) for _, d in work), unit="len")
    for spec, document in work:
        config = methods[spec]
        usable = usable_by_title[document.title]
        bar.set_description(f"{spec} / {document.title}")
        skip = lambda length: record_key(spec, protocol, document.title, length) in done  # noqa: E731

        def evaluate() -> None:
            for record in evaluate_document(
                model,
                document,
                usable,
                method=spec,
                config=config.to_dict() if config is not None else None,
                dynamic=bool(getattr(config, "dynamic", False)),
                protocol=protocol,
                target_tokens=target_tokens,
                stride=stride,
                skip=skip,
            ):
                store.append(record.to_dict())
                bar.update(1)

        bar.update(sum(1 for length in usable if skip(length)))
        _with_method(model, config, evaluate)
    bar.close()
    records = [r for r in store.records() if r["method"] in methods and r["length"] in lengths]
    summary = summarize([PerplexityRecord(**r) for r in records])
    store.write_tables(records, summary)
    return summary


def run_passkey(
    model: nn.Module,
    tokenizer: Any,
    methods: dict[str, MethodConfig | None],
    lengths: list[int],
    depths: list[float],
    trials: int,
    store: ResultStore,
    *,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Passkey accuracy over the length x depth grid, ``trials`` keys per cell, for every method."""
    done = {passkey_key(r["method"], r["length"], r["depth"], r["trial"]) for r in store.records()}
    cells = [(L, d, t) for L in lengths for d in depths for t in range(trials)]
    bar = tqdm(total=len(methods) * len(cells), unit="trial")
    for spec, config in methods.items():
        bar.set_description(spec)
        todo = [cell for cell in cells if passkey_key(spec, *cell) not in done]
        bar.update(len(cells) - len(todo))

        def evaluate() -> None:
            for length, depth, trial in todo:
                record = passkey_trial(
                    model,
                    tokenizer,
                    length,
                    depth,
                    trial,
                    method=spec,
                    config=config.to_dict() if config is not None else None,
                    seed=seed,
                )
                store.append(record.to_dict())
                bar.update(1)

        _with_method(model, config, evaluate)
    bar.close()
    wanted = {passkey_key(spec, *cell) for spec in methods for cell in cells}
    records = [r for r in store.records() if passkey_key(r["method"], r["length"], r["depth"], r["trial"]) in wanted]
    summary = summarize_passkey([PasskeyRecord(**r) for r in records])
    store.write_tables(records, summary)
    return summary
