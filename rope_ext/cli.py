"""``rope-ext``: list methods and families, and run the main job."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEMO_METHODS = "none,pi:factor=2,ntk:factor=2,dynamic_ntk:factor=2,yarn:factor=2"


def _cmd_methods(args: argparse.Namespace) -> int:
    import dataclasses

    from rope_ext.methods import get_method_class, list_methods

    for name in list_methods():
        cls = get_method_class(name)
        options = ", ".join(f.name for f in dataclasses.fields(cls))
        print(f"{name:14s} hook={cls.hook:10s} options: {options}")
    return 0


def _cmd_families(args: argparse.Namespace) -> int:
    from rope_ext.patches import get_family, list_families

    for name in list_families():
        print(f"{name:10s} hooks: {', '.join(sorted(get_family(name).hooks))}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Perplexity of the tokens beyond the native window of one long KJV book, per method vs unpatched."""
    import torch
    from tqdm import tqdm

    import rope_ext
    from rope_ext.eval.corpus import kjv_book
    from rope_ext.eval.perplexity import tail_perplexity
    from rope_ext.methods.base import parse_method_spec

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"{out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    methods = [parse_method_spec(spec) for spec in args.methods.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = rope_ext.load_default_model()
    native = model.config.max_position_embeddings
    ids = tokenizer(kjv_book(args.book), return_tensors="pt").input_ids
    if ids.shape[-1] < args.length:
        print(f"{args.book} has only {ids.shape[-1]} tokens, fewer than --length {args.length}", file=sys.stderr)
        return 2
    ids = ids[:, : args.length]
    records = []
    for method in tqdm(methods, desc=f"{args.book}, {args.length} tokens", unit="method"):
        if method is None:
            record = tail_perplexity(model, ids, native, args.book)
        else:
            with rope_ext.patched(model, method):
                record = tail_perplexity(model, ids, native, args.book, method.to_dict())
        records.append(record)
    baseline = next((r for r in records if r.method is None), None)

    print(f"\nSmolLM2-135M, KJV {args.book}: perplexity of tokens {native}..{args.length - 1} "
          f"(beyond the native {native}-token window), one forward each")
    print(f"{'method':32s} {'ppl':>9s} {'vs none':>8s} {'seconds':>8s}")
    for method, record in zip(args.methods.split(","), records):
        ratio = f"{record.perplexity / baseline.perplexity:.2f}x" if baseline else "-"
        print(f"{method:32s} {record.perplexity:9.2f} {ratio:>8s} {record.seconds:8.1f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([r.to_dict() for r in records], indent=2))
    print(f"\nresults written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rope-ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("methods", help="list the registered methods and their options").set_defaults(func=_cmd_methods)
    sub.add_parser("families", help="list the supported model families").set_defaults(func=_cmd_families)
    demo = sub.add_parser("demo", help="perplexity beyond the native window of the default model, per method")
    demo.add_argument("--methods", default=DEMO_METHODS, help="comma-separated name[:key=value...] (default: %(default)s)")
    demo.add_argument("--book", default="Genesis", help="KJV book (default: %(default)s)")
    demo.add_argument("--length", type=int, default=12288, help="tokens in the forward pass (default: %(default)s)")
    demo.add_argument("--out", default="results/demo.json")
    demo.add_argument("--overwrite", action="store_true")
    demo.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"rope-ext: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
