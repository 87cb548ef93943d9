"""``rope-ext``: evaluate context-extension methods, plot results, list methods and families.

    rope-ext eval ppl --model default --methods none,yarn:factor=4 --lengths 2k,4k,8k,16k --out results/run1
    rope-ext eval passkey --methods none,yarn:factor=2 --lengths 4k,8k,12k --depths 0.1,0.5,0.9 --out results/run1
    rope-ext plot results/run1

Method specs: name[:key=value...], methods of different hook kinds combined with '+' (a+b:key=value), or
'none' (the unpatched model); values are JSON (4, 1.5, true, null, [1,1.5,2]) or else plain strings.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rope_ext.methods.spec import parse_spec, split_spec
from rope_ext.train.config import MAX_THREADS

if TYPE_CHECKING:
    from rope_ext.methods import MethodConfig

# The main job (`make demo`): ~10 minutes of forwards on a 2-core CPU (fp32 forwards of the default model take
# ~10 s at 4k, ~30 s at 8k, ~65 s at 12k). PI (~3x worse at every length without fine-tuning) and the 2k
# column (flat, like 4k) are left to `--methods` / `--lengths`; 12k shows what happens past the native 8192.
# DCA is the attention method with the lowest fixed-target perplexity at 32k (README, "Attention methods:
# quality").
DEFAULT_METHODS = "none,yarn:factor=2,dynamic_ntk:factor=2,dca"
DEFAULT_LENGTHS = "4k,8k,12k"
DTYPES = ("float32", "bfloat16", "float16")
MAX_TRIALS = 10_000  # keys per cell: more is a typo, not a run


def parse_method_spec(spec: str) -> list[MethodConfig]:
    """``"yarn:factor=4:beta_fast=16"`` -> ``[YarnConfig(factor=4, beta_fast=16)]``; ``"none"`` -> ``[]``;
    ``"a:x=1+b:y=2"`` -> both configs (a combination for ``rope_ext.patch``: one method per hook kind)."""
    from rope_ext.methods import make_configs

    text = spec.strip()
    if text == "none":
        return []
    if any(name == "none" for name, _ in parse_spec(text)):
        raise ValueError(f"'none' (the unpatched model) takes no options and combines with nothing, got {spec!r}")
    return list(make_configs(text))


def parse_methods(text: str) -> dict[str, list[MethodConfig]]:
    """``"none,yarn:factor=4"`` -> ``{"none": [], "yarn:factor=4": [YarnConfig(factor=4)]}``; commas inside
    brackets belong to a value (``longrope:long_factor=[1,1.5]``)."""
    specs = [spec.strip() for spec in split_spec(text, ",")]
    if not any(specs):
        raise ValueError("give at least one method, e.g. none,yarn:factor=4")
    if not all(specs):
        raise ValueError(f"an empty method spec in {text!r} (two commas in a row, or one at an end); give each method once")
    for before, spec in zip(specs, specs[1:]):
        name = parse_spec(spec)[0][0] if spec else ""
        if "=" in name:  # "self_extend:G=4,W=16": an option after a comma, read as a method
            raise ValueError(
                f"{spec!r} after {before!r} is an option, not a method: options are separated by ':' "
                f"({before}:{spec}); commas separate methods"
            )
    from rope_ext.eval.run import SavedPatch

    return {spec: SavedPatch() if spec == SavedPatch.SPEC else parse_method_spec(spec) for spec in specs}


# --- option values ----------------------------------------------------------------------------------


def parse_depths(text: str) -> list[float]:
    depths = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            depth = float(part)
        except ValueError:
            depth = math.nan
        if not 0 <= depth <= 1:
            raise ValueError(f"malformed depth {part!r}; give comma-separated numbers in [0, 1], e.g. 0.1,0.5,0.9")
        depths.add(depth)
    if not depths:
        raise ValueError("give at least one depth in [0, 1], e.g. 0.1,0.5,0.9")
    return sorted(depths)


def _layer_types(text: str) -> list[str]:
    layer_types = [part.strip() for part in text.split(",") if part.strip()]
    if not layer_types:
        raise ValueError("give at least one layer type, e.g. full_attention,sliding_attention")
    return layer_types


def _lengths(text: str) -> list[int]:
    from rope_ext.eval.perplexity import parse_lengths

    return parse_lengths(text)


def _min_tokens(text: str) -> int:
    from rope_ext.eval.perplexity import parse_length

    return 0 if text.strip() == "0" else parse_length(text)


def _text(text: str) -> str:
    """A value that must not be empty."""
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def _model(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty; give 'default', a folder written by save_pretrained, or a hub id")
    if text != "default" and os.path.exists(text) and not os.path.isdir(text):
        raise ValueError(f"{text!r} is a file; give 'default', a folder written by save_pretrained, or a hub id")
    return text


def _folder(text: str) -> str:
    """A folder to write into: an existing folder, or a path that can be created as one."""
    if not text.strip():
        raise ValueError("must not be empty; give a folder (created if missing)")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{text!r} is a file; give a folder (created if missing)")
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{text!r} cannot be created: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{text!r} cannot be written: no write permission in {str(parent)!r}")
    return text


def _dataset(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty; give a folder written by Dataset.save_to_disk, or a hub dataset name")
    if os.path.exists(text) and not os.path.isdir(text):
        raise ValueError(
            f"{text!r} is a file; give a folder written by Dataset.save_to_disk (or a hub dataset name), or the "
            "file to --text-files"
        )
    return text


def _option(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` whose ``ValueError`` message reaches the user (argparse would replace it)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__.strip("_")
    return convert


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text!r}")
        return value

    convert.__name__ = f"integer >= {low}"
    return convert


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be an integer, got {text!r}") from None


# --- commands ---------------------------------------------------------------------------------------


def _method_doc(cls: type) -> str:
    """A method config's docstring; for a config without one, its entry in its module's docstring
    (``* ``name`` -- ...``); dataclasses' generated ``Name(field: type = ...)`` is no documentation."""
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):
        doc = ""
    if not doc.strip():
        module = inspect.getmodule(cls)
        pattern = rf"^\* ``{re.escape(cls.method)}`` -- (.*?)(?=^\* |^\S|\Z)"
        match = re.search(pattern, (module.__doc__ or "") if module else "", flags=re.MULTILINE | re.DOTALL)
        doc = match[1] if match else ""
    return inspect.cleandoc(doc) if doc.strip() else ""


