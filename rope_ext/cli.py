"""``rope-ext``: evaluate context-extension methods, plot results, list methods and families.

    rope-ext eval ppl --model default --methods none,yarn:factor=4 --lengths 2k,4k,8k,16k --out results/run1
    rope-ext eval passkey --methods none,yarn:factor=2 --lengths 4k,8k,12k --depths 0.1,0.5,0.9 --out results/run1
    rope-ext plot results/run1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

DEFAULT_METHODS = "none,pi:factor=2,yarn:factor=2,dynamic_ntk:factor=2"
DEFAULT_LENGTHS = "2k,4k,8k,12k"
DTYPES = ("float32", "bfloat16", "float16")


def _cmd_methods(args: argparse.Namespace) -> int:
    from rope_ext.methods import get_method_class, list_methods

    for name in list_methods():
        cls = get_method_class(name)
        options = ", ".join(f.name for f in dataclasses.fields(cls))
        print(f"{name:14s} hook={cls.hook:10s} options: {options}")
    return 0


def _cmd_families(args: argparse.Namespace) -> int:
    from rope_ext.patches import get_family, list_families

    for name in list_families():
        print(f"{name:12s} hooks: {', '.join(sorted(get_family(name).hooks))}")
    return 0


def _load(args: argparse.Namespace):
    import torch

    from rope_ext.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    native = model.config.max_position_embeddings
    return model, tokenizer, native


def _common_run_config(args: argparse.Namespace, native: int) -> dict:
    return {
        "model": args.model,
        "model_name": "SmolLM2-135M-Instruct" if args.model == "default" else str(args.model),
        "dtype": args.dtype,
        "native_context": native,
    }


def _print_table(rows: list[dict], value: str, fmt: str, title: str) -> None:
    methods = list(dict.fromkeys(row["method"] for row in rows))
    lengths = sorted({row["length"] for row in rows})
    cell = {(row["method"], row["length"]): row[value] for row in rows}
    print(f"\n{title}")
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


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    from rope_ext.eval.data import load_documents, tokenize_documents
    from rope_ext.eval.perplexity import parse_length, parse_lengths
    from rope_ext.eval.results import ResultStore
    from rope_ext.eval.run import parse_methods, run_perplexity

    methods = parse_methods(args.methods)
    lengths = parse_lengths(args.lengths)
    min_tokens = parse_length(args.min_tokens) if args.min_tokens != "0" else 0
    data = load_documents(args.dataset, args.text_files, args.split, args.text_column)  # fail fast on bad data
    model, tokenizer, native = _load(args)
    run_config = _common_run_config(args, native) | {
        "kind": "perplexity",
        "protocol": args.protocol,
        "target_tokens": args.target_tokens if args.protocol == "fixed" else None,
        "stride": args.stride if args.protocol == "sliding" else None,
        "dataset": args.dataset or ("text files" if args.text_files else "kjv"),
        "text_files": args.text_files,
        "split": args.split,
        "text_column": args.text_column,
        "min_tokens": min_tokens,
        "documents": args.documents,
    }
    store = ResultStore(args.out, "ppl", run_config, overwrite=args.overwrite)
    documents = tokenize_documents(data, tokenizer, min_tokens=min_tokens, max_documents=args.documents)
    print(f"{len(documents)} document(s): " + ", ".join(f"{d.title} ({d.num_tokens} tokens)" for d in documents))
    summary = run_perplexity(
        model,
        documents,
        methods,
        lengths,
        store,
        protocol=args.protocol,
        target_tokens=args.target_tokens,
        stride=args.stride,
    )
    _print_table(summary, "perplexity", ".2f", f"perplexity ({args.protocol} protocol; native context {native})")
    _finish(args, Path(args.out))
    return 0


def _cmd_eval_passkey(args: argparse.Namespace) -> int:
    from rope_ext.eval.perplexity import parse_lengths
    from rope_ext.eval.results import ResultStore
    from rope_ext.eval.run import parse_methods, run_passkey

    methods = parse_methods(args.methods)
    lengths = parse_lengths(args.lengths)
    depths = sorted({float(d) for d in args.depths.split(",")})
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must be in [0, 1], got {args.depths}")
    if args.trials < 1:
        raise ValueError(f"--trials must be >= 1, got {args.trials}")
    model, tokenizer, native = _load(args)
    run_config = _common_run_config(args, native) | {"kind": "passkey", "seed": args.seed}
    store = ResultStore(args.out, "passkey", run_config, overwrite=args.overwrite)
    summary = run_passkey(model, tokenizer, methods, lengths, depths, args.trials, store, seed=args.seed)
    by_length: dict[tuple, list[float]] = {}
    for row in summary:
        by_length.setdefault((row["method"], row["length"]), []).append(row["accuracy"])
    rows = [{"method": m, "length": L, "accuracy": sum(v) / len(v)} for (m, L), v in by_length.items()]
    _print_table(rows, "accuracy", ".0%", f"passkey accuracy, mean over depths {depths} x {args.trials} trial(s)")
    _finish(args, Path(args.out))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from rope_ext.eval.plot import plot_run

    for path in plot_run(args.results):
        print(f"plot written to {path}")
    return 0


def _add_model_options(parser: argparse.ArgumentParser, methods: str, lengths: str, out: str) -> None:
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M), a folder or a hub id")
    parser.add_argument("--methods", default=methods, help="comma-separated name[:key=value...] (default: %(default)s)")
    parser.add_argument("--lengths", default=lengths, help="comma-separated token counts, 4k = 4096 (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=out, help="results folder (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace results of a different configuration")
    parser.add_argument("--no-plot", action="store_true", help="do not plot at the end")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rope-ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("methods", help="list the registered methods and their options").set_defaults(func=_cmd_methods)
    sub.add_parser("families", help="list the supported model families").set_defaults(func=_cmd_families)

    evaluate = sub.add_parser("eval", help="evaluate methods").add_subparsers(dest="evaluation", required=True)
    ppl = evaluate.add_parser("ppl", help="perplexity vs context length")
    _add_model_options(ppl, DEFAULT_METHODS, DEFAULT_LENGTHS, "results/main")
    ppl.add_argument("--protocol", default="fixed", choices=("fixed", "curve", "sliding"))
    ppl.add_argument("--target-tokens", type=int, default=1024, help="fixed protocol: tokens scored (default: %(default)s)")
    ppl.add_argument("--stride", type=int, default=256, help="sliding protocol: window stride (default: %(default)s)")
    ppl.add_argument("--dataset", help="a folder saved with Dataset.save_to_disk, or a hub dataset name (online)")
    ppl.add_argument("--text-files", nargs="+", help="plain-text files, one document each")
    ppl.add_argument("--split", default="train")
    ppl.add_argument("--text-column", default="text")
    ppl.add_argument("--min-tokens", default="32k", help="keep documents at least this long (default: %(default)s)")
    ppl.add_argument("--documents", type=int, default=1, help="at most this many documents, longest first")
    ppl.set_defaults(func=_cmd_eval_ppl)

    passkey = evaluate.add_parser("passkey", help="passkey retrieval over a length x depth grid")
    _add_model_options(passkey, "none,yarn:factor=2,dynamic_ntk:factor=2", "4k,8k,12k", "results/passkey")
    passkey.add_argument("--depths", default="0.1,0.5,0.9", help="relative key positions (default: %(default)s)")
    passkey.add_argument("--trials", type=int, default=2, help="keys per cell (default: %(default)s)")
    passkey.add_argument("--seed", type=int, default=0)
    passkey.set_defaults(func=_cmd_eval_passkey)

    plot = sub.add_parser("plot", help="draw the plots of a results folder")
    plot.add_argument("results")
    plot.set_defaults(func=_cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"rope-ext: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
