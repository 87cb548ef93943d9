"""RULER's synthetic tasks (rope_ext.eval.ruler_tasks) and their evaluation (rope_ext.eval.ruler, rope-ext eval ruler):
templates, lengths, placement, scoring and summaries pinned against values written out here."""

from __future__ import annotations

import collections
import json
import re

import pytest
from test_eval import tiny_checkpoint  # noqa: F401  (the fixture: a tiny Llama saved with a word-level tokenizer)

from rope_ext.cli import main
from rope_ext.eval.ruler import effective_lengths, effective_summary, summarize_ruler, trial_depth
from rope_ext.eval.ruler_tasks import (
    NOISE,
    TASKS,
    count_tokens,
    largest_fitting,
    make_sample,
    postprocess,
    string_match_all,
)
from rope_ext.runs.models import load_default_tokenizer

WORDS = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
         "darkness was upon the face of the deep.").split()


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def test_the_tasks_and_their_settings_are_rulers():
    assert list(TASKS) == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                           "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
    budgets = {name: task.answer_tokens for name, task in TASKS.items()}
    assert budgets == {**{n: 128 for n in TASKS if n.startswith("niah")}, "vt": 30, "cwe": 120, "fwe": 50}
    assert {name: t.needles for name, t in TASKS.items() if t.kind == "niah"} == {
        "niah_single_1": 1, "niah_single_2": 1, "niah_single_3": 1, "niah_multikey_1": 4, "niah_multikey_2": 1,
        "niah_multikey_3": 1, "niah_multivalue": 4, "niah_multiquery": 4}
    assert [name for name, t in TASKS.items() if t.takes_depth] == ["niah_single_1", "niah_single_2", "niah_single_3"]
    shape = {name: (t.haystack, t.keys, t.values, t.num_keys, t.num_values, t.num_queries)
             for name, t in TASKS.items() if t.kind == "niah"}
    assert shape == {
        "niah_single_1": ("noise", "words", "numbers", 1, 1, 1), "niah_single_2": ("text", "words", "numbers", 1, 1, 1),
        "niah_single_3": ("text", "words", "uuids", 1, 1, 1), "niah_multikey_1": ("text", "words", "numbers", 4, 1, 1),
        "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
        "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
        "niah_multivalue": ("text", "words", "numbers", 1, 4, 1), "niah_multiquery": ("text", "words", "numbers", 1, 1, 4),
    }
    assert NOISE == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.mark.parametrize("length", [1024, 3000])
@pytest.mark.parametrize("name", list(TASKS))
def test_every_prompt_fits_its_length_with_its_answer_and_fills_it(tokenizer, name, length):
    """The prompt plus the answer budget within the length, and the haystack the largest that fits: within about one
    haystack unit of the length (a sentence, a needle line of two uuids, a list entry, a coded word)."""
    task = TASKS[name]
    sample = make_sample(task, tokenizer, length, 0, 0, WORDS, 0.5 if task.takes_depth else None)
    assert sample.prompt_tokens == count_tokens(tokenizer, sample.prompt)
    assert sample.prompt_tokens + task.answer_tokens <= length
    assert sample.prompt_tokens + task.answer_tokens > length - 80, (sample.prompt_tokens, length)
    again = make_sample(task, tokenizer, length, 0, 0, WORDS, 0.5 if task.takes_depth else None)
    other = make_sample(task, tokenizer, length, 0, 1, WORDS, 0.5 if task.takes_depth else None)
    assert again == sample and other.prompt != sample.prompt  # (seeded by the trial: every method asked the same)


def test_single_needle_prompt_is_rulers_singular_wording_with_the_needle_at_its_depth(tokenizer):
    first = make_sample(TASKS["niah_single_1"], tokenizer, 1024, 0, 0, WORDS, 0.0)
    last = make_sample(TASKS["niah_single_1"], tokenizer, 1024, 0, 0, WORDS, 1.0)
    (value,) = first.references
    assert re.fullmatch(r"\d{7}", value)
    key = re.search(r"One of the special magic numbers for (\S+) is: " + value + r"\.", first.prompt)[1]
    assert re.fullmatch(r"[a-z]+-[a-z]+", key)  # (an adjective-noun pair)
    assert first.prompt.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
        "the number afterwards.\nOne of the special magic numbers for ")  # (depth 0: the first line)
    assert first.prompt.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text? The "
                                 f"special magic number for {key} mentioned in the provided text is")
    lines = last.prompt.split("\n")
    assert lines[-2].startswith("One of the special magic numbers for ") and lines[1] == NOISE  # (depth 1: the last)
    assert first.depth == 0.0 and last.depth == 1.0