def _first_sentence(doc: str) -> str:
    """The first sentence of a docstring on one line, without reST's double backquotes."""
    text = " ".join(doc.split()).replace("``", "")
    if not text:
        return "(no description)"
    match = re.search(r"(?<=[.:])\s(?=[A-Z(])", text)
    return text[: match.start()].rstrip(":") if match else text


def _cmd_methods(args: argparse.Namespace) -> int:
    from rope_ext.methods import get_method_class, list_methods

    if args.name is None:
        names = list_methods()
        width = max(len(name) for name in names) + 2
        for name in names:
            cls = get_method_class(name)
            print(f"{name:{width}s}{cls.hook:12s} {_first_sentence(_method_doc(cls))}")
        print("\n`rope-ext methods NAME`: a method's options, their types and defaults, and its documentation")
        return 0
    cls = get_method_class(args.name.strip())  # (unknown: ValueError naming the valid methods)
    print(f"{cls.method} (hook kind: {cls.hook})\n")
    doc = _method_doc(cls)
    if doc:
        print(doc + "\n")
    fields = {field.name: field for field in dataclasses.fields(cls)}
    rows = []
    for name in cls.option_names():
        field = fields[name]
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        if name == "factor" and hasattr(cls, "default_factor"):  # (frequency methods: required, or a default)
            kind, default = "float", cls.default_factor if cls.default_factor is not None else dataclasses.MISSING
        if default is dataclasses.MISSING or name in cls.required_options:
            shown = "(required)"
        elif default is None:
            shown = "None: derived when patching (from the model's context and the other options)"
        else:
            shown = repr(default)
        rows.append((name, kind, shown))
    print("options (set in a spec as name:option=value):")
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, kind, shown in rows:
        print(f"  {name:{widths[0]}s}  {kind:{widths[1]}s}  {shown}")
    return 0


def _cmd_families(args: argparse.Namespace) -> int:
    from rope_ext.families import get_family, list_families

    names = list_families()
    width = max(len(name) for name in names) + 2
    for name in names:
        family = get_family(name)
        print(f"{name:{width}s}hooks: {', '.join(sorted(family.hooks))}; methods: {', '.join(family.methods)}")
    return 0


