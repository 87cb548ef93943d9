"""``rope-ext eval ppl``, ``rope-ext eval passkey`` and ``rope-ext plot``: the evaluation planned
(``rope_ext.eval.plan``), run (``rope_ext.eval.run``) into a resumable folder (``rope_ext.runs.results``), printed
and plotted."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from rope_ext.cli.options import joined
from rope_ext.eval.data import check_text_files, load_documents, tokenize_documents
from rope_ext.eval.intervals import wilson
from rope_ext.eval.passkey import ANSWER_POSITIONS, prompt_overhead
from rope_ext.eval.plan import (
    PPL_LABELS,
    PPL_MAY_CHANGE,
    check_ppl_options,
    common_run_config,
    early_run_config,
    early_tokenizer,
    load_for_evaluation,
    moved_windows,
    perplexity_options,
    perplexity_run,
    same_targets_config,
    site_options_of,
)
from rope_ext.eval.plot import RESULTS_FILES, plot_run
from rope_ext.eval.run import (
    added_lengths_problem,
    check_methods,
    folder_lengths,
    left_out,
    run_passkey,
    run_perplexity,
)
from rope_ext.families.base import find_family
from rope_ext.runs.folder import holds_model, normalised, resolved, writable_folder
from rope_ext.runs.results import ResultStore
from rope_ext.runs.saved import SAVED_WITHOUT_PATCH, SavedPatch, saved_with_patch, saved_without_patch
from rope_ext.runs.sources import check_model_source
from rope_ext.runs.specs import parse_methods

#: ``rope-ext eval ruler``'s needle depths when --depths is not given
RULER_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def check_out(out: str) -> None:
    """A folder an evaluation may write into: writable, and not a model's (``--overwrite`` would not be asked to
    delete a fine-tune's adapter, nor its records to sit beside one)."""
    writable_folder(out)
    found = holds_model(out)
    if found:
        raise ValueError(f"--out {out} holds a model ({found}): evaluation results go to a folder of their own; give "
                         "another --out (the model itself goes to --model)")


def choose_methods(args: argparse.Namespace) -> None:
    """``--methods`` left out: ``saved`` on a local model folder saved with a patch (a fine-tune, a ``rope-ext train``
    run: evaluated as trained), else the command's default list."""
    if args.methods is not None:
        if any(isinstance(configs, SavedPatch) for configs in args.methods.values()) and saved_without_patch(
                args.model):  # (known from its config.json: refused before the model loads)
            raise ValueError(f"--methods: {SAVED_WITHOUT_PATCH}")
        return
    if saved_with_patch(args.model):
        args.methods = parse_methods(SavedPatch.SPEC)
        print(f"--methods saved: {args.model} was saved with a patch, evaluated as trained (give --methods to compare "
              "others, e.g. --methods saved,none)")
    else:
        args.methods = parse_methods(args.default_methods)
        args.methods_by_default = True


def fitting_defaults(model: object, args: argparse.Namespace) -> None:
    """The default ``--methods`` cut to those the model's family takes (GPT-2 takes no RoPE method), saying which
    were left out; methods the user gave are checked, and refused, as given."""
    if not getattr(args, "methods_by_default", False):
        return
    try:
        support = find_family(model).support(model)
    except ValueError:  # (no family: check_methods says so)
        return
    unfit = {spec: next(c.hook for c in configs if not support.fits(c.method))
             for spec, configs in args.methods.items() if not all(support.fits(c.method) for c in configs)}
    if unfit:
        args.methods = {spec: configs for spec, configs in args.methods.items() if spec not in unfit}
        print(f"--methods (default {args.default_methods}): {', '.join(f'{s} ({h})' for s, h in unfit.items())} "
              f"left out: {support.label} takes {', '.join(sorted(support.kinds))} hooks; methods for it: "
              f"{', '.join(support.methods)}")


