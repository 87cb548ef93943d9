"""``rope-ext eval ruler``: RULER's synthetic tasks (``rope_ext.eval.ruler_tasks``) over methods, lengths and trials,
scored as RULER scores them, resumable, with intervals and an effective length.

Each trial's sample is the same for every method (seeded by the run's seed, task, length and trial); the model
continues the prompt greedily for at most the task's answer budget (the prompt and the answer within the length),
stopping at its end-of-sequence token. A sample scores RULER's ``string_match_all``: the fraction of its references
the answer contains. Per method, task and length: the mean score (x100, as RULER's tables) with a 95% interval over
the trials (Wilson's where every sample has one reference, a right-or-wrong score; else the percentile bootstrap);
per method and length: the mean over the tasks, its interval the wider of a bootstrap of the trials within each
task and the mean of the tasks' own intervals. The
effective length of a method: the longest length at which its mean, and its mean at every shorter length, stays at or
above the threshold (given, else the unpatched model's mean at the run's shortest length), recorded in ``ruler.json``
with the threshold and where it came from (``effective_summary``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from rope_ext.eval.intervals import LEVEL, RESAMPLES, bootstrap, wilson
from rope_ext.eval.perplexity import peak_memory_mb
from rope_ext.eval.prefix import PrefixCache, greedy_answer
from rope_ext.eval.ruler_tasks import TASKS, Sample, make_sample, string_match_all
from rope_ext.runs.results import ResultStore, in_order
from rope_ext.runs.saved import with_method


@dataclass
class RulerRecord:
    method: str
    config: list[dict[str, Any]]
    task: str
    length: int
    trial: int
    depth: float | None
    prompt_tokens: int
    answer: str
    references: list[str]
    score: float
    seconds: float
    peak_memory_mb: float
    reused_tokens: int = 0  # (the prompt's beginning taken from the previous trial's cache, ``PrefixCache``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ruler_key(method: str, task: str, length: int, trial: int) -> tuple:
    return (method, task, int(length), int(trial))


def trial_depth(task: str, trial: int, depths: list[float]) -> float | None:
    """The depth of a single-needle task's needle in ``trial``: the grid's, in turn; ``None`` for other tasks."""
    return depths[trial % len(depths)] if TASKS[task].takes_depth else None


def ruler_trial(model: nn.Module, tokenizer: Any, sample: Sample, task: str, length: int, trial: int, *,
                method: str = "none", config: list[dict[str, Any]] | None = None,
                prefix: PrefixCache | None = None) -> RulerRecord:
    began = time.perf_counter()
    ids = torch.tensor([tokenizer(sample.prompt)["input_ids"]])
    text, reused = greedy_answer(model, tokenizer, ids, TASKS[task].answer_tokens, prefix)
    return RulerRecord(
        method=method, config=config or [], task=task, length=length, trial=trial, depth=sample.depth,
        prompt_tokens=sample.prompt_tokens, answer=text, references=list(sample.references),
        score=string_match_all(text, sample.references), seconds=time.perf_counter() - began,
        peak_memory_mb=peak_memory_mb(), reused_tokens=reused,
    )


def _interval(records: list[dict[str, Any]]) -> tuple[float, float]:
    scores = [r["score"] for r in records]
    if all(len(r["references"]) == 1 for r in records):  # (right or wrong: a proportion)
        low, high = wilson(round(sum(scores)), len(scores))
        return 100 * low, 100 * high
    low, high = bootstrap(scores, lambda x: x.mean(-1))
    return 100 * low, 100 * high


def _stratified(groups: list[list[dict[str, Any]]], seed: int = 0) -> tuple[float, float]:
    """The interval of the mean over tasks of their means: the wider of a bootstrap of each task's trials resampled
    apart and the mean of the tasks' own intervals (the bootstrap alone is empty where every task's trials agree:
    few trials, each right or wrong, claim no certainty)."""
    generator = torch.Generator().manual_seed(seed)
    means = []
    for records in groups:
        values = torch.tensor([r["score"] for r in records], dtype=torch.float64)
        picks = torch.randint(0, len(records), (RESAMPLES, len(records)), generator=generator)
        means.append(values[picks].mean(-1))
    stats = torch.stack(means).mean(0)
    low, high = torch.quantile(stats, torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64))
    own = [_interval(records) for records in groups]
    return (min(100 * low.item(), sum(i[0] for i in own) / len(own)),
            max(100 * high.item(), sum(i[1] for i in own) / len(own)))


def summarize_ruler(records: list[dict[str, Any]], methods: Iterable[str] = (),
                    tasks: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Rows per method, task and length (``task`` a task's name) and per method and length over its tasks
    (``task`` ``"average"``, with the tasks it averages): score x100, ``low``, ``high``, trials. Rows by method
    (``methods`` first, as given), length, then task (``tasks`` first, as given, then ``TASKS``' order; the average
    last; ``in_order``). The intervals are drawn alike whatever the records' order (a resumed run's)."""
    rank = {task: i for i, task in enumerate(dict.fromkeys([*tasks, *TASKS]))}

    def order(task: str) -> tuple[int, str]:
        return rank.get(task, len(rank)), task

    cells: dict[tuple, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: (order(r["task"]), r.get("trial", 0))):
        cells.setdefault((record["method"], record["task"], record["length"]), []).append(record)
    rows = []
    for (method, task, length), group in cells.items():
        low, high = _interval(group)
        rows.append({"method": method, "task": task, "length": length, "trials": len(group),
                     "score": 100 * sum(r["score"] for r in group) / len(group), "low": low, "high": high,
                     "tasks": [task]})
    averaged: dict[tuple, list[list[dict[str, Any]]]] = {}
    averages: dict[tuple, list[str]] = {}
    for (method, task, length), group in cells.items():
        averaged.setdefault((method, length), []).append(group)
        averages.setdefault((method, length), []).append(task)
    for (method, length), groups in averaged.items():
        low, high = _stratified(groups)
        score = 100 * sum(sum(r["score"] for r in g) / len(g) for g in groups) / len(groups)
        rows.append({"method": method, "task": "average", "length": length, "trials": sum(map(len, groups)),
                     "score": score, "low": low, "high": high, "tasks": sorted(averages[(method, length)])})
    return in_order(rows, methods, lambda row: (row["length"], row["task"] == "average", order(row["task"])))