def _check_out(out: str) -> None:
    _folder(out)


def _resolved(value: Any) -> Any:
    """A local path resolved (``doc.txt`` and its absolute path, ``dir`` and ``dir/`` are one input); 'default',
    hub ids and other values as they are."""
    if isinstance(value, list):
        return [_resolved(item) for item in value]
    if isinstance(value, str) and value not in ("default", "kjv", "text files") and os.path.exists(value):
        return os.path.realpath(value)
    return value


def _normalised(key: str, value: Any) -> Any:
    """Run configuration values as compared: paths resolved (a folder's older run files kept them as given)."""
    return _resolved(value) if key in ("model", "dataset", "text_files") else value


def _load(args: argparse.Namespace):
    import torch

    from rope_ext.models import MissingTokenizer, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    except MissingTokenizer as error:
        raise ValueError(f"--model {error}") from None
    except (OSError, ValueError) as error:
        if args.model == "default":
            raise
        found = "a folder" if Path(args.model).is_dir() else "no such folder, nor a hub model available"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--model {args.model!r}: cannot load it ({found}: {reason}); give 'default', a folder written by "
            "save_pretrained, or a hub id (downloading needs HF_HUB_OFFLINE unset)"
        ) from None
    _check_protocol(args, model, tokenizer)
    from rope_ext.eval.run import keep_saved_patch

    saved = keep_saved_patch(model, getattr(args, "methods", {}))
    if saved:  # a folder saved while patched: every method starts from the unpatched model, 'saved' re-applies it
        print(f"{args.model}: saved with rope_ext patch {'+'.join(c.method for c in saved)}; evaluating from the "
              "unpatched model ('saved' in --methods: as saved, with its parameters)")
    # (T5 states no context: its buckets are relative)
    native = getattr(model.config, "max_position_embeddings", None)
    return model, tokenizer, native


def _check_protocol(args: argparse.Namespace, model: Any, tokenizer: Any) -> None:
    """The evaluation fits the model's objective: passkey and the next-token protocols a causal LM, ``masked-lm`` a
    masked LM (DeBERTa), ``span-corruption`` T5; ``eval ppl`` without ``--protocol`` takes the model's first."""
    from rope_ext.eval.objectives import absolute_table_rows, check_target_tokens, framing, model_protocols

    try:
        valid = model_protocols(model)
    except ValueError as error:
        raise ValueError(f"--model {args.model!r}: {error}") from None
    kind = type(model).__name__
    if args.evaluation == "passkey":
        if "fixed" not in valid:
            raise ValueError(f"--model {args.model!r} is a {kind}, not a causal language model: passkey retrieval "
                             f"generates the key; evaluate it with rope-ext eval ppl --protocol {valid[0]}")
        return
    if args.protocol is None:
        args.protocol = valid[0]
        _check_ppl_options(args)
    elif args.protocol not in valid:
        raise ValueError(f"--protocol {args.protocol}: a {kind} is evaluated with --protocol {' or '.join(valid)}")
    check_target_tokens(args.protocol, args.target_tokens)
    rows = absolute_table_rows(model) if args.protocol == "masked-lm" else None
    framed = sum(part.numel() for part in framing(tokenizer))
    if rows is not None and max(args.lengths) + framed > rows:
        also = " ([CLS] and [SEP] included)" if framed else ""
        raise ValueError(
            f"--lengths {max(args.lengths)}: this {kind} adds an absolute position table of {rows} rows, which ends "
            f"there{also}; evaluate lengths up to {rows - framed}"
        )


def _model_name(model: str) -> str:
    if model == "default":
        return "SmolLM2-135M-Instruct"
    return Path(os.path.realpath(model)).name if os.path.isdir(model) else model


def _common_run_config(args: argparse.Namespace, native: int) -> dict:
    return {
        "model": _resolved(args.model),
        "model_name": _model_name(args.model),
        "dtype": args.dtype,
        "native_context": native,
        "site_options": _site_options(args),
    }