def test_plural_tasks_ask_for_every_value_of_every_key(tokenizer):
    values = make_sample(TASKS["niah_multivalue"], tokenizer, 1024, 0, 0, WORDS)
    assert len(values.references) == 4 and all(re.fullmatch(r"\d{7}", v) for v in values.references)
    (key,) = set(re.findall(r"One of the special magic numbers for (\S+) is: ", values.prompt))
    assert values.prompt.endswith(f"What are all the special magic numbers for {key} mentioned in the provided text? "
                                  f"The special magic numbers for {key} mentioned in the provided text are")
    queries = make_sample(TASKS["niah_multiquery"], tokenizer, 1024, 0, 0, WORDS)
    asked = re.search(r"for (\S+), (\S+), (\S+), and (\S+) mentioned in the provided text are$", queries.prompt)
    needles = dict(re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", queries.prompt))
    assert len(needles) == 4 and [needles[k] for k in asked.groups()] == queries.references
    keys = make_sample(TASKS["niah_multikey_1"], tokenizer, 1024, 0, 0, WORDS)
    assert len(set(re.findall(r"One of the special magic numbers for (\S+) is: ", keys.prompt))) == 4
    uuids = make_sample(TASKS["niah_multikey_3"], tokenizer, 1024, 0, 0, WORDS)
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert re.fullmatch(uuid, uuids.references[0]) and uuids.prompt.count("One of the special magic uuids for ") > 5
    assert uuids.prompt.startswith("A special magic uuid is hidden within the following text.")


def test_variable_tracking_is_one_chain_of_four_hops_after_one_example(tokenizer):
    sample = make_sample(TASKS["vt"], tokenizer, 2048, 0, 0, WORDS)
    names = sample.references
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    value = re.search(rf"VAR {names[0]} = (\d{{5}})", sample.prompt)[1]
    for before, after in zip(names, names[1:]):
        assert f"VAR {after} = VAR {before} " in sample.prompt
    assert sample.prompt.count("Memorize and track the chain(s) of variable assignment") == 2  # (the example first)
    assert sample.prompt.endswith(f"Question: Find all variables that are assigned the value {value} in the text above. "
                                  "Answer: According to the chain(s) of variable assignment in the text above, 5 "
                                  f"variables are assigned the value {value}, they are: ")


def test_common_and_frequent_words_answers_are_the_most_frequent_of_their_list(tokenizer):
    for length in (2048, 5000):  # (below RULER's 4096 the repeats are 6 and 1, above 30 and 3)
        sample = make_sample(TASKS["cwe"], tokenizer, length, 0, 0, WORDS)
        task = sample.prompt.rsplit("Below is a numbered list of words.", 1)[1]
        counts = collections.Counter(re.findall(r"\d+\. (\S+)", task))
        top = sorted(counts.values(), reverse=True)
        assert set(sample.references) == {w for w, c in counts.items() if c == top[0]} and len(sample.references) == 10
        assert (top[0], top[10]) == ((6, 1) if length < 4096 else (30, 3))
    sample = make_sample(TASKS["fwe"], tokenizer, 2048, 0, 0, WORDS)
    words = sample.prompt.split("coded words. ", 1)[1].split("\nQuestion:", 1)[0].split()
    ranked = [w for w, _ in collections.Counter(words).most_common()]
    assert ranked[0] == "..." and ranked[1:4] == sample.references
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in sample.references)


def test_a_length_too_short_for_a_task_is_refused_naming_it(tokenizer):
    with pytest.raises(ValueError, match=r"^length 512 is too short for RULER's cwe: \d+ tokens with the least "
                                         r"haystack, plus the 120 of its answer; give longer --lengths or leave cwe "
                                         r"out of --tasks$"):
        make_sample(TASKS["cwe"], tokenizer, 512, 0, 0, WORDS)


def test_largest_fitting_is_the_largest_size_that_fits():
    build = lambda n: "x" * n  # noqa: E731
    assert largest_fitting(build, lambda text: len(text) <= 37) == 37
    assert largest_fitting(build, lambda text: len(text) <= 1) == 1
    assert largest_fitting(build, lambda text: len(text) <= 1000, most=300) == 300
    with pytest.raises(ValueError):
        largest_fitting(build, lambda text: len(text) <= 0)


def test_string_match_all_is_rulers_partial_credit_case_insensitive():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all(" QUIZZICAL-aardvark ", ["quizzical-AARDVARK"]) == 1.0
    assert string_match_all("", ["1"]) == 0.0
    assert postprocess("  a\x00b\tc  ") == "a\nb\nc"


