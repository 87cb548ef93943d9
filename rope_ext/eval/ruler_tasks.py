"""RULER's synthetic tasks (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER), generated offline: needle in a
haystack (single, multi-key, multi-value, multi-query; keys and values as words, numbers or uuids), variable tracking,
common-words and frequent-words extraction. RULER's templates, needle sentence, answer prefixes, word lists
(wonderwords' nouns, adjectives and verbs), sizes and answer budgets; the haystack RULER takes from Paul Graham's
essays (a download) is the corpus here (``text``: any text given, the default corpus otherwise).

Every prompt is fitted to its length ``L`` with the answer inside it: the prompt's tokens plus the task's answer
budget (RULER's tokens to generate) at most ``L``, the haystack the largest that fits (a binary search over its
units, as RULER's). A sample is drawn from ``random.Random`` seeded by the run's seed, task, length and trial, so
every method is asked the same prompts. The single-needle tasks place their needle at a depth given (the heatmap's
grid), the others at random positions as RULER does.

Pure Python over a tokenizer: imports no torch, no transformers.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} "
    "mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
    "Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What "
    "are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
#: the types of keys and values, and the plural naming a value type in the prompt
KINDS = {"words": "words", "numbers": "numbers", "uuids": "uuids"}
#: the haystacks: a sentence repeated, distractor needles, or the corpus's text
HAYSTACKS = ("noise", "needle", "text")


@dataclass(frozen=True)
class Task:
    """One of RULER's synthetic tasks: its kind, the tokens its answer may take, and its needles."""

    name: str
    kind: str  # niah, vt, cwe, fwe
    answer_tokens: int
    haystack: str = "noise"
    keys: str = "words"
    values: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1

    @property
    def takes_depth(self) -> bool:
        """A single needle among other text, placed at a depth given (the heatmap's tasks)."""
        return self.kind == "niah" and self.needles == 1 and self.haystack != "needle"

    @property
    def needles(self) -> int:
        """The needles a sample hides: a value of each key (as many keys as are asked for at least)."""
        return max(self.num_keys, self.num_queries) * self.num_values


#: RULER's synthetic tasks that need no download (``scripts/synthetic.yaml``; ``essay`` is ``text`` here)
TASKS: dict[str, Task] = {t.name: t for t in (
    Task("niah_single_1", "niah", 128, "noise"),
    Task("niah_single_2", "niah", 128, "text"),
    Task("niah_single_3", "niah", 128, "text", values="uuids"),
    Task("niah_multikey_1", "niah", 128, "text", num_keys=4),
    Task("niah_multikey_2", "niah", 128, "needle"),
    Task("niah_multikey_3", "niah", 128, "needle", keys="uuids", values="uuids"),
    Task("niah_multivalue", "niah", 128, "text", num_values=4),
    Task("niah_multiquery", "niah", 128, "text", num_queries=4),
    Task("vt", "vt", 30),
    Task("cwe", "cwe", 120),
    Task("fwe", "fwe", 50),
)}
#: variable tracking: chains and hops; common words: repeats of the common and uncommon words, how many are common
VT_CHAINS, VT_HOPS = 1, 4
CWE_COMMON, CWE_REPEATS, CWE_UNCOMMON_REPEATS, CWE_SHORT = 10, (30, 3), (6, 1), 4096
#: frequent words: the exponent of the counts, the coded words' length, the answers (the ranks after the dots)
FWE_ALPHA, FWE_WORD_LENGTH = 2.0, 6


@dataclass(frozen=True)
class Sample:
    """A prompt (ending in the answer prefix the model continues), the strings its answer must contain, its token
    count, and the depth of its needle (single-needle tasks; ``None`` otherwise)."""

    prompt: str
    references: list[str]
    prompt_tokens: int
    depth: float | None = None


@functools.cache
def word_list(kind: str) -> tuple[str, ...]:
    """wonderwords' ``nouns``, ``adjectives`` or ``verbs`` (the lists RULER draws from), sorted."""
    names = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}
    text = (importlib.resources.files("wonderwords") / "assets" / names[kind]).read_text()
    return tuple(sorted({line.strip() for line in text.splitlines() if line.strip()}))


@functools.cache
def word_pool() -> tuple[str, ...]:
    """Common-words extraction's pool: wonderwords' nouns, adjectives and verbs together, sorted (RULER's)."""
    return tuple(sorted({*word_list("nouns"), *word_list("adjectives"), *word_list("verbs")}))


def count_tokens(tokenizer: Any, text: str) -> int:
    """The tokens ``text`` takes as the model is given it (the tokenizer's own special tokens included)."""
    return len(tokenizer(text)["input_ids"])


