"""Evaluation runs: every method over documents and lengths, resumable, with results files and plots.

A method is a list of configs: ``[]`` is the unpatched model, one config a single method, several a
combination (``rope_ext.patch`` takes the list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from tqdm.auto import tqdm

from rope_ext.eval.data import Document
from rope_ext.eval.objectives import FIXED_TARGET_PROTOCOLS
from rope_ext.eval.passkey import PasskeyRecord, passkey_key, passkey_trial, summarize_passkey
from rope_ext.eval.prefix import PrefixCache
from rope_ext.eval.perplexity import PerplexityRecord, evaluate_document, record_key, summarize, target_spans
from rope_ext.families.limits import position_limit
from rope_ext.methods import MethodConfig
from rope_ext.runs.results import ResultStore
from rope_ext.runs.saved import with_method

Methods = dict[str, list[MethodConfig]]  # spec as given -> its configs


def check_methods(
    model: nn.Module, methods: Methods, site_options: dict[str, Any] | None = None,
    lengths: list[int] | None = None,
) -> dict[str, int]:
    """Patch and unpatch once with every method, so one the model cannot take fails before any work. With
    ``lengths`` (the positions a trial reads, its answer included): the methods that leave the model's positions
    short of the longest (a learned table), each with the positions it reaches (``{spec: limit}``: the run leaves out
    the lengths past it); one that reaches none of the lengths is refused."""
    short: dict[str, int] = {}
    for spec, configs in methods.items():
        try:
            limit = with_method(model, configs, lambda: position_limit(model), site_options)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValueError(f"method {spec!r} cannot patch this model: {error}") from None
        if not lengths or limit is None or max(lengths) <= limit:
            continue
        if min(lengths) > limit:
            raise ValueError(
                f"method {spec!r}: this model's learned position table reaches {limit} positions, and the shortest "
                f"length asked is {min(lengths)}; {_further(configs)}, or replace it with a bias (alibi, kerple, "
                f"sandwich, fire), or leave {spec!r} out of --methods, or evaluate shorter lengths"
            )
        short[spec] = limit
    return short


def _further(configs: list[MethodConfig]) -> str:
    return ("give abs_interp a larger factor" if any(c.method == "abs_interp" for c in configs)
            else "read it further with abs_interp, abs_hierarchical or sinusoidal")


def left_out(short: dict[str, int], methods: Methods, lengths: list[int]) -> list[str]:
    """One line per method whose learned table stops short of some lengths: the lengths the run leaves out."""
    lines = []
    for spec, limit in short.items():
        out = [str(L) for L in sorted(lengths) if L > limit]
        which = f"length {out[0]} is" if len(out) == 1 else f"lengths {', '.join(out)} are"
        lines.append(f"method {spec!r}: this model's learned position table reaches {limit} positions; {which} left "
                     f"out for it ({_further(methods[spec])} to evaluate {'it' if len(out) == 1 else 'them'})")
    return lines


def _config_dicts(configs: list[MethodConfig]) -> list[dict[str, Any]]:
    return [config.to_dict() for config in configs]


def _dynamic(configs: list[MethodConfig]) -> bool:
    return any(getattr(config, "dynamic", False) for config in configs)


def plan_targets(
    documents: list[Document], lengths: list[int], protocol: str, target_tokens: int
) -> dict[str, dict[int, tuple[int, int]]]:
    """Per document title, ``{L: (start, end)}`` for the lengths it provides (see ``target_spans``)."""
    return {d.title: target_spans(d, lengths, protocol, target_tokens) for d in documents}


def target_ends(plan: dict[str, dict[int, tuple[int, int]]]) -> dict[str, int | None]:
    """Per document, one past the last position the run scores (None: no length fits): with the protocol
    and ``target_tokens``, what a results folder must keep for its records to stay comparable."""
    return {title: max((end for _, end in spans.values()), default=None) for title, spans in plan.items()}


def folder_lengths(run_config: dict[str, Any] | None, records: list[dict[str, Any]]) -> list[int]:
    """The lengths that decided a results folder's targets: its run configuration's ``lengths`` (older
    folders: the lengths of its records and, fixed and curve, each document's target end)."""
    if not run_config:
        return []
    lengths = {int(L) for L in run_config.get("lengths") or []}
    lengths |= {int(r["length"]) for r in records if isinstance(r.get("length"), int)}
    if run_config.get("protocol") in (*FIXED_TARGET_PROTOCOLS, "curve"):
        lengths |= {int(end) for end in (run_config.get("target_end") or {}).values() if isinstance(end, int)}
    return sorted(lengths)


def added_lengths_problem(
    documents: list[Document], folder: list[int], lengths: list[int], protocol: str, target_tokens: int
) -> str | None:
    """Why adding ``lengths`` to a folder whose targets ``folder`` decided would change the positions its
    records score (None: it would not). Lengths can be added only where they leave the targets as they were:
    fixed -- up to the folder's longest length (the targets are the last ``target_tokens`` tokens before it);
    curve -- beyond its last length (an earlier one would split a bucket); sliding -- anywhere."""
    if not folder or protocol == "sliding":
        return None
    before = plan_targets(documents, folder, protocol, target_tokens)

    def moves(length: int) -> bool:
        after = plan_targets(documents, sorted({*folder, length}), protocol, target_tokens)
        return any(after[title].get(L) != span for title, spans in before.items() for L, span in spans.items())

    bad = [L for L in sorted(set(lengths) - set(folder)) if moves(L)]
    if not bad:
        return None
    given = ",".join(map(str, bad))
    longest = max(end for spans in before.values() for _, end in spans.values()) if any(before.values()) else None
    if protocol in FIXED_TARGET_PROTOCOLS:
        return (
            f"whose targets --lengths {given} would move: the {protocol} protocol scores the last {target_tokens} "
            f"tokens before the longest length, and the folder's is {longest}. Lengths can be added only where they "
            f"leave the targets as they were: here above --target-tokens {target_tokens} and up to {longest}, without "
            f"restating the folder's lengths ({','.join(map(str, folder))})"
        )
    last = max(folder)
    return (
        f"whose buckets --lengths {given} would split: the curve protocol scores each length's bucket (previous "
        f"length, length], and the folder's lengths are {','.join(map(str, folder))}. Lengths can be added only "
        f"where they leave the buckets as they were: here beyond the last, {last}, without restating the folder's"
    )


def _records_as(cls: type, store: ResultStore, records: list[dict[str, Any]]) -> list[Any]:
    try:
        return [cls(**r) for r in records]
    except TypeError as error:  # a line that is JSON but not a record of this kind
        raise ValueError(
            f"{store.records_path} holds a line that is not a {store.kind} record ({error}); fix or delete it, or "
            "pass --overwrite to start the folder afresh"
        ) from None


def run_perplexity(
    model: nn.Module,
    documents: list[Document],
    methods: Methods,
    lengths: list[int],
    store: ResultStore,
    *,
    protocol: str = "fixed",
    target_tokens: int = 1024,
    stride: int = 256,
    site_options: dict[str, Any] | None = None,
    log: Callable[[str], None] = tqdm.write,
    target_lengths: list[int] | None = None,
    tokenizer: Any = None,
    limits: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Evaluate every method on every document at every usable length; returns the summary rows. The objective
    protocols (``masked-lm``, ``span-corruption``) need the ``tokenizer``. ``limits`` (``check_methods``): a
    method's lengths past its learned table are left out.

    ``target_lengths`` (default ``lengths``; it must include them) decide the positions scored, see
    ``target_spans``: a resumed folder's lengths with this run's, so that a run of only the lengths it adds
    scores the folder's targets. Only ``lengths`` are evaluated.

    Records already in ``store`` are kept only when they scored the positions this run would; a record
    of the same method, document and length that scored others is refused (``--overwrite`` replaces
    the folder's records).
    """
    target_lengths = sorted(set(target_lengths or lengths) | set(lengths))
    wanted = set(lengths)
    plan = plan_targets(documents, target_lengths, protocol, target_tokens)
    for document in documents:
        for length in sorted(wanted - set(plan[document.title])):
            reason = f"target {target_tokens} tokens" if length <= target_tokens else f"{document.num_tokens} tokens"
            log(f"skipping length {length} for {document.title!r}: it provides {reason}, not enough (no padding)")
    done: set[tuple] = set()
    for r in store.records():
        planned = plan.get(r.get("document"), {}).get(r.get("length")) if r.get("protocol") == protocol else None
        if r.get("method") not in methods or planned is None:
            continue
        if (r.get("start"), r.get("end")) != planned:
            store.refuse(
                f"that score other positions than this run: {r['method']} / {r['document']!r} at length "
                f"{r['length']} scored [{r.get('start')}, {r.get('end')}), this run scores [{planned[0]}, {planned[1]})"
            )
            done.clear()
            break
        done.add(record_key(r["method"], r["protocol"], r["document"], r["length"]))
    limits = limits or {}
    work = [(spec, document) for spec in methods for document in documents]
    todo_lengths = {d.title: [L for L in plan[d.title] if L in wanted] for d in documents}
    reach = {spec: limits.get(spec, max(target_lengths)) for spec in methods}
    bar = tqdm(total=sum(sum(L <= reach[s] for L in todo_lengths[d.title]) for s, d in work), unit="len")
    for spec, document in work:
        configs = methods[spec]
        bar.set_description(f"{spec} / {document.title}")
        skip = lambda length: (  # noqa: E731
            length not in wanted or length > reach[spec] or record_key(spec, protocol, document.title, length) in done
        )

        def evaluate() -> None:
            for record in evaluate_document(
                model,
                document,
                target_lengths,
                method=spec,
                config=_config_dicts(configs),
                dynamic=_dynamic(configs),
                protocol=protocol,
                target_tokens=target_tokens,
                stride=stride,
                skip=skip,
                tokenizer=tokenizer,
            ):
                store.append(record.to_dict())
                bar.update(1)

        bar.update(sum(1 for length in todo_lengths[document.title] if length <= reach[spec] and skip(length)))
        with_method(model, configs, evaluate, site_options)
    bar.close()
    # the tables cover every record of the folder (all of one run configuration: earlier runs' methods and
    # lengths too); the summary returned is this run's
    kept = store.records()
    store.write_tables(kept, summarize(_records_as(PerplexityRecord, store, kept), methods))
    records = [
        r
        for r in kept
        if r["method"] in methods and r["protocol"] == protocol and r["length"] in todo_lengths.get(r["document"], ())
    ]
    return summarize([PerplexityRecord(**r) for r in records], methods)


def run_passkey(
    model: nn.Module,
    tokenizer: Any,
    methods: Methods,
    lengths: list[int],
    depths: list[float],
    trials: int,
    store: ResultStore,
    *,
    seed: int = 0,
    site_options: dict[str, Any] | None = None,
    limits: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Passkey accuracy over the length x depth grid, ``trials`` keys per cell, for every method (``limits``: a
    method's lengths past its learned table are left out)."""
    previous = _records_as(PasskeyRecord, store, store.records())
    done = {passkey_key(r.method, r.length, r.depth, r.trial) for r in previous}
    limits = limits or {}
    grid = [(L, d, t) for L in lengths for d in depths for t in range(trials)]
    reach = {spec: limits.get(spec, max(lengths)) for spec in methods}
    cells_of = {spec: [cell for cell in grid if cell[0] <= reach[spec]] for spec in methods}
    bar = tqdm(total=sum(len(cells) for cells in cells_of.values()), unit="trial")
    for spec, configs in methods.items():
        bar.set_description(spec)
        cells = cells_of[spec]
        todo = [cell for cell in cells if passkey_key(spec, *cell) not in done]
        bar.update(len(cells) - len(todo))

        # (trials at one length and depth share the prompt up to the key: its cache reused, for static methods)
        prefix = PrefixCache(enabled=not _dynamic(configs))

        def evaluate() -> None:
            for length, depth, trial in todo:
                record = passkey_trial(
                    model, tokenizer, length, depth, trial, method=spec, config=_config_dicts(configs), seed=seed,
                    prefix=prefix,
                )
                store.append(record.to_dict())
                bar.update(1)

        with_method(model, configs, evaluate, site_options)
    bar.close()
    kept = store.records()  # (the tables cover every record of the folder, as for perplexity)
    store.write_tables(kept, summarize_passkey(_records_as(PasskeyRecord, store, kept), methods))
    wanted = {passkey_key(spec, *cell) for spec in methods for cell in cells_of[spec]}
    records = [r for r in kept if passkey_key(r["method"], r["length"], r["depth"], r["trial"]) in wanted]
    return summarize_passkey([PasskeyRecord(**r) for r in records], methods)
