"""Passkey trials with every prompt run whole (no cache reuse between trials), to check a cell of ``rope-ext eval
passkey`` (which reuses the haystack's beginning through the cache) on a model folder:

    python scripts/passkey_whole_prompt.py MODEL --length 16k --depth 0.9 --trials 2 --out check.json

MODEL is what ``rope_ext.from_pretrained`` loads (a fine-tune folder: the base patched as trained, the adapter
merged; a folder saved patched). The keys are ``rope-ext eval passkey``'s for the same seed, cell and trial.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

import rope_ext
from rope_ext.cli.options import length_list
from rope_ext.eval.passkey import passkey_trial


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--length", default="16k")
    parser.add_argument("--depth", type=float, default=0.9)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    (length,) = length_list(args.length)
    model = rope_ext.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = []
    for trial in range(args.trials):
        began = time.perf_counter()
        record = passkey_trial(model, tokenizer, length, args.depth, trial, method="saved", seed=args.seed)
        rows.append({"length": length, "depth": args.depth, "trial": trial, "reuse": False, "key": record.key,
                     "answer": record.answer, "correct": record.correct, "seconds": time.perf_counter() - began})
        print(rows[-1], flush=True)
    with open(args.out, "w") as handle:
        json.dump({"model": args.model, "seed": args.seed, "trials": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