def largest_fitting(build: Callable[[int], str], fits: Callable[[str], bool], most: int | None = None) -> int:
    """The largest haystack size ``n >= 1`` (at most ``most``) whose ``build(n)`` ``fits``: a search doubling ``n``
    until it overflows, then halving the gap (more units, more tokens); refused when even 1 does not fit."""
    if not fits(build(1)):
        raise ValueError("too short")
    low, high = 1, 2
    while (most is None or high <= most) and fits(build(high)):
        low, high = high, high * 2
    if most is not None and high > most:
        if fits(build(most)):
            return most
        high = most
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(build(middle)) else (low, middle)
    return low


def _value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(word_list('adjectives'))}-{rng.choice(word_list('nouns'))}"


def _singular(text: str) -> str:
    """RULER's wording for one value asked: 'Some' -> 'A', 'are all' -> 'is', 'are' -> 'is' (and the value type
    singular where the template names it: ``niah``)."""
    for before, after in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(before, after)
    return text


def _places(rng: random.Random, slots: int, count: int) -> list[int]:
    """``count`` of ``slots`` places: distinct where there are as many (RULER's), else some shared."""
    return rng.sample(range(slots), count) if slots >= count else rng.choices(range(slots), k=count)


def _sentences(words: list[str]) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(words)) if s]