def effective_lengths(rows: list[dict[str, Any]], threshold: float | None) -> tuple[float | None, dict[str, Any]]:
    """``(threshold, {method: effective length})`` from the average rows: ``threshold`` as given, else the unpatched
    model's (``none``) average at its shortest length (``None`` where neither: no effective length). A method's
    effective length is ``None`` where even its shortest length is below the threshold."""
    average = [r for r in rows if r["task"] == "average"]
    if threshold is None:
        base = sorted((r["length"], r["score"]) for r in average if r["method"] == "none")
        if not base:
            return None, {}
        threshold = base[0][1]
    found: dict[str, Any] = {}
    for method in dict.fromkeys(r["method"] for r in average):
        scores = sorted((r["length"], r["score"]) for r in average if r["method"] == method)
        effective = None
        for length, score in scores:
            if score < threshold:
                break
            effective = length
        found[method] = effective
    return threshold, found


def effective_summary(rows: list[dict[str, Any]], threshold: float | None) -> dict[str, Any]:
    """``ruler.json``'s ``effective_length``: the ``threshold`` used (``effective_lengths``), where it came from
    (``threshold_from``), and per method its effective length (``lengths``; ``None``: below the threshold even at
    its shortest length)."""
    used, found = effective_lengths(rows, threshold)
    if used is None:
        source = "nothing: no --threshold given and no unpatched model (none) among the results"
    elif threshold is not None:
        source = "--threshold"
    else:
        shortest = min(r["length"] for r in rows if r["task"] == "average" and r["method"] == "none")
        source = f"the unpatched model's (none) average at its shortest length, {shortest}"
    return {"threshold": used, "threshold_from": source, "lengths": found}


def run_ruler(
    model: nn.Module, tokenizer: Any, methods: dict[str, list], tasks: list[str], lengths: list[int], trials: int,
    depths: list[float], store: ResultStore, *, seed: int = 0, text_words: list[str] | None = None,
    site_options: dict[str, Any] | None = None, limits: dict[str, int] | None = None, threshold: float | None = None,
) -> list[dict[str, Any]]:
    """Every method on every task, length and trial not yet in ``store`` (the samples drawn once, the same for every
    method); the tables written over the folder's records, ``ruler.json`` with the effective lengths of its summary
    at ``threshold`` (``effective_summary``); returns this run's summary rows. ``limits``: a method's lengths past its
    learned position table are left out."""
    from tqdm.auto import tqdm

    done = {ruler_key(r["method"], r["task"], r["length"], r["trial"]) for r in store.records()}
    limits = limits or {}
    grid = [(task, length, trial) for length in lengths for task in tasks for trial in range(trials)]
    cells = {spec: [c for c in grid if c[1] <= limits.get(spec, max(lengths))] for spec in methods}
    needed = {c for spec in methods for c in cells[spec] if ruler_key(spec, *c) not in done}
    samples = {(task, length, trial): make_sample(TASKS[task], tokenizer, length, seed, trial, text_words or [],
                                                  trial_depth(task, trial, depths))
               for task, length, trial in sorted(needed)}  # (all drawn before the model runs: a bad length fails now)

    bar = tqdm(total=sum(len(c) for c in cells.values()), unit="trial")
    for spec, configs in methods.items():
        bar.set_description(spec)
        todo = [c for c in cells[spec] if ruler_key(spec, *c) not in done]
        bar.update(len(cells[spec]) - len(todo))

        # (trials that share their prompt's beginning reuse its cache, for methods whose frequencies are static)
        prefix = PrefixCache(enabled=not any(getattr(c, "dynamic", False) for c in configs))

        def evaluate() -> None:
            for task, length, trial in todo:
                record = ruler_trial(model, tokenizer, samples[(task, length, trial)], task, length, trial, method=spec,
                                     config=[c.to_dict() for c in configs], prefix=prefix)
                store.append(record.to_dict())
                bar.update(1)

        with_method(model, configs, evaluate, site_options)
    bar.close()
    kept = store.records()
    rows = summarize_ruler(kept, methods, tasks)
    store.write_tables(kept, rows, {"effective_length": effective_summary(rows, threshold)})
    wanted = {ruler_key(spec, *c) for spec in methods for c in cells[spec]}
    return summarize_ruler([r for r in kept if ruler_key(r["method"], r["task"], r["length"], r["trial"]) in wanted],
                           methods, tasks)