def print_table(rows: list[dict], value: str, fmt: str, title: str) -> None:
    print(f"\n{title}")
    if not rows:
        print("(no results)")
        return
    methods = list(dict.fromkeys(row["method"] for row in rows))
    lengths = sorted({row["length"] for row in rows})
    cell = {(row["method"], row["length"]): row[value] for row in rows}
    width = max(12, *(len(m) for m in methods))
    column = max(8, *(len(format(v, fmt)) for v in cell.values() if v is not None))
    print(f"{'method':{width}s} " + " ".join(f"{L:>{column}d}" for L in lengths))
    for method in methods:
        values = [cell.get((method, L)) for L in lengths]
        print(f"{method:{width}s} " + " ".join(f"{v:>{column}{fmt}}" if v is not None else f"{'-':>{column}s}"
                                                for v in values))


def finish(args: argparse.Namespace, out: Path) -> None:
    print(f"\nresults: {out}/")
    if not args.no_plot:
        for path in plot_run(out):
            print(f"plot written to {path}")


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    # every check before anything is written: a failed run must not leave a configuration behind
    if args.text_files:  # (comma- or space-separated; a file missing is named before the options it would go with)
        args.text_files = joined(args.text_files)
        check_text_files(args.text_files)
    check_ppl_options(args)
    check_out(args.out)
    choose_methods(args)
    site_options = site_options_of(args)  # (checked before the model loads)
    given = [option for option, value in (("--split", args.split), ("--text-column", args.text_column)) if value]
    if given and not args.dataset:
        raise ValueError(f"{' and '.join(given)}: only for --dataset (text files and the default corpus have neither)")
    args.text_column = args.text_column or "text"
    check_model_source("--model", args.model)  # (before the folder is compared with this run)
    store = ResultStore(args.out, "ppl", overwrite=args.overwrite)  # (reads the folder; writes nothing yet)
    store.precheck(early_run_config(args) | perplexity_options(args), may_change=PPL_MAY_CHANGE, normalise=normalised,
                   labels=PPL_LABELS)  # (before the model loads)
    data = load_documents(args.dataset, args.text_files, args.split, args.text_column)
    model, tokenizer, native = load_for_evaluation(args)
    fitting_defaults(model, args)
    every = tokenize_documents(data, tokenizer)
    lengths = args.lengths
    # resuming: the folder's lengths decide the targets with this run's, so that lengths can be added alone
    folder = folder_lengths(store.previous, store.records()) if same_targets_config(store.previous, args) else []
    end = [args.target_end] if args.target_end is not None else []  # (the targets placed apart from the lengths)
    target_lengths = sorted({*lengths, *folder, *end})
    moved = moved_windows(store.previous, args, target_lengths) if folder else None
    if moved:  # (before the documents are compared: other windows under the same names)
        store.refuse(*moved)
    documents, run_config = perplexity_run(args, every, target_lengths, native)
    store.configure(run_config, may_change=PPL_MAY_CHANGE, normalise=normalised, unchecked=("document_sha256",),
                    labels=PPL_LABELS)
    if folder and not store.stale:
        problem = added_lengths_problem(documents, folder, lengths, args.protocol, args.target_tokens)
        if problem:
            store.refuse(problem)
    if folder and store.stale:  # --overwrite: this run's lengths alone
        target_lengths = sorted({*lengths, *end})
        documents, run_config = perplexity_run(args, every, target_lengths, native)
        store.configure(run_config)
    limits = check_methods(model, args.methods, site_options, lengths)
    print(f"{len(documents)} document(s): " + ", ".join(f"{d.title} ({d.num_tokens} tokens)" for d in documents))
    if folder and set(target_lengths) != set(lengths):
        print(
            f"resuming {args.out}: the positions scored follow its lengths with this run's "
            f"({','.join(map(str, target_lengths))}); evaluating {','.join(map(str, lengths))}"
        )
    for line in left_out(limits, args.methods, lengths):
        print(line)
    if args.windows > 1:  # (a document holds as many windows as its tokens do: said, not silently fewer)
        print(f"--windows {args.windows}: {len(documents)} window(s) of {max(target_lengths)} tokens from the "
              f"document(s) ({', '.join(sorted({d.title.rsplit(' @', 1)[0] for d in documents}))})")
    summary = run_perplexity(
        model,
        documents,
        args.methods,
        lengths,
        store,
        protocol=args.protocol,
        target_tokens=args.target_tokens,
        stride=args.stride,
        site_options=site_options,
        target_lengths=target_lengths,
        tokenizer=tokenizer,
        limits=limits,
    )
    context = "no stated native context" if native is None else f"native context {native}"
    title = (f"perplexity ({args.protocol} protocol; {context}; this run's methods and lengths; every record of the "
             f"folder: {Path(args.out) / 'ppl_summary.csv'})")
    if not any(row["documents"] > 1 for row in summary):
        print_table(summary, "perplexity", ".2f", title)
    else:  # (several windows: each value with its 95% bootstrap interval, and the paired ratio to the unpatched)
        cells = [{**row, "cell": f"{row['perplexity']:.2f} ({row['low']:.2f}-{row['high']:.2f})"} for row in summary]
        print_table(cells, "cell", "s", f"{title}, with 95% intervals over {summary[0]['documents']} windows")
        ratios = [{**row, "cell": f"{row['ratio_to_none']:.3f} ({row['ratio_low']:.3f}-{row['ratio_high']:.3f})"}
                  for row in summary if row["ratio_to_none"] is not None]
        if ratios:
            print_table(ratios, "cell", "s", "perplexity / the unpatched model's on the same windows (paired), with "
                        "its 95% interval")
    finish(args, Path(args.out))
    return 0


