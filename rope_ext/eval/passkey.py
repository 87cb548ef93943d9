"""Passkey retrieval (Mohtashami & Jaggi 2023, the protocol LongLoRA and YaRN report).

A random 5-digit key sits at relative depth ``d`` inside repeated filler text; the whole prompt is
exactly ``L`` tokens. The model answers greedily and the first number it writes must equal the key.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from rope_ext.eval.intervals import wilson
from rope_ext.eval.perplexity import peak_memory_mb
from rope_ext.eval.prefix import PrefixCache, greedy_answer
from rope_ext.runs.results import in_order

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyRecord:
    method: str  # the spec as given, e.g. "yarn:factor=2" or "none"
    config: list[dict[str, Any]]  # the method configs (to_dict), [] for the unpatched model
    length: int
    depth: float
    trial: int
    key: str
    answer: str
    correct: bool
    seconds: float
    peak_memory_mb: float
    reused_tokens: int = 0  # (the prompt's beginning taken from the previous trial's cache, ``PrefixCache``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def passkey_key(method: str, length: int, depth: float, trial: int) -> tuple:
    return (method, int(length), round(float(depth), 6), int(trial))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_overhead(tokenizer: Any, key: str = "00000") -> int:
    """Tokens of the prompt besides its filler (task, needle, question): the shortest prompt's length."""
    return sum(len(_encode(tokenizer, t)) for t in (TASK, NEEDLE.format(key=key), QUESTION))


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str) -> torch.Tensor:
    """``[1, length]`` token ids: task, filler with the needle at ``depth`` (0 = start, 1 = end), question."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    task, needle, question = (_encode(tokenizer, t) for t in (TASK, NEEDLE.format(key=key), QUESTION))
    filler_budget = length - len(task) - len(needle) - len(question)
    if filler_budget < 0:
        raise ValueError(f"length {length} is too short for the passkey prompt ({length - filler_budget} tokens)")
    unit = _encode(tokenizer, FILLER)
    filler = (unit * (filler_budget // len(unit) + 1))[:filler_budget]
    split = round(depth * filler_budget)
    ids = task + filler[:split] + needle + filler[split:] + question
    return torch.tensor([ids])


#: tokens generated for an answer; all but the last are read back, at the positions after the prompt
ANSWER_TOKENS = 8
#: positions an answer takes after its prompt: a trial of length L has a prompt this much shorter, so that prompt and
#: answer read L positions (the length reported), never more
ANSWER_POSITIONS = ANSWER_TOKENS - 1


def is_correct(answer: str, key: str) -> bool:
    match = re.search(r"\d+", answer)
    return match is not None and match.group() == key


def trial_key(seed: int, length: int, depth: float, trial: int) -> str:
    """The same key for the same cell and trial in every method, so methods face identical prompts."""
    rng = random.Random(f"{seed}-{length}-{depth:.6f}-{trial}")
    return str(rng.randint(10_000, 99_999))


def passkey_trial(
    model: nn.Module,
    tokenizer: Any,
    length: int,
    depth: float,
    trial: int,
    *,
    method: str = "none",
    config: list[dict[str, Any]] | None = None,
    seed: int = 0,
    prefix: PrefixCache | None = None,
) -> PasskeyRecord:
    key = trial_key(seed, length, depth, trial)
    began = time.perf_counter()
    prompt = passkey_prompt(tokenizer, length - ANSWER_POSITIONS, depth, key)
    answer, reused = greedy_answer(model, tokenizer, prompt, ANSWER_TOKENS, prefix)
    return PasskeyRecord(
        method=method,
        config=[] if config is None else config,
        length=length,
        depth=depth,
        trial=trial,
        key=key,
        answer=answer,
        correct=is_correct(answer, key),
        seconds=time.perf_counter() - began,
        peak_memory_mb=peak_memory_mb(),
        reused_tokens=reused,
    )


def summarize_passkey(records: list[PasskeyRecord], methods: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Accuracy per (method, length, depth), with its Wilson interval (``low``, ``high``: 95%) over the trials; rows
    by method (``methods`` first, as given), length and depth (``in_order``)."""
    groups: dict[tuple, list[PasskeyRecord]] = {}
    for record in records:
        groups.setdefault((record.method, record.length, round(record.depth, 6)), []).append(record)
    rows = []
    for (method, length, depth), group in groups.items():
        correct = sum(r.correct for r in group)
        low, high = wilson(correct, len(group))
        rows.append({"method": method, "length": length, "depth": depth, "trials": len(group),
                     "accuracy": correct / len(group), "low": low, "high": high})
    return in_order(rows, methods, lambda row: (row["length"], row["depth"]))