def _site_options(args: argparse.Namespace) -> dict:
    """``rope_ext.patch`` options of the model's sites, given on the command line (refused when no method
    patches: they would configure nothing, yet be recorded with the run)."""
    options: dict[str, Any] = {}
    if args.replace_scaling:
        options["replace_scaling"] = True
    if args.layer_types:
        options["layer_types"] = args.layer_types
    if options and not any(args.methods.values()):
        given = " and ".join(f"--{name.replace('_', '-')}" for name in options)
        raise ValueError(f"{given}: only with a method that patches the model (--methods has only 'none')")
    return options


def _print_table(rows: list[dict], value: str, fmt: str, title: str) -> None:
    print(f"\n{title}")
    if not rows:
        print("(no results)")
        return
    methods = list(dict.fromkeys(row["method"] for row in rows))
    lengths = sorted({row["length"] for row in rows})
    cell = {(row["method"], row["length"]): row[value] for row in rows}
    width = max(12, *(len(m) for m in methods))
    print(f"{'method':{width}s} " + " ".join(f"{L:>8d}" for L in lengths))
    for method in methods:
        values = [cell.get((method, L)) for L in lengths]
        print(f"{method:{width}s} " + " ".join(f"{v:>8{fmt}}" if v is not None else f"{'-':>8s}" for v in values))


def _finish(args: argparse.Namespace, out: Path) -> None:
    from rope_ext.eval.plot import plot_run

    print(f"\nresults: {out}/")
    if not args.no_plot:
        for path in plot_run(out):
            print(f"plot written to {path}")


#: ``rope_ext.eval.perplexity.PROTOCOLS`` (here without importing torch)
_PROTOCOLS = ("fixed", "curve", "sliding", "masked-lm", "span-corruption")
#: the protocols that score the last --target-tokens of each length (None: the model's own, every one of them such)
_FIXED_TARGETS = (None, "fixed", "masked-lm", "span-corruption")


def _fixed_targets(args: argparse.Namespace) -> bool:
    return args.protocol in _FIXED_TARGETS


def _check_ppl_options(args: argparse.Namespace) -> None:
    lengths = args.lengths
    protocol = args.protocol or "fixed-target"  # (None: the model's own, decided once it loads; each is one)
    if _fixed_targets(args) and args.target_tokens >= lengths[-1]:
        raise ValueError(
            f"--target-tokens {args.target_tokens} must be smaller than the longest of --lengths ({lengths[-1]}): "
            f"the {protocol} protocol scores the last --target-tokens tokens of each length"
        )
    if _fixed_targets(args) and args.target_tokens >= lengths[0]:
        short = ",".join(str(L) for L in lengths if L <= args.target_tokens)
        raise ValueError(
            f"--lengths {short}: not above --target-tokens {args.target_tokens}: the {protocol} protocol scores the "
            f"last --target-tokens tokens of each length, with context before them; give lengths above "
            f"{args.target_tokens}, or lower --target-tokens"
        )
    if args.protocol == "sliding" and args.stride > lengths[0]:
        raise ValueError(f"--stride {args.stride} must be at most the shortest of --lengths ({lengths[0]})")


def _same_targets_config(previous: dict | None, args: argparse.Namespace) -> bool:
    """Whether a folder's run scored its lengths the way this run would (protocol, target tokens, stride)."""
    return bool(previous) and (previous.get("protocol"), previous.get("target_tokens"), previous.get("stride")) == (
        args.protocol,
        args.target_tokens if _fixed_targets(args) else None,
        args.stride if args.protocol == "sliding" else None,
    )


