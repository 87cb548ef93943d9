"""``rope-ext corpus``: the offline texts (``rope_ext.eval.corpus.TEXTS``): list them, fetch their Debian packages,
write them as plain-text files for ``--text-files``."""

from __future__ import annotations

import argparse

from rope_ext.eval.corpus import TEXTS, fetch_texts, text_documents, write_corpus
from rope_ext.runs.values import comma_items


def text_names(text: str | None) -> list[str]:
    if text is None:
        return list(TEXTS)
    names = comma_items(text, "text")
    unknown = [name for name in names if name not in TEXTS]
    if unknown or not names:
        raise ValueError(f"--texts: unknown text {(unknown or [text])[0]!r}; texts: {', '.join(TEXTS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--texts: {', '.join(repeated)} given more than once")
    return names


def cmd_corpus(args: argparse.Namespace) -> int:
    names = text_names(args.texts)
    if args.fetch:
        fetched = fetch_texts([name for name in names if name != "kjv"])
        print(f"fetched {', '.join(fetched)}" if fetched else "every text's package was already there")
    if args.out is None:
        for name in names:
            text = TEXTS[name]
            try:
                documents = text_documents(name)
                state = f"{len(documents)} document{'s' * (len(documents) != 1)}, " \
                        f"{sum(len(body) for _, body in documents):,} characters"
            except (OSError, ValueError) as error:
                state = f"missing ({error})"
            print(f"{name:18} {text.package} ({text.license}): {text.about}\n{'':18} {state}")
        return 0
    manifest = write_corpus(args.out, names, overwrite=args.overwrite)
    for name, entry in manifest["texts"].items():
        count = len(entry["documents"])
        print(f"{args.out}/{name}/: {count} document{'s' * (count != 1)} from {entry['package']}")
    print(f"use them with --text-files {args.out}/<text>/* (one document per file)")
    return 0
