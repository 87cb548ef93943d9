"""Planning an evaluation before anything runs: the model loaded and checked against the protocol, the options
checked together, the documents and target positions chosen, and the run configuration a results folder records.

The functions take the evaluation's options as attributes of one object (``args``: the command line's namespace, or
any object with the same attributes), so every check happens before anything is written.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from rope_ext.eval.data import windows as split_windows
from rope_ext.eval.objectives import absolute_table_rows, check_target_tokens, framing, model_protocols
from rope_ext.eval.run import plan_targets, target_ends
from rope_ext.runs.devices import check_device, placed
from rope_ext.runs.folder import resolved
from rope_ext.runs.saved import keep_saved_patch
from rope_ext.runs.sources import load_given_model


def early_tokenizer(args: argparse.Namespace) -> Any:
    """``args.model``'s tokenizer loaded alone, before the model, for checks that need only it (a length too short
    for a prompt); ``None`` where it does not load: ``load_model`` loads it the same way, so ``load_for_evaluation``
    then fails and names why."""
    from rope_ext.runs.models import load_tokenizer

    try:
        return load_tokenizer(args.model, beside_model=True)
    except (OSError, ValueError):
        return None


def load_for_evaluation(args: argparse.Namespace, tokenizer: Any = None) -> tuple[Any, Any, int | None]:
    """``(model, tokenizer, native context)`` of ``args.model``, checked against the protocol; a model saved while
    patched is unpatched first (its patch kept for the spec ``saved``). ``tokenizer``: ``early_tokenizer``'s."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = getattr(args, "device", "cpu")
    check_device(device)  # (before the model loads)
    model, tokenizer = load_given_model("--model", args.model, getattr(torch, args.dtype), tokenizer)
    model = placed(model, device)
    check_protocol(args, model, tokenizer)
    saved = keep_saved_patch(model, getattr(args, "methods", {}))
    if saved:  # a folder saved while patched: every method starts from the unpatched model, 'saved' re-applies it
        print(f"{args.model}: saved with rope_ext patch {'+'.join(c.method for c in saved)}; evaluating from the "
              "unpatched model ('saved' in --methods: as saved, with its parameters)")
    # (T5 states no context: its buckets are relative)
    native = getattr(model.config, "max_position_embeddings", None)
    return model, tokenizer, native


def check_protocol(args: argparse.Namespace, model: Any, tokenizer: Any) -> None:
    """The evaluation fits the model's objective: passkey and the next-token protocols a causal LM, ``masked-lm`` a
    masked LM (DeBERTa), ``span-corruption`` T5; ``eval ppl`` without ``--protocol`` takes the model's first."""
    try:
        valid = model_protocols(model)
    except ValueError as error:
        raise ValueError(f"--model {args.model!r}: {error}") from None
    kind = type(model).__name__
    if args.evaluation in ("passkey", "ruler"):
        if "fixed" not in valid:
            what = ("passkey retrieval generates the key" if args.evaluation == "passkey"
                    else "RULER's tasks generate their answers")
            raise ValueError(f"--model {args.model!r} is a {kind}, not a causal language model: {what}; evaluate it "
                             f"with rope-ext eval ppl --protocol {valid[0]}")
        return
    if args.protocol is None:
        args.protocol = valid[0]
        check_ppl_options(args)
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


def model_label(model: str) -> str:
    if model == "default":
        return "SmolLM2-135M-Instruct"
    return Path(os.path.realpath(model)).name if os.path.isdir(model) else model


def common_run_config(args: argparse.Namespace, native: int | None) -> dict:
    """What every evaluation's folder records (the device where it is not the CPU: a folder of CPU results resumes
    only on the CPU, and one of a GPU's only there)."""
    device = getattr(args, "device", "cpu")
    return {
        "model": resolved(args.model),
        "model_name": model_label(args.model),
        "dtype": args.dtype,
        **({"device": device} if device != "cpu" else {}),
        "native_context": native,
        "site_options": site_options_of(args),
    }


def early_run_config(args: argparse.Namespace) -> dict:
    """``common_run_config`` but for what needs the model (its native context): checked against a folder before
    the model loads (``ResultStore.precheck``)."""
    return {key: value for key, value in common_run_config(args, None).items() if key != "native_context"}


def site_options_of(args: argparse.Namespace) -> dict:
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


#: ``rope_ext.eval.perplexity.PROTOCOLS`` (here without importing torch)
PROTOCOLS = ("fixed", "curve", "sliding", "masked-lm", "span-corruption")


#: the protocols that score the last --target-tokens of each length (None: the model's own, every one of them such)
FIXED_TARGETS = (None, "fixed", "masked-lm", "span-corruption")


def fixed_targets(args: argparse.Namespace) -> bool:
    return args.protocol in FIXED_TARGETS


#: ``--target-tokens`` and ``--stride`` when not given (``None`` on the parser: given ones are told from defaults)
DEFAULT_TARGET_TOKENS = 1024
DEFAULT_STRIDE = 256