def _ppl_run(args: argparse.Namespace, every: list, target_lengths: list[int], native: int) -> tuple[list, dict]:
    """The documents of the run and its configuration, for targets decided by ``target_lengths``."""
    from rope_ext.eval.run import plan_targets, target_ends

    lengths = args.lengths
    if not every:
        raise ValueError("the data holds no document")
    longest = every[0]  # (longest first)
    also = f" and above --target-tokens {args.target_tokens}" if _fixed_targets(args) else ""

    def unfilled(too_long: list[int]) -> ValueError:
        named = ",".join(map(str, too_long))
        whose = "" if set(too_long) & set(lengths) else " (the results folder's, which this run resumes)"
        return ValueError(
            f"--lengths {named}{whose}: no document is that long (the longest, {longest.title!r}, has "
            f"{longest.num_tokens} tokens); give lengths up to {longest.num_tokens}{also}, or longer texts"
        )

    # by default a document must provide the longest length: a short run keeps short documents
    min_tokens = args.min_tokens if args.min_tokens is not None else max(target_lengths)
    documents = [d for d in every if d.num_tokens >= min_tokens][: args.documents]
    if not documents:
        if args.min_tokens is None:
            raise unfilled([L for L in target_lengths if L > longest.num_tokens])
        raise ValueError(
            f"--min-tokens {min_tokens}: no document has at least {min_tokens} tokens (the longest, "
            f"{longest.title!r}, has {longest.num_tokens}); lower --min-tokens or give longer texts"
        )
    plan = plan_targets(documents, target_lengths, args.protocol, args.target_tokens)
    missing = [L for L in lengths if not any(L in spans for spans in plan.values())]
    if missing:  # (a --min-tokens below them): a length no document provides is an error, never a skip
        raise unfilled(missing)
    run_config = _common_run_config(args, native) | {
        "kind": "perplexity",
        "protocol": args.protocol,
        "target_tokens": args.target_tokens if _fixed_targets(args) else None,
        "stride": args.stride if args.protocol == "sliding" else None,
        "dataset": _resolved(args.dataset) or ("text files" if args.text_files else "kjv"),
        "text_files": _resolved(args.text_files),
        "split": args.split or "train",
        "text_column": args.text_column,
        "min_tokens": min_tokens,
        "documents": args.documents,
        "lengths": target_lengths,
        "target_end": target_ends(plan),
        "document_sha256": {d.title: d.fingerprint() for d in documents},
    }
    return documents, run_config


#: run configuration keys that may change when a folder resumes: the lengths (added as the protocol allows,
#: see ``added_lengths_problem``), the target ends they decide, the label, and how the documents were chosen
#: (they are compared by title and content, ``document_sha256``)
_MAY_CHANGE = ("model_name", "lengths", "target_end", "min_tokens", "documents")
_LABELS = {"document_sha256": "the document changed: same name, other text"}


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    from rope_ext.eval.data import load_documents, tokenize_documents
    from rope_ext.eval.results import ResultStore
    from rope_ext.eval.run import added_lengths_problem, check_methods, folder_lengths, run_perplexity

    # every check before anything is written: a failed run must not leave a configuration behind
    _check_ppl_options(args)
    _check_out(args.out)
    site_options = _site_options(args)  # (checked before the model loads)
    given = [option for option, value in (("--split", args.split), ("--text-column", args.text_column)) if value]
    if given and not args.dataset:
        raise ValueError(f"{' and '.join(given)}: only for --dataset (text files and the default corpus have neither)")
    args.text_column = args.text_column or "text"
    store = ResultStore(args.out, "ppl", overwrite=args.overwrite)  # (reads the folder; writes nothing yet)
    data = load_documents(args.dataset, args.text_files, args.split, args.text_column)
    model, tokenizer, native = _load(args)
    every = tokenize_documents(data, tokenizer)
    lengths = args.lengths
    # resuming: the folder's lengths decide the targets with this run's, so that lengths can be added alone
    folder = folder_lengths(store.previous, store.records()) if _same_targets_config(store.previous, args) else []
    target_lengths = sorted({*lengths, *folder})
    documents, run_config = _ppl_run(args, every, target_lengths, native)
    store.configure(run_config, may_change=_MAY_CHANGE, normalise=_normalised, unchecked=("document_sha256",),
                    labels=_LABELS)
    if folder and not store.stale:
        problem = added_lengths_problem(documents, folder, lengths, args.protocol, args.target_tokens)
        if problem:
            store.refuse(problem)
    if folder and store.stale:  # --overwrite: this run's lengths alone
        target_lengths = lengths
        documents, run_config = _ppl_run(args, every, target_lengths, native)
        store.configure(run_config)
    check_methods(model, args.methods, site_options, longest=max(lengths))
    print(f"{len(documents)} document(s): " + ", ".join(f"{d.title} ({d.num_tokens} tokens)" for d in documents))
    if set(target_lengths) != set(lengths):
        print(
            f"resuming {args.out}: the positions scored follow its lengths with this run's "
            f"({','.join(map(str, target_lengths))}); evaluating {','.join(map(str, lengths))}"
        )
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
    )
    context = "no stated native context" if native is None else f"native context {native}"
    _print_table(summary, "perplexity", ".2f", f"perplexity ({args.protocol} protocol; {context}; this run's methods "
                 f"and lengths; every record of the folder: {Path(args.out) / 'ppl_summary.csv'})")
    _finish(args, Path(args.out))
    return 0