def cmd_eval_passkey(args: argparse.Namespace) -> int:
    check_out(args.out)
    choose_methods(args)
    site_options = site_options_of(args)  # (checked before the model loads)
    check_model_source("--model", args.model)  # (before the folder is compared with this run)
    store = ResultStore(args.out, "passkey", overwrite=args.overwrite)  # (reads the folder; writes nothing yet)
    # ("answer_within_length": a trial's prompt and answer read L positions; folders of the earlier protocol, an
    # L-token prompt with its answer past L, are not resumed into)
    protocol = {"kind": "passkey", "seed": args.seed, "answer_within_length": True}
    store.precheck(early_run_config(args) | protocol, may_change=("model_name",), normalise=normalised)
    early = early_tokenizer(args)
    if early is not None:  # (the shortest length measured before the model loads)
        check_passkey_length(args.lengths[0], early)
    model, tokenizer, native = load_for_evaluation(args, early)
    fitting_defaults(model, args)
    limits = check_methods(model, args.methods, site_options, args.lengths)
    for line in left_out(limits, args.methods, args.lengths):
        print(line)
    run_config = common_run_config(args, native) | protocol
    store.configure(run_config, may_change=("model_name",), normalise=normalised)
    summary = run_passkey(
        model, tokenizer, args.methods, args.lengths, args.depths, args.trials, store, seed=args.seed,
        site_options=site_options, limits=limits,
    )
    by_length: dict[tuple, list[int]] = {}
    for row in summary:  # (every trial of a length pooled: correct, trials)
        pooled = by_length.setdefault((row["method"], row["length"]), [0, 0])
        pooled[0] += round(row["accuracy"] * row["trials"])
        pooled[1] += row["trials"]
    rows = [{"method": m, "length": L, "accuracy": _with_interval(*counts)} for (m, L), counts in by_length.items()]
    print_table(rows, "accuracy", "s", f"passkey accuracy over depths {args.depths} x {args.trials} trial(s), with "
                "its 95% Wilson interval")
    finish(args, Path(args.out))
    return 0