def test_summary_rows_intervals_and_effective_length():
    def records(method, task, length, scores, references=1):
        return [{"method": method, "task": task, "length": length, "trial": t, "score": s,
                 "references": ["x"] * references} for t, s in enumerate(scores)]

    rows = summarize_ruler(
        records("none", "niah_single_1", 1024, [1, 1, 1, 0]) + records("none", "vt", 1024, [1, 0.6, 0.6, 0.6], 5)
        + records("none", "niah_single_1", 2048, [1, 0, 0, 0]) + records("none", "vt", 2048, [0, 0, 0, 0], 5)
        + records("yarn", "niah_single_1", 1024, [1, 1, 1, 1]) + records("yarn", "vt", 1024, [1, 1, 1, 0.6], 5)
        + records("yarn", "niah_single_1", 2048, [1, 1, 1, 0]) + records("yarn", "vt", 2048, [1, 1, 0.6, 0.6], 5))
    cell = {(r["method"], r["task"], r["length"]): r for r in rows}
    assert cell[("none", "niah_single_1", 1024)]["score"] == pytest.approx(75.0)
    assert (cell[("none", "niah_single_1", 1024)]["low"], cell[("none", "niah_single_1", 1024)]["high"]) == \
        pytest.approx((30.0642, 95.4413), abs=1e-3)  # (Wilson, 3 of 4; statsmodels: 0.3006, 0.9544)
    assert cell[("none", "average", 1024)]["score"] == pytest.approx((75.0 + 70.0) / 2)
    assert cell[("none", "average", 1024)]["tasks"] == ["niah_single_1", "vt"]
    average = cell[("yarn", "average", 2048)]
    assert average["low"] <= average["score"] <= average["high"] and average["trials"] == 8
    agreeing = summarize_ruler(records("none", "niah_single_1", 1024, [1, 1]) + records("none", "vt", 1024, [0, 0]))
    average = next(r for r in agreeing if r["task"] == "average")  # (each task's trials agree: no certainty)
    assert average["score"] == 50.0 and average["low"] < 50.0 < average["high"]
    assert average["low"] == pytest.approx((34.2372 + 0.0) / 2, abs=1e-3)  # (the mean of the tasks' Wilson bounds)
    threshold, effective = effective_lengths(rows, None)  # (none's average at its shortest length)
    assert threshold == pytest.approx(72.5) and effective == {"none": 1024, "yarn": 2048}
    assert effective_lengths(rows, 95.0) == (95.0, {"none": None, "yarn": 1024})
    assert effective_lengths([r for r in rows if r["method"] == "yarn"], None) == (None, {})
    assert [trial_depth("niah_single_2", t, [0.0, 0.5]) for t in range(3)] == [0.0, 0.5, 0.0]
    assert trial_depth("vt", 0, [0.5]) is None and trial_depth("niah_multikey_2", 0, [0.5]) is None


def _ruler(checkpoint, text, out, *extra):
    return main(["eval", "ruler", "--model", str(checkpoint), "--text-files", str(text), "--lengths", "1k",
                 "--tasks", "niah_single_1,niah_single_2,vt,fwe", "--trials", "2", "--depths", "0.25,0.75",
                 "--methods", "none,yarn:factor=4", "--out", str(out), *extra])