def _cmd_eval_passkey(args: argparse.Namespace) -> int:
    from rope_ext.eval.passkey import prompt_overhead
    from rope_ext.eval.results import ResultStore
    from rope_ext.eval.run import check_methods, run_passkey

    _check_out(args.out)
    site_options = _site_options(args)  # (checked before the model loads)
    store = ResultStore(args.out, "passkey", overwrite=args.overwrite)  # (reads the folder; writes nothing yet)
    model, tokenizer, native = _load(args)
    overhead = prompt_overhead(tokenizer)
    if args.lengths[0] < overhead:
        raise ValueError(
            f"--lengths: length {args.lengths[0]} is too short for the passkey prompt ({overhead} tokens before "
            "any filler)"
        )
    check_methods(model, args.methods, site_options, longest=max(args.lengths))
    run_config = _common_run_config(args, native) | {"kind": "passkey", "seed": args.seed}
    store.configure(run_config, may_change=("model_name",), normalise=_normalised)
    summary = run_passkey(
        model, tokenizer, args.methods, args.lengths, args.depths, args.trials, store, seed=args.seed,
        site_options=site_options,
    )
    by_length: dict[tuple, list[float]] = {}
    for row in summary:
        by_length.setdefault((row["method"], row["length"]), []).append(row["accuracy"])
    rows = [{"method": m, "length": L, "accuracy": sum(v) / len(v)} for (m, L), v in by_length.items()]
    _print_table(rows, "accuracy", ".0%", f"passkey accuracy, mean over depths {args.depths} x {args.trials} trial(s)")
    _finish(args, Path(args.out))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    import json

    from rope_ext.eval.plot import plot_run

    folder = Path(args.results)
    if not folder.exists():
        raise FileNotFoundError(f"{args.results}: no such folder; give a results folder (the --out of rope-ext eval)")
    if not folder.is_dir():
        raise ValueError(f"{args.results} is a file; give a results folder (the --out of rope-ext eval)")
    found = [folder / name for name in ("ppl.json", "passkey.json") if (folder / name).exists()]
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


def _cmd_finetune(args: argparse.Namespace) -> int:
    from rope_ext.train.config import FinetuneConfig
    from rope_ext.train.finetune import finetune

    flags = {name: getattr(args, name) for name in _config_fields(FinetuneConfig)}
    config = FinetuneConfig.from_sources(args.config, flags)
    record = finetune(config, overwrite=args.overwrite).record
    if record:
        _print_run(record)
        if not config.full:
            print(f"output: {config.out}/ (rope-ext merge {config.out} OUT: a standalone model)")
        else:
            print(f"output: {config.out}/ (a standalone model: rope_ext.from_pretrained({str(config.out)!r}))")
    return 0


def _print_run(record: dict) -> None:
    print(f"\n{record['steps']} steps in {record['train_seconds']:.0f} s; final loss {record['final_loss']:.4f}")
    for row in record["evals"]:
        print(f"step {row['step']}: perplexity {row['perplexity']:.3f} ({row['document']}, last {row['target_tokens']} "
              f"of {row['length']} tokens)")


def _cmd_train(args: argparse.Namespace) -> int:
    from rope_ext.train.config import TrainConfig
    from rope_ext.train.pretrain import train

    flags = {name: getattr(args, name) for name in _config_fields(TrainConfig)}
    config = TrainConfig.from_sources(args.config, flags)
    record = train(config, overwrite=args.overwrite).record
    if record:
        _print_run(record)
        print(f"output: {config.out}/ (rope_ext.from_pretrained({str(config.out)!r}); rope-ext eval ppl --model "
              f"{config.out} --methods saved,...: 'saved' evaluates it as trained)")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from rope_ext.train.finetune import merge

    path = merge(args.folder, args.out, overwrite=args.overwrite)
    print(f"merged model written to {path}/ (load it with rope_ext.from_pretrained)")
    return 0


def _config_fields(cls: type) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls)]