def check_ppl_options(args: argparse.Namespace) -> None:
    """Refuse values that cannot run, and an option the protocol does not read (given, not defaulted); called again
    once a model's own protocol is known."""
    if not hasattr(args, "given"):
        args.given = {name for name in ("target_tokens", "stride") if getattr(args, name, None) is not None}
        args.target_tokens = DEFAULT_TARGET_TOKENS if args.target_tokens is None else args.target_tokens
        args.stride = DEFAULT_STRIDE if args.stride is None else args.stride
    if args.protocol is not None and "target_tokens" in args.given and not fixed_targets(args):
        *first, last = filter(None, FIXED_TARGETS)
        protocols = f"{', '.join(first)} and {last}"
        raise ValueError(f"--target-tokens: only for the {protocols} protocols; --protocol {args.protocol} scores "
                         "every token of each length (leave --target-tokens out)")
    for name, given in (("--windows", getattr(args, "windows", 1) != 1),
                        ("--target-end", getattr(args, "target_end", None) is not None)):
        if given and args.protocol is not None and not fixed_targets(args):
            raise ValueError(f"{name}: only for the fixed-target protocols (fixed, masked-lm, span-corruption); "
                             f"--protocol {args.protocol} scores every token of each length")
    end = getattr(args, "target_end", None)
    if end is not None and end < max(args.lengths):
        raise ValueError(f"--target-end {end}: below the longest of --lengths ({max(args.lengths)}); the targets end "
                         "where every length's context can end, at or past the longest")
    if args.protocol not in (None, "sliding") and "stride" in args.given:
        raise ValueError(f"--stride: only for --protocol sliding (leave it out with --protocol {args.protocol})")
    lengths = args.lengths
    protocol = args.protocol or "fixed-target"  # (None: the model's own, decided once it loads; each is one)
    if fixed_targets(args) and args.target_tokens >= lengths[0]:  # (a folder's longer lengths: checked on resuming)
        short = ",".join(str(L) for L in lengths if L <= args.target_tokens)
        raise ValueError(
            f"--lengths {short}: not above --target-tokens {args.target_tokens}: the {protocol} protocol scores the "
            f"last --target-tokens tokens of each length, with context before them; give lengths above "
            f"{args.target_tokens}, or lower --target-tokens"
        )
    if args.protocol == "sliding" and args.stride > lengths[0]:
        raise ValueError(f"--stride {args.stride} must be at most the shortest of --lengths ({lengths[0]})")


def same_targets_config(previous: dict | None, args: argparse.Namespace) -> bool:
    """Whether a folder's run scored its lengths the way this run would (protocol, target tokens, stride)."""
    return bool(previous) and (previous.get("protocol"), previous.get("target_tokens"), previous.get("stride")) == (
        args.protocol,
        args.target_tokens if fixed_targets(args) else None,
        args.stride if args.protocol == "sliding" else None,
    )


def moved_windows(previous: dict | None, args: argparse.Namespace, target_lengths: list[int]) -> tuple[str, str] | None:
    """Why a folder of ``--windows`` results cannot resume with targets ending elsewhere, and how it could (``None``:
    the end stays): its windows are each document's stretches of the target end's tokens, so another end scores
    other windows under the same names (``doc.txt @0``), which would read as a changed document."""
    windows = getattr(args, "windows", 1)
    if not previous or windows <= 1 or (previous.get("windows") or 1) <= 1 or not previous.get("lengths"):
        return None
    before, now = max(previous["lengths"]), max(target_lengths)
    if before == now:
        return None
    if getattr(args, "target_end", None) == now:
        option, resume = "--target-end", f"re-run with --target-end {before} to resume"
    else:
        option, resume = "the longest of --lengths", f"re-run with lengths up to {before} to resume"
    return (f"whose targets differ (where they end, {option}: {before} before, {now} now): --windows {windows} scores "
            "each document's windows of the target end's tokens, so another end scores other windows"), resume


def perplexity_run(args: argparse.Namespace, every: list, target_lengths: list[int], native: int) -> tuple[list, dict]:
    """The documents of the run and its configuration, for targets decided by ``target_lengths``."""
    lengths = args.lengths
    if not every:
        raise ValueError("the data holds no document")
    longest = every[0]  # (longest first)
    also = f" and above --target-tokens {args.target_tokens}" if fixed_targets(args) else ""

    def unfilled(too_long: list[int]) -> ValueError:
        named = ",".join(map(str, too_long))
        end = getattr(args, "target_end", None)
        whose = "" if set(too_long) & set(lengths) else (
            " (--target-end)" if too_long == [end] else " (the results folder's, which this run resumes)")
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
    windows = getattr(args, "windows", 1)
    if windows > 1:  # (each document's consecutive stretches of the target end's tokens: independent windows)
        documents = split_windows(documents, max(target_lengths), windows)
    plan = plan_targets(documents, target_lengths, args.protocol, args.target_tokens)
    missing = [L for L in lengths if not any(L in spans for spans in plan.values())]
    if missing:  # (a --min-tokens below them): a length no document provides is an error, never a skip
        raise unfilled(missing)
    run_config = common_run_config(args, native) | perplexity_options(args) | {
        "min_tokens": min_tokens,
        "documents": args.documents,
        "lengths": target_lengths,
        "target_end": target_ends(plan),
        "document_sha256": {d.title: d.fingerprint() for d in documents},
    } | ({"windows": windows} if windows > 1 else {})
    return documents, run_config


def perplexity_options(args: argparse.Namespace) -> dict:
    """What a perplexity folder records of the options alone (compared before the model loads, with
    ``early_run_config``): the protocol and what it decides only where ``--protocol`` is given (else the model's)."""
    protocol = {
        "protocol": args.protocol,
        "target_tokens": args.target_tokens if fixed_targets(args) else None,
        "stride": args.stride if args.protocol == "sliding" else None,
    } if args.protocol is not None else {}
    return {
        "kind": "perplexity",
        **protocol,
        "dataset": resolved(args.dataset) or ("text files" if args.text_files else "kjv"),
        "text_files": resolved(args.text_files),
        "split": args.split or "train",
        "text_column": args.text_column,
    }


#: run configuration keys that may change when a folder resumes: the lengths (added as the protocol allows,
#: see ``added_lengths_problem``), the target ends they decide, the label, and how the documents were chosen
#: (they are compared by title and content, ``document_sha256``)
PPL_MAY_CHANGE = ("model_name", "lengths", "target_end", "min_tokens", "documents")


PPL_LABELS = {"document_sha256": "the document changed: same name, other text"}