def niah(task: Task, tokenizer: Any, length: int, rng: random.Random, text_words: list[str],
         depth: float | None) -> Sample:
    """A needle-in-a-haystack sample of ``task`` fitted to ``length`` (see the module)."""
    keys = [_value(task.keys, rng) for _ in range(max(task.num_keys, task.num_queries))]
    values = [[_value(task.values, rng) for _ in range(task.num_values)] for _ in keys]
    plural = KINDS[task.values]
    needles = [NEEDLE.format(type_needle_v=plural, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(len(keys)), task.num_queries)
    query = keys[asked[0]] if len(asked) == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    references = [v for i in asked for v in values[i]]
    template, answer, named = NIAH_TEMPLATE, NIAH_ANSWER, plural  # (the needles keep the plural)
    if task.num_queries * task.num_values == 1:
        template, answer, named = _singular(template), _singular(answer), plural[:-1]
    where = rng.random() if depth is None else depth  # (the shared draws first: the haystack's own come after)
    distractors = [NEEDLE.format(type_needle_v=plural, key=_value(task.keys, rng), value=_value(task.values, rng))
                   for _ in range(length // 8 if task.haystack == "needle" else 0)]  # (a needle: 8 tokens or more)
    state = rng.getstate()

    def build(n: int) -> str:
        inner = random.Random()
        inner.setstate(state)
        if task.haystack == "text":
            sentences = _sentences((text_words * (n // max(1, len(text_words)) + 1))[:n])
            joiner = " "
        else:
            sentences = [NOISE] * n if task.haystack == "noise" else distractors[:n]
            joiner = "\n"
        if task.takes_depth:
            places = [round(where * len(sentences))]
        else:
            places = sorted(_places(inner, len(sentences) + 1, len(needles)), reverse=True)
        for place, needle in zip(places, needles, strict=True):
            sentences.insert(place, needle)
        context = joiner.join(sentences)
        return template.format(type_needle_v=named, context=context, query=query) + answer.format(
            type_needle_v=named, query=query)

    prompt = build(_fit(build, tokenizer, length - task.answer_tokens, len(distractors) or None))
    return Sample(prompt, references, count_tokens(tokenizer, prompt), where if task.takes_depth else None)


class TooShort(ValueError):
    """A length below a task's least prompt (``tokens``) and its answer."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"{tokens} tokens with the least haystack")
        self.tokens = tokens


def _fit(build: Callable[[int], str], tokenizer: Any, budget: int, most: int | None = None) -> int:
    fits = lambda prompt: count_tokens(tokenizer, prompt) <= budget  # noqa: E731
    try:
        return largest_fitting(build, fits, most)
    except ValueError:
        raise TooShort(count_tokens(tokenizer, build(1))) from None


def _variables(count: int, letters: int, rng: random.Random) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def _vt_prompt(noises: int, names: list[str], value: str, positions_rng: random.Random) -> str:
    chain = [f"VAR {names[0]} = {value}", *(f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(VT_HOPS))]
    sentences = [NOISE] * noises
    positions = sorted(_places(positions_rng, len(sentences) + 1, len(chain)))
    for j, (place, line) in enumerate(zip(positions, chain)):
        sentences.insert(place + j, line)
    context = "\n".join(sentences).replace(". \n", ".\n")
    return VT_TEMPLATE.format(context=context, query=value) + VT_ANSWER.format(num_v=VT_HOPS + 1, query=value)


def variable_tracking(tokenizer: Any, length: int, rng: random.Random) -> Sample:
    """Variable tracking: one chain of 4 hops among noise, after one worked example (RULER's one-shot)."""
    example_names, example_value = _variables(VT_HOPS + 1, 3, rng), str(rng.randint(10000, 99999))
    names, value = _variables(VT_HOPS + 1, 5, rng), str(rng.randint(10000, 99999))
    state = rng.getstate()

    def example(n: int) -> str:
        inner = random.Random()
        inner.setstate(state)
        return _vt_prompt(n, example_names, example_value, inner) + " ".join(example_names) + "\n"

    shown = example(_fit(example, tokenizer, 500))

    def build(n: int) -> str:
        inner = random.Random()
        inner.setstate(state)
        inner.random()  # (other positions than the example's)
        return shown + "\n" + _vt_prompt(n, names, value, inner)

    prompt = build(_fit(build, tokenizer, length - TASKS["vt"].answer_tokens))
    return Sample(prompt, names, count_tokens(tokenizer, prompt))


def _cwe_list(count: int, repeats: tuple[int, int], rng: random.Random) -> tuple[str, list[str]]:
    pool = word_pool()  # (built once: each build of the haystack search draws from it)
    words = rng.sample(pool, min(count, len(pool)))
    common, uncommon = words[:CWE_COMMON], words[CWE_COMMON:]
    listed = common * repeats[0] + uncommon * repeats[1]
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed)), common


def common_words(tokenizer: Any, length: int, rng: random.Random) -> Sample:
    """Common-words extraction: the 10 words repeated most in a numbered list, after one worked example."""
    short = length < CWE_SHORT
    example_context, example_common = _cwe_list(20 if short else 40, (3, 1) if short else (10, 3), rng)
    shown = (CWE_TEMPLATE.format(context=example_context) + CWE_ANSWER + " "
             + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_common)))
    state = rng.getstate()
    repeats = CWE_UNCOMMON_REPEATS if short else CWE_REPEATS
    found: dict[int, list[str]] = {}

    def build(n: int) -> str:
        inner = random.Random()
        inner.setstate(state)
        context, found[n] = _cwe_list(CWE_COMMON + n, repeats, inner)
        return shown + "\n" + CWE_TEMPLATE.format(context=context) + CWE_ANSWER

    most = len(word_pool()) - CWE_COMMON
    n = _fit(build, tokenizer, length - TASKS["cwe"].answer_tokens, most)
    prompt = build(n)
    return Sample(prompt, found[n], count_tokens(tokenizer, prompt))


def frequent_words(tokenizer: Any, length: int, rng: random.Random) -> Sample:
    """Frequent-words extraction: coded words with counts ``~ k^-2``, the most frequent the dots; the answer the
    three after them."""
    budget = length - TASKS["fwe"].answer_tokens
    size = max(4, budget // 50)
    vocabulary: list[str] = []
    while len(vocabulary) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LENGTH))
        if word not in vocabulary:
            vocabulary.append(word)
    vocabulary.sort()
    rng.shuffle(vocabulary)
    vocabulary[0] = "..."
    zeta = sum(k ** -FWE_ALPHA for k in range(1, 100_000)) if FWE_ALPHA != 2.0 else math.pi ** 2 / 6
    state = rng.getstate()

    def build(n: int) -> str:
        inner = random.Random()
        inner.setstate(state)
        words = [w for k, w in enumerate(vocabulary, 1) for _ in range(int(n * k ** -FWE_ALPHA / zeta))]
        inner.shuffle(words)
        return FWE_TEMPLATE.format(context=" ".join(words)) + FWE_ANSWER

    prompt = build(_fit(build, tokenizer, budget))
    return Sample(prompt, vocabulary[1:4], count_tokens(tokenizer, prompt))


def make_sample(task: Task, tokenizer: Any, length: int, seed: int, trial: int, text_words: list[str],
                depth: float | None = None) -> Sample:
    """The sample of ``task`` at ``length`` for ``trial`` (the same for every method: seeded by all four)."""
    rng = random.Random(f"ruler-{seed}-{task.name}-{length}-{trial}")
    try:
        if task.kind == "niah":
            if task.haystack == "text" and not text_words:
                raise ValueError(f"{task.name} takes its haystack from a text, and none was given")
            return niah(task, tokenizer, length, rng, text_words, depth)
        if task.kind == "vt":
            return variable_tracking(tokenizer, length, rng)
        if task.kind == "cwe":
            return common_words(tokenizer, length, rng)
        return frequent_words(tokenizer, length, rng)
    except TooShort as error:
        raise ValueError(f"length {length} is too short for RULER's {task.name}: {error.tokens} tokens with the least "
                         f"haystack, plus the {task.answer_tokens} of its answer; give longer --lengths or leave "
                         f"{task.name} out of --tasks") from None


def postprocess(answer: str) -> str:
    """RULER's ``postprocess_pred``: stripped, control characters as newlines, stripped again."""
    return re.sub(r"[\x00-\x1f]", "\n", answer.strip()).strip()


def string_match_all(answer: str, references: list[str]) -> float:
    """RULER's ``string_match_all`` of one sample: the fraction of the references contained in the answer,
    case-insensitive (partial credit; x100 in RULER's tables)."""
    found = postprocess(answer).lower()
    return sum(reference.lower() in found for reference in references) / len(references)