def _add_config_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the run configuration ``cls`` (``FinetuneConfig``, ``TrainConfig``); a flag left out
    keeps the YAML file's value, else the default."""
    import dataclasses

    parser.add_argument("--config", type=_option(_text), action=_Once,
                        help="a YAML file of options (flags given here override it)")
    parser.add_argument("--overwrite", action="store_true", help="start again in a folder of another run")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ",".join(default) if isinstance(default, list) else default
        help_text = f.metadata.get("help", "")
        if "default" not in help_text:
            help_text += f" (default: {shown})"
        kind = str(f.type)
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif "list" in kind:
            parser.add_argument(flag, type=_option(_names), nargs="+", action=_Flatten, default=None,
                                help=help_text + "; comma- or space-separated")
        elif "int" in kind:
            parser.add_argument(flag, type=_option(_integer), default=None, help=help_text)
        elif kind == "float":
            parser.add_argument(flag, type=_option(_number), default=None, help=help_text)
        else:
            parser.add_argument(flag, type=_option(_text), default=None, choices=f.metadata.get("choices"),
                                help=help_text)


class _Once(argparse.Action):
    """An option given at most once (a second ``--config`` would silently replace the first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest) is not None:
            raise argparse.ArgumentError(self, "given twice; give one file (flags override it)")
        setattr(namespace, self.dest, values)


class _Flatten(argparse.Action):
    """``--exclude a,b c`` -> ``["a", "b", "c"]``."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [name for group in values for name in group])


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("give comma-separated names")
    return names