def check_passkey_length(length: int, tokenizer: object) -> None:
    overhead = prompt_overhead(tokenizer) + ANSWER_POSITIONS
    if length < overhead:
        raise ValueError(f"--lengths: length {length} is too short for the passkey prompt ({overhead} tokens before "
                         f"any filler, the answer's {ANSWER_POSITIONS} included)")


def check_ruler_lengths(args: argparse.Namespace, tokenizer: object, words: list[str]) -> None:
    """Each task's first sample at the shortest length, drawn with the tokenizer alone: a length too short for a
    task's prompt is refused before the model loads (``run_ruler`` draws the same sample again)."""
    from rope_ext.eval.ruler import trial_depth
    from rope_ext.eval.ruler_tasks import TASKS, make_sample

    for task in args.tasks:
        try:
            make_sample(TASKS[task], tokenizer, args.lengths[0], args.seed, 0, words, trial_depth(task, 0, args.depths))
        except ValueError as error:
            raise ValueError(f"--lengths: {error}") from None


def cmd_eval_ruler(args: argparse.Namespace) -> int:
    from rope_ext.eval.ruler import effective_lengths, run_ruler
    from rope_ext.eval.ruler_tasks import TASKS

    if args.text_files:
        args.text_files = joined(args.text_files)
        check_text_files(args.text_files)
    check_out(args.out)
    choose_methods(args)
    site_options = site_options_of(args)  # (checked before the model loads)
    check_model_source("--model", args.model)  # (before the folder is compared with this run)
    store = ResultStore(args.out, "ruler", overwrite=args.overwrite)  # (reads the folder; writes nothing yet)
    texts = [t for t in args.tasks if TASKS[t].haystack == "text"]
    if args.text_files and not texts:  # (said, not silently ignored)
        takers = ", ".join(t for t in TASKS if TASKS[t].haystack == "text")
        raise ValueError(f"--text-files: no task of --tasks {','.join(args.tasks)} takes its haystack from a text "
                         f"(those that do: {takers}); leave it out")
    words = haystack_words(args.text_files) if texts else []
    if texts and not words:
        raise ValueError(f"--text-files: no words in {', '.join(args.text_files)} for the haystack of "
                         f"{', '.join(texts)}; give a text")
    args.depths = ruler_depths(args.depths, args.tasks, args.trials)
    haystack = (resolved(args.text_files) or "kjv") if texts else None
    protocol = {"kind": "ruler", "seed": args.seed, "depths": args.depths, "haystack_text": haystack,
                "haystack_sha256": hashlib.sha256(" ".join(words).encode()).hexdigest() if texts else None,
                "decoding": "greedy"}
    store.precheck(early_run_config(args) | protocol, may_change=("model_name",), normalise=normalised,
                   labels=RULER_LABELS)
    early = early_tokenizer(args)
    if early is not None:  # (the shortest length measured before the model loads)
        check_ruler_lengths(args, early, words)
    model, tokenizer, native = load_for_evaluation(args, early)
    fitting_defaults(model, args)
    limits = check_methods(model, args.methods, site_options, args.lengths)
    for line in left_out(limits, args.methods, args.lengths):
        print(line)
    run_config = common_run_config(args, native) | protocol
    store.configure(run_config, may_change=("model_name",), normalise=normalised, unchecked=("haystack_sha256",),
                    labels=RULER_LABELS)
    summary = run_ruler(model, tokenizer, args.methods, args.tasks, args.lengths, args.trials, args.depths, store,
                        seed=args.seed, text_words=words, site_options=site_options, limits=limits,
                        threshold=args.threshold)
    rows = [{"method": r["method"], "length": r["length"],
             "score": f"{r['score']:.1f} ({r['low']:.0f}-{r['high']:.0f})"} for r in summary if r["task"] == "average"]
    print_table(rows, "score", "s", f"RULER score (x100), the mean over this run's {len(args.tasks)} task(s) x "
                f"{args.trials} trial(s), with its 95% interval; per task, and every record of the folder: "
                + str(Path(args.out) / "ruler_summary.csv"))
    threshold, effective = effective_lengths(summary, args.threshold)
    if threshold is None:
        print("effective length: give --threshold, or include the unpatched model (none) in --methods")
    else:
        source = "given" if args.threshold is not None else "the unpatched model's at the shortest length"
        print(f"effective length (longest length whose score, and every shorter one's, is >= {threshold:.1f}, "
              f"{source}): " + ", ".join(f"{m} {_length_or_below(v, args.lengths)}" for m, v in effective.items()))
    finish(args, Path(args.out))
    return 0


