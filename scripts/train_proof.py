"""Train short, test long: the small models of docs/biases.md, trained at 256 tokens and evaluated to 16x.

    python scripts/train_proof.py --runs results/train --out docs/results/train

1. Trains each model with ``rope-ext train --config examples/train/small.yaml`` into ``RUNS/<name>`` (a complete
   folder is left as it is, a partial one resumes): GPT-2 with its learned table, GPT-2 under each bias, a Llama
   (RoPE) and a Llama under xPos. About 10 minutes each on 2 CPU threads.
2. Evaluates each with ``rope-ext eval ppl`` on the two books the training never saw (Psalms, left out; Isaiah, its
   held-out evaluation book), cut into documents of about 4,600 tokens (24 of them), fixed protocol: in each, the
   same last ``--target-tokens`` tokens before the longest length are scored at every length, so only the context in
   front of them grows. The learned table is evaluated
   training-free under ``abs_interp``, ``abs_hierarchical`` and ``sinusoidal`` (``none`` only at 256: the table
   ends there), the RoPE Llama under ``none``, ``yarn`` and the attention rewrites, each bias and xPos model as
   trained (``saved``). Results go to ``RUNS/<name>/ppl``.
3. Writes ``OUT``: ``ppl.json`` and ``ppl.csv`` (one row per model, method and length: both books' targets pooled),
   ``ppl.png`` (log scale), and per model its card, ``train.json``, loss curve and evaluation folder (not its weights).

T5 (span corruption) and DeBERTa (masked LM) train and evaluate with their own objectives, whose perplexities are
not the causal models': run them into a folder of their own,

    python scripts/train_proof.py --models t5_none,deberta_none --out docs/results/train_objectives

and T5 trained with ALiBi in place of its buckets (the same protocol; compare with ``t5_none`` there):

    python scripts/train_proof.py --models t5_alibi --out docs/results/train_t5_alibi
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
from pathlib import Path

from rope_ext.cli import main as rope_ext

#: name -> (architecture, method trained with, methods evaluated at every length; the learned table alone is
#: evaluated at the first length only, where it ends)
MODELS = {
    "gpt2_none": ("gpt2", "none", ["abs_interp:factor=16.1", "abs_hierarchical", "sinusoidal"]),
    "gpt2_alibi": ("gpt2", "alibi", ["saved"]),
    "gpt2_kerple": ("gpt2", "kerple", ["saved"]),
    "gpt2_sandwich": ("gpt2", "sandwich", ["saved"]),
    "gpt2_fire": ("gpt2", "fire", ["saved"]),
    "llama_none": ("llama", "none", ["none", "yarn:factor=16", "dca", "self_extend", "self_extend:G=24", "rerope",
                                     "leaky_rerope", "string"]),
    "llama_xpos": ("llama", "xpos", ["saved"]),
    # the two objectives that are not next-token prediction (scored by their own protocols: not comparable with the
    # causal models' perplexities; run them into their own --out)
    "t5_none": ("t5", "none", ["none", "t5_bucket_scale:factor=2", "t5_bucket_scale:factor=16"]),
    "t5_alibi": ("t5", "alibi", ["saved"]),
    "deberta_none": ("deberta", "none", ["none", "deberta_bucket_scale:factor=16", "deberta_bucket_stretch:factor=16"]),
}
#: options a model trains with beyond the config's: T5's step is a third of the others' (its decoder reads only the
#: corrupted spans), so it trains 1,500 steps in about the time the others take for 600
EXTRA = {"t5_none": ["--max-steps", "1500"], "t5_alibi": ["--max-steps", "1500"]}
#: the models run by default (T5's and DeBERTa's objectives: ``--models t5_none,deberta_none``)
CAUSAL = [name for name, (architecture, _, _) in MODELS.items() if architecture in ("gpt2", "llama")]
#: books the training never saw (small.yaml excludes Psalms and holds Isaiah out for its own evaluation)
BOOKS = ("Psalms", "Isaiah")
#: characters per document (whole lines): about 4,600 tokens, so that each provides the longest length, 4,096
PIECE_CHARS = 17_500
FILES = ("README.md", "train.json", "train_config.json", "loss.csv", "loss.json", "loss.png")


def run(args: list[str]) -> None:
    print("+ rope-ext " + " ".join(args), flush=True)
    code = rope_ext(args)
    if code:
        sys.exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="results/train", help="training and evaluation folders (weights included)")
    parser.add_argument("--out", default="docs/results/train", help="what the docs show (no weights)")
    parser.add_argument("--config", default="examples/train/small.yaml")
    parser.add_argument("--models", default=",".join(CAUSAL), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--lengths", default="256,512,1k,2k,4k")
    parser.add_argument("--target-tokens", default="128")
    parser.add_argument("--threads", default="0")
    parser.add_argument("--tables-only", action="store_true",
                        help="only OUT's table, intervals and plot again, from the folders already in OUT")
    args = parser.parse_args()
    names = [name.strip() for name in args.models.split(",")]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.tables_only:
        collect(Path(args.out), Path(args.out), names)
        return
    runs, out = Path(args.runs), Path(args.out)
    texts = runs / "texts"
    texts.mkdir(parents=True, exist_ok=True)
    from rope_ext.eval.corpus import kjv_book

    books = []
    for book in BOOKS:
        for index, piece in enumerate(pieces(kjv_book(book), PIECE_CHARS)):
            path = texts / f"{book}_{index:02d}.txt"
            if not path.exists() or path.read_text(encoding="utf-8") != piece:
                path.write_text(piece, encoding="utf-8")
            books.append(str(path))
    for name in names:
        architecture, trained, methods = MODELS[name]
        folder = runs / name
        run(["train", "--config", args.config, "--architecture", architecture, "--methods", trained, "--out",
             str(folder), "--threads", args.threads, *EXTRA.get(name, [])])
        common = ["eval", "ppl", "--model", str(folder), "--text-files", *books, "--documents", str(len(books)),
                  "--target-tokens", args.target_tokens, "--out", str(folder / "ppl"), "--threads", args.threads,
                  "--no-plot"]
        run([*common, "--methods", ",".join(methods), "--lengths", args.lengths])
        if architecture == "gpt2" and trained == "none":  # the table itself, where it reaches: the first length
            run([*common, "--methods", "none", "--lengths", args.lengths.split(",")[0]])
        rope_ext(["plot", str(folder / "ppl")])
    collect(runs, out, names)


def pieces(text: str, size: int) -> list[str]:
    """``text`` cut at line ends into pieces of at least ``size`` characters (a shorter rest joins the last)."""
    out, current = [], []
    length = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            out.append("".join(current))
            current, length = [], 0
    if current:
        if out:
            out[-1] += "".join(current)
        else:
            out.append("".join(current))
    return out


def summary_rows(folder: Path) -> list[dict]:
    """A model's evaluation summarized from its records: per method and length the perplexity with its 95% bootstrap
    interval over the documents (``low``, ``high``), and its ratio to the same method at the shortest length it was
    scored at, paired per document (``ratio_to_first``, ``ratio_low``, ``ratio_high``): how much the longer context
    costs or gains on the same targets."""
    from rope_ext.eval.perplexity import PerplexityRecord, paired, summarize
    from rope_ext.runs.results import read_records

    found, _ = read_records(folder / "ppl" / "ppl_records.jsonl")
    records = [PerplexityRecord.from_dict(r) for r in found]
    rows = summarize(records)
    for row in rows:
        mine = [r for r in records if r.method == row["method"] and r.length == row["length"]]
        first = min(r.length for r in records if r.method == row["method"])
        pair = paired(mine, [r for r in records if r.method == row["method"] and r.length == first])
        if pair is None:
            raise ValueError(f"{folder}: {row['method']} at {row['length']} shares no document with its {first}")
        row |= {"first_length": first, "ratio_to_first": pair["ratio"], "ratio_low": pair["ratio_low"],
                "ratio_high": pair["ratio_high"]}
    return rows


def collect(runs: Path, out: Path, names: list[str]) -> None:
    """The models' summaries in one table and one plot, and what each folder shows besides its weights (with
    ``runs`` = ``out``: the tables again from the folders already there)."""
    from rope_ext.eval.plot import perplexity_figure

    rows, protocols = [], {}
    for name in names:
        folder = runs / name
        target = out / name
        if folder.resolve() != target.resolve():
            shutil.rmtree(target, ignore_errors=True)
            (target / "ppl").mkdir(parents=True)
            for file in FILES:
                if (folder / file).exists():
                    shutil.copy2(folder / file, target / file)
            for file in (folder / "ppl").iterdir():
                if file.is_file():
                    shutil.copy2(file, target / "ppl" / file.name)
        results = json.loads((folder / "ppl" / "ppl.json").read_text())
        protocols[name] = results.get("run", {}).get("protocol", "fixed")
        trained = json.loads((folder / "train.json").read_text())
        native = trained["window"]
        for row in summary_rows(folder):
            method = row["method"]
            label = f"{name}: {trained['methods'] if method == 'saved' else method}"
            rows.append({"model": name, "protocol": protocols[name], "method": method, "label": label,
                         "length": row["length"], "documents": row["documents"],
                         "tokens_scored": row["tokens_scored"], "perplexity": row["perplexity"],
                         "low": row["low"], "high": row["high"], "mean_nll": row["mean_nll"],
                         "first_length": row["first_length"], "ratio_to_first": row["ratio_to_first"],
                         "ratio_low": row["ratio_low"], "ratio_high": row["ratio_high"]})
    (out / "ppl.json").write_text(json.dumps({"native_context": native, "rows": rows}, indent=1) + "\n")
    with open(out / "ppl.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    run_info = {"model_name": f"small models trained at {native} tokens",
                "protocol": " / ".join(dict.fromkeys(protocols.values())), "native_context": native}
    figure = perplexity_figure(run_info, [{**row, "method": row["label"]} for row in rows])
    figure.savefig(out / "ppl.png", dpi=110)
    lengths = sorted({row["length"] for row in rows})
    print("\n| model: method | " + " | ".join(map(str, lengths)) + " |")
    print("|---|" + "---:|" * len(lengths))
    for label in dict.fromkeys(row["label"] for row in rows):
        values = {row["length"]: row for row in rows if row["label"] == label}
        cells = [("inf" if math.isinf(values[n]["perplexity"]) else f"{values[n]['perplexity']:.1f} "
                  f"({values[n]['low']:.1f}-{values[n]['high']:.1f}), x{values[n]['ratio_to_first']:.3f} "
                  f"({values[n]['ratio_low']:.3f}-{values[n]['ratio_high']:.3f})") if n in values else ""
                 for n in lengths]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