def _integer(text: str) -> int:
    from rope_ext.eval.perplexity import parse_length

    try:
        return int(text)
    except ValueError:
        try:
            return parse_length(text)  # (4k = 4096)
        except ValueError:
            raise ValueError(f"must be an integer (4k = 4096), got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"must be a number, got {text!r}")
    return value


# --- parser -----------------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """Reports bad arguments the way ``main`` reports every error: ``rope-ext: error: ...``, status 2."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see {self.prog} --help)")


def _add_model_options(parser: argparse.ArgumentParser, methods: str, lengths: str, out: str) -> None:
    parser.add_argument(
        "--model", type=_option(_model), default="default",
        help="'default' (embedded SmolLM2-135M), a folder or a hub id",
    )
    parser.add_argument(
        "--methods",
        type=_option(parse_methods),
        default=methods,
        help="comma-separated method specs: name[:key=value...], '+' combines methods, 'none' is the unpatched "
        "model; values are JSON (default: %(default)s)",
    )
    parser.add_argument(
        "--lengths", type=_option(_lengths), default=lengths, help="comma-separated token counts, 4k = 4096 "
        "(default: %(default)s)"
    )
    parser.add_argument(
        "--replace-scaling", action="store_true",
        help="let the methods replace the RoPE scaling the checkpoint already has (refused otherwise)",
    )
    parser.add_argument(
        "--layer-types", type=_option(_layer_types), default=None,
        help="comma-separated layer types to patch on models with several (Gemma 3: default full_attention)",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument(
        "--threads", type=_int_at_least(0, MAX_THREADS), default=0, help="torch threads (default 0: torch's choice)"
    )
    parser.add_argument("--out", type=_option(_folder), default=out, help="results folder (default: %(default)s)")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace the folder's results where this run cannot resume them (another configuration or document, "
        "lengths that move the targets, unreadable files)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not plot at the end")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rope-ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    methods = sub.add_parser(
        "methods", help="list the registered methods; with a NAME, its options, their defaults and its documentation"
    )
    methods.add_argument("name", nargs="?", help="a method: its options (types, defaults) and documentation")
    methods.set_defaults(func=_cmd_methods)
    sub.add_parser("families", help="list the supported model families").set_defaults(func=_cmd_families)

    evaluate = sub.add_parser("eval", help="evaluate methods").add_subparsers(dest="evaluation", required=True)
    ppl = evaluate.add_parser("ppl", help="perplexity vs context length")
    _add_model_options(ppl, DEFAULT_METHODS, DEFAULT_LENGTHS, "results/main")
    ppl.add_argument(
        "--protocol", choices=_PROTOCOLS, default=None,
        help="fixed, curve or sliding (causal LMs; default fixed), masked-lm (DeBERTa and other masked LMs), "
        "span-corruption (T5); default: the model's first",
    )
    ppl.add_argument(
        "--target-tokens", type=_int_at_least(1), default=1024,
        help="fixed protocol: tokens scored; masked-lm and span-corruption: the tokens masked or corrupted in "
        "(default: %(default)s)",
    )
    ppl.add_argument(
        "--stride", type=_int_at_least(1), default=256, help="sliding protocol: window stride (default: %(default)s)"
    )
    data = ppl.add_mutually_exclusive_group()
    data.add_argument(
        "--dataset", type=_option(_dataset),
        help="a folder saved with Dataset.save_to_disk, or a hub dataset name (online)",
    )
    data.add_argument(
        "--text-files", nargs="+", type=_option(_text), help="plain-text files (UTF-8), one document each"
    )
    ppl.add_argument("--split", type=_option(_text), help="--dataset's split (default: train)")
    ppl.add_argument("--text-column", type=_option(_text), help="--dataset's text column (default: text)")
    ppl.add_argument(
        "--min-tokens", type=_option(_min_tokens), default=None,
        help="keep documents at least this long (default: the longest length, with the results folder's when "
        "resuming: every document provides every length)",
    )
    ppl.add_argument(
        "--documents", type=_int_at_least(1), default=1, help="at most this many documents, longest first (default: 1)"
    )
    ppl.set_defaults(func=_cmd_eval_ppl)

    passkey = evaluate.add_parser("passkey", help="passkey retrieval over a length x depth grid")
    _add_model_options(passkey, "none,yarn:factor=2,dynamic_ntk:factor=2", "4k,8k,12k", "results/passkey")
    passkey.add_argument(
        "--depths", type=_option(parse_depths), default="0.1,0.5,0.9", help="relative key positions in [0, 1] "
        "(default: %(default)s)"
    )
    passkey.add_argument(
        "--trials", type=_int_at_least(1, MAX_TRIALS), default=2, help="keys per cell (default: %(default)s)"
    )
    passkey.add_argument("--seed", type=_option(_seed), default=0, help="chooses the keys (default: %(default)s)")
    passkey.set_defaults(func=_cmd_eval_passkey)

    tune = sub.add_parser(
        "finetune", help="fine-tune a patched model for a longer context (LoRA via peft, PoSE, S2-Attn; accelerate)",
        description="Fine-tune a patched model (rope_ext.train). Options come from --config (YAML) and flags; a re-run "
        "with the same options resumes from the folder's newest checkpoint. Runs under `accelerate launch` as well.",
    )
    from rope_ext.train.config import FinetuneConfig, TrainConfig

    _add_config_options(tune, FinetuneConfig)
    tune.set_defaults(func=_cmd_finetune)

    training = sub.add_parser(
        "train", help="train a small model from scratch under a position method (GPT-2 or Llama; accelerate)",
        description="Train a small causal model built from a config (rope_ext.train.pretrain) under a position method "
        "(alibi, kerple, sandwich, fire, xpos...), to test it past its training length. Options come from --config "
        "(YAML) and flags; a re-run with the same options resumes. Runs under `accelerate launch` as well.",
    )
    _add_config_options(training, TrainConfig)
    training.set_defaults(func=_cmd_train)

    merging = sub.add_parser("merge", help="merge a fine-tune's LoRA adapter into its base: a standalone patched model")
    merging.add_argument("folder", type=_option(_text), help="the --out folder of rope-ext finetune")
    merging.add_argument("out", type=_option(_folder), help="where the merged model is written")
    merging.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")
    merging.set_defaults(func=_cmd_merge)

    plot = sub.add_parser("plot", help="draw the plots of a results folder")
    plot.add_argument("results", type=_option(_text), help="a results folder (the --out of rope-ext eval)")
    plot.set_defaults(func=_cmd_plot)
    return parser


def _silence_stdout() -> None:
    """After a closed pipe (``rope-ext families | head -1``): send what is left to /dev/null, so the
    interpreter's final flush does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return 128 + getattr(signal, "SIGPIPE", 13)  # what the shell reports for a tool killed by SIGPIPE
    except KeyboardInterrupt:
        print("rope-ext: interrupted (records written so far are kept: re-run to resume)", file=sys.stderr)
        return 130
    except (_UsageError, ValueError, OSError) as error:
        print(f"rope-ext: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