#: what a changed value of a ruler folder's key means
RULER_LABELS = {"haystack_sha256": "the haystack's text changed: the same files, other words",
                "haystack_text": "the text the haystack tasks draw from; None: no task of the run reads one, so a "
                                 "folder of such tasks takes no task that does, give it another --out"}


def _length_or_below(length: int | None, lengths: list[int]) -> str:
    return f"<{min(lengths)}" if length is None else str(length)


def ruler_depths(depths: list[float] | None, tasks: list[str], trials: int) -> list[float]:
    """The single-needle tasks' depths, one per trial in turn: those given (refused where no task of the run takes a
    depth, or where the trials would leave some unused), else ``RULER_DEPTHS`` (the first ``trials`` of them used:
    a folder's later runs add trials at the rest)."""
    from rope_ext.eval.ruler_tasks import TASKS

    if depths is None:
        return list(RULER_DEPTHS)
    if not any(TASKS[t].takes_depth for t in tasks):
        takers = ", ".join(t for t in TASKS if TASKS[t].takes_depth)
        raise ValueError(f"--depths: no task of --tasks {','.join(tasks)} places a needle at a depth (those that "
                         f"do: {takers}); leave it out")
    if len(depths) > trials:
        raise ValueError(f"--depths: {len(depths)} depths, one per trial in turn, but --trials {trials} reaches the "
                         f"first {trials}; give --trials {len(depths)} or more, or fewer depths")
    return depths


def haystack_words(text_files: list[str] | None) -> list[str]:
    """The words of the text tasks' haystack: the files given, else the King James Bible."""
    if text_files:
        words = []
        for path in text_files:
            try:
                words += Path(path).read_text(encoding="utf-8").split()
            except UnicodeDecodeError as error:
                raise ValueError(f"--text-files: {path} is not UTF-8 text ({error})") from None
        return words
    from rope_ext.eval.corpus import kjv_text

    return kjv_text().split()


def _with_interval(correct: int, trials: int) -> str:
    low, high = wilson(correct, trials)
    return f"{correct / trials:.0%} ({low:.0%}-{high:.0%})"


def cmd_plot(args: argparse.Namespace) -> int:
    folder = Path(args.results)
    if not folder.exists():
        raise FileNotFoundError(f"{args.results}: no such folder; give a results folder (the --out of rope-ext eval)")
    if not folder.is_dir():
        raise ValueError(f"{args.results} is a file; give a results folder (the --out of rope-ext eval)")
    found = [folder / name for name in RESULTS_FILES if (folder / name).exists()]
    empty = []
    for path in found:
        try:
            summary = json.loads(path.read_text()).get("summary")
        except (ValueError, AttributeError):
            break  # (plot_run names a file rope-ext did not write)
        if isinstance(summary, list) and not summary:
            empty.append(path.name)
    if found and len(empty) == len(found):
        raise ValueError(
            f"{' and '.join(empty)} in {args.results} {'hold' if len(empty) > 1 else 'holds'} no results (an empty "
            "summary): nothing to plot; "
            "run `rope-ext eval ...` into it first"
        )
    for path in plot_run(args.results):
        print(f"plot written to {path}")
    return 0