def test_cli_eval_ruler_writes_scores_resumes_and_refuses_another_configuration(tmp_path, tiny_checkpoint, capsys):
    checkpoint, text = tiny_checkpoint
    out = tmp_path / "ruler"
    assert _ruler(checkpoint, text, out) == 0
    printed = capsys.readouterr().out
    assert "RULER score (x100), the mean over this run's 4 task(s) x 2 trial(s), with its 95% interval" in printed
    assert "effective length (longest length whose score, and every shorter one's, is >= " in printed
    results = json.loads((out / "ruler.json").read_text())
    assert len(results["records"]) == 2 * 4 * 2
    record = results["records"][0]
    assert record["prompt_tokens"] + TASKS[record["task"]].answer_tokens <= 1024
    assert {r["depth"] for r in results["records"] if r["task"] == "niah_single_2"} == {0.25, 0.75}
    assert {(r["method"], r["task"]) for r in results["summary"]} == {
        (m, t) for m in ("none", "yarn:factor=4") for t in ("niah_single_1", "niah_single_2", "vt", "fwe", "average")}
    assert (out / "ruler.png").stat().st_size > 10_000 and (out / "ruler_depths.png").stat().st_size > 10_000
    lines = (out / "ruler_records.jsonl").read_text().splitlines()
    assert _ruler(checkpoint, text, out, "--no-plot") == 0  # (resumed: nothing recomputed)
    assert (out / "ruler_records.jsonl").read_text().splitlines() == lines
    assert _ruler(checkpoint, text, out, "--no-plot", "--trials", "3") == 0  # (one trial more: only it runs)
    assert len((out / "ruler_records.jsonl").read_text().splitlines()) == len(lines) + 2 * 4
    assert _ruler(checkpoint, text, out, "--no-plot", "--depths", "0.5") == 2
    assert "depths: [0.25, 0.75] before, [0.5] now" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--tasks", "niah"], "argument --tasks: unknown task 'niah'; valid tasks: all, niah_single_1,"),
    (["--threshold", "101"], "argument --threshold: must be a score in [0, 100] (RULER's scale, e.g. 85.6), got '101'"),
    (["--tasks", ""], "argument --tasks: give at least one task, or all: niah_single_1, "),
    (["--tasks", "all,vt"], "argument --tasks: 'all' stands alone (every task); got 'all,vt'"),
    (["--lengths", "256"], "length 256 is too short for RULER's vt: "),
    (["binary"], "--text-files: "),
    (["--tasks", "vt"], "--text-files: no task of --tasks vt takes its haystack from a text (those that do: "
                        "niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue, niah_multiquery); leave "
                        "it out"),
    (["--tasks", "niah_multikey_1"], ("--depths: no task of --tasks niah_multikey_1 places a needle at a depth "
                                      "(those that do: niah_single_1, niah_single_2, niah_single_3); leave it out")),
    (["--depths", "0,0.5,1"], ("--depths: 3 depths, one per trial in turn, but --trials 2 reaches the first 2; give "
                               "--trials 3 or more, or fewer depths")),
    (["blank"], "blank.txt for the haystack of niah_single_2; give a text"),
    (["--device", "auto"], "--device auto spreads the model over the GPUs (accelerate's device map), and this "
                           "machine "),
])
def test_cli_eval_ruler_refuses_bad_options_in_one_line(tmp_path, tiny_checkpoint, capsys, extra, message):
    checkpoint, text = tiny_checkpoint
    if extra == ["binary"]:  # (a haystack text that is not UTF-8: named with its option)
        text = tmp_path / "bin.dat"
        text.write_bytes(b"\x00\x90\xff\xfe" * 10)
        extra = []
    if extra == ["blank"]:  # (a text of no words: refused before the model loads, not as "none was given")
        text = tmp_path / "blank.txt"
        text.write_text(" \n\t\n")
        extra = []
    assert _ruler(checkpoint, text, tmp_path / "bad", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad" / "ruler_records.jsonl").exists()


@pytest.mark.parametrize(("command", "message"), [
    (["eval", "ruler", "--lengths", "256"], "rope-ext: error: --lengths: length 256 is too short for RULER's vt: "),
    (["eval", "passkey", "--lengths", "10"], ("rope-ext: error: --lengths: length 10 is too short for the passkey "
                                              "prompt (")),
])
def test_a_length_too_short_for_the_prompt_is_refused_with_the_tokenizer_alone(tmp_path, tiny_checkpoint, capsys,
                                                                               monkeypatch, command, message):
    import rope_ext.cli.evaluate

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded")

    checkpoint, _ = tiny_checkpoint
    monkeypatch.setattr(rope_ext.cli.evaluate, "load_for_evaluation", loaded)
    extra = ["--tasks", "vt", "--trials", "1"] if command[1] == "ruler" else []
    assert main([*command, *extra, "--model", str(checkpoint), "--methods", "none", "--out", str(tmp_path / "run"),
                 "--no-plot"]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_loaded_early_is_the_one_the_evaluation_uses(tiny_checkpoint, monkeypatch):
    """The tokenizer that measured the lengths before the model loaded is handed on (not loaded twice)."""
    import argparse

    import rope_ext.runs.models
    from rope_ext.eval.plan import early_tokenizer, load_for_evaluation

    checkpoint, _ = tiny_checkpoint
    args = argparse.Namespace(model=str(checkpoint), threads=0, dtype="float32", evaluation="ruler", methods={})
    early = early_tokenizer(args)
    assert early is not None
    assert early_tokenizer(argparse.Namespace(model=str(checkpoint) + "-missing")) is None  # (the load names why)
    monkeypatch.setattr(rope_ext.runs.models, "load_tokenizer", lambda *a, **k: pytest.fail("loaded twice"))
    _, tokenizer, _ = load_for_evaluation(args, early)
    assert tokenizer is early


def test_ruler_json_holds_the_effective_lengths_with_their_threshold_and_its_source(tmp_path, tiny_checkpoint):
    checkpoint, _ = tiny_checkpoint
    out = tmp_path / "ruler"
    command = ["eval", "ruler", "--model", str(checkpoint), "--lengths", "1k", "--tasks", "niah_single_1", "--trials",
               "1", "--depths", "0.5", "--methods", "none,yarn:factor=4", "--out", str(out), "--no-plot"]
    assert main(command) == 0
    results = json.loads((out / "ruler.json").read_text())
    threshold, lengths = effective_lengths(results["summary"], None)
    assert results["effective_length"] == {
        "threshold": threshold, "lengths": lengths,
        "threshold_from": "the unpatched model's (none) average at its shortest length, 1024"}
    assert set(lengths) == {"none", "yarn:factor=4"} and lengths["none"] == 1024  # (none holds its own threshold)
    assert main([*command, "--threshold", "100"]) == 0  # (resumed: the tables rewritten at the threshold given)
    results = json.loads((out / "ruler.json").read_text())
    assert results["effective_length"] == {"threshold": 100.0, "threshold_from": "--threshold",
                                           "lengths": effective_lengths(results["summary"], 100.0)[1]}
    assert list(results) == ["run", "summary", "effective_length", "records"]
    from rope_ext.eval.plot import ruler_figure  # (the plot draws ruler.json's threshold, not the unpatched model's)

    (axis,) = ruler_figure(results).axes
    assert [line.get_ydata()[0] for line in axis.lines if line.get_gid() == "threshold"] == [100.0]
    assert [t.get_text() for t in axis.texts if t.get_gid() == "threshold"] == [
        " threshold 100.0 (given with --threshold)"]
    shown = {m: "<1k" if n is None else f"{n // 1024}k" for m, n in results["effective_length"]["lengths"].items()}
    assert [t.get_text() for t in axis.get_legend().get_texts()] == [f"{m} (effective {n})" for m, n in shown.items()]
    yarn = [r for r in results["summary"] if r["method"] == "yarn:factor=4"]
    assert effective_summary(yarn, None) == {"threshold": None, "lengths": {}, "threshold_from": "nothing: no "
                                             "--threshold given and no unpatched model (none) among the results"}


def test_summary_rows_are_in_one_order_whatever_the_order_of_the_records():
    """A resumed run appends its records after the folder's (another method, length, task or trial): the summary
    comes out as a run in one go writes it, intervals included: by method as given, length, task, the average last."""
    def records(method, task, length, scores):
        return [{"method": method, "task": task, "length": length, "trial": t, "score": s, "references": ["x", "y"]}
                for t, s in enumerate(scores)]

    cells = [(m, t, L) for m in ("none", "yarn") for L in (1024, 2048) for t in ("niah_single_1", "vt")]
    one_go = [r for m, t, L in cells for r in records(m, t, L, [1, 0.5, 0, 0.5])]
    def earlier(r):  # (the folder's records, written first: 2048's first two trials, and yarn's vt)
        return r["length"] == 2048 and r["trial"] < 2 or r["method"] == "yarn" and r["task"] == "vt"

    resumed = [r for r in one_go if earlier(r)] + [r for r in one_go if not earlier(r)]
    assert resumed != one_go
    rows = summarize_ruler(one_go, ["none", "yarn"], ["niah_single_1", "vt"])
    assert summarize_ruler(resumed, ["none", "yarn"], ["niah_single_1", "vt"]) == rows
    assert [(r["method"], r["length"], r["task"]) for r in rows[:6]] == [
        ("none", 1024, "niah_single_1"), ("none", 1024, "vt"), ("none", 1024, "average"),
        ("none", 2048, "niah_single_1"), ("none", 2048, "vt"), ("none", 2048, "average")]
    given = summarize_ruler(resumed, ["yarn", "none"], ["vt", "niah_single_1"])  # (the order given)
    assert [(r["method"], r["task"]) for r in given[:3]] == [("yarn", "vt"), ("yarn", "niah_single_1"),
                                                             ("yarn", "average")]



def test_the_default_depths_are_five_quarters_whatever_the_trials():
    """Without --depths: 0, 0.25, 0.5, 0.75, 1 (the first ``trials`` used; a folder's later runs add the rest), for
    any tasks; given depths come back as given."""
    from rope_ext.cli.evaluate import ruler_depths

    for trials in (1, 2, 5, 9):
        assert ruler_depths(None, ["fwe"], trials) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert ruler_depths([0.1, 0.9], ["niah_single_1", "vt"], 2) == [0.1, 0.9]
