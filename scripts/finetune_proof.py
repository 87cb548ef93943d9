"""The fine-tuning proof of docs/results/finetune_mix: the README's recipe trained on a mix of texts, three seeds,
evaluated on texts held out from every choice, with intervals over target windows.

    python scripts/finetune_proof.py --out results/finetune_mix            # every stage, in order; re-run resumes
    python scripts/finetune_proof.py --out results/finetune_mix --list     # the stages and which are done
    python scripts/finetune_proof.py --out results/finetune_mix --only ppl_seed0,short_seed0
    python scripts/finetune_proof.py --out results/finetune_mix --report   # report.md / report.json of what is done

Each stage is one rope-ext command (its folder under --out resumes where it stopped); a stage is done when its command
has exited 0 once (``<stage>.done``). ``protocol.json`` (written first) records what each text is for: ``train`` (the
mix trained on), ``choose`` (the texts earlier recipes were picked on: the KJV's Psalms and Isaiah, kept out of
training), ``report`` (texts no configuration was chosen on, and which are quoted for claims). Hours of CPU: the
stages are ordered so that a first seed's full comparison comes before the other seeds and the retrieval.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import subprocess
import sys
import time

RECIPE = "examples/finetune/yarn4k_pose_32k.yaml"
METHOD = "yarn:factor=4"
TRAIN_TEXTS = ("kjv", "perl-doc")
CHOOSE = ("Psalms", "Isaiah")  # KJV books that earlier recipes were picked on: neither trained nor reported on
REPORT_TEXTS = ("devils-dictionary", "debian-reference", "gnu-standards")
SEEDS = (0, 1, 2)
LONG = ["--lengths", "8k,32k", "--target-end", "32k", "--documents", "4", "--windows", "2"]
SHORT = ["--lengths", "1k,2k,4k", "--target-end", "4k", "--target-tokens", "512", "--documents", "4", "--windows", "8"]
RETRIEVAL = ["--lengths", "16k,32k", "--depths", "0.1,0.5,0.9", "--trials", "10"]


def stages(out: str) -> list[tuple[str, list[str]]]:
    corpus = os.path.join(out, "corpus")
    train = [path for name in TRAIN_TEXTS for path in sorted(glob.glob(os.path.join(corpus, name, "*")))]
    report = [path for name in REPORT_TEXTS for path in sorted(glob.glob(os.path.join(corpus, name, "*")))]
    ppl = ["rope-ext", "eval", "ppl", "--text-files", *report]
    plan: list[tuple[str, list[str]]] = [
        ("corpus", ["rope-ext", "corpus", corpus, "--texts", ",".join(TRAIN_TEXTS + REPORT_TEXTS), "--overwrite"]),
        ("ppl_none", [*ppl, "--model", "default", "--methods", "none", *LONG[:1], "8k", *LONG[2:]]),
        ("ppl_untrained", [*ppl, "--model", "default", "--methods", METHOD, *LONG]),
        ("short_untrained", [*ppl, "--model", "default", "--methods", f"none,{METHOD}", *SHORT]),
    ]
    for seed in SEEDS:
        folder = os.path.join(out, f"seed{seed}")
        plan += [
            (f"train_seed{seed}", ["rope-ext", "finetune", "--config", RECIPE, "--text-files", *train, "--exclude",
                                   *CHOOSE, "--seed", str(seed), "--save-every", "5", "--out", folder]),
            (f"ppl_seed{seed}", [*ppl, "--model", folder, "--methods", "saved", *LONG]),
            (f"short_seed{seed}", [*ppl, "--model", folder, "--methods", "saved", *SHORT]),
        ]
    baseline = os.path.join(out, "lora_none")
    plan += [
        ("train_lora_none", ["rope-ext", "finetune", "--config", RECIPE, "--text-files", *train, "--exclude", *CHOOSE,
                             "--methods", "none", "--pose", "false", "--sequence-length", "4k", "--target-length",
                             "4k", "--save-every", "5", "--out", baseline]),
        ("ppl_lora_none", [*ppl, "--model", baseline, "--methods", "saved", *LONG[:1], "8k", *LONG[2:]]),
        ("short_lora_none", [*ppl, "--model", baseline, "--methods", "saved", *SHORT]),
        ("passkey_untrained", ["rope-ext", "eval", "passkey", "--model", "default", "--methods", METHOD, *RETRIEVAL]),
    ]
    plan += [(f"passkey_seed{seed}", ["rope-ext", "eval", "passkey", "--model", os.path.join(out, f"seed{seed}"),
                                      "--methods", "saved", *RETRIEVAL]) for seed in SEEDS]
    plan.append(("passkey_native", ["rope-ext", "eval", "passkey", "--model", "default", "--methods", f"none,{METHOD}",
                                    "--lengths", "8k", "--depths", "0.1,0.5,0.9", "--trials", "10"]))
    return [(name, command + (["--out", os.path.join(out, name)] if command[1] == "eval" else []))
            for name, command in plan]


def protocol() -> dict:
    return {
        "recipe": RECIPE, "method": METHOD, "seeds": list(SEEDS),
        "train": {"texts": list(TRAIN_TEXTS), "excluded": list(CHOOSE)},
        "choose": {"kjv": list(CHOOSE), "why": "earlier recipes (docs/results/finetune) were picked on these books"},
        "report": {"texts": list(REPORT_TEXTS), "why": "no configuration was chosen on them; claims quote only these"},
        "protocols": {"long": LONG, "short": SHORT, "retrieval": RETRIEVAL},
    }


# --- the report: every row against the unpatched model at the native 8k, paired over the same windows ----------------

ROWS = {"none": "ppl_none", "yarn:factor=4, untrained": "ppl_untrained",
        **{f"seed {seed}": f"ppl_seed{seed}" for seed in SEEDS}, "plain LoRA (none), same data": "ppl_lora_none"}
SHORT_ROWS = {"yarn:factor=4, untrained": "short_untrained", **{f"seed {seed}": f"short_seed{seed}" for seed in SEEDS},
              "plain LoRA (none), same data": "short_lora_none"}
RETRIEVAL_ROWS = {"yarn:factor=4, untrained": "passkey_untrained",
                  **{f"seed {seed}": f"passkey_seed{seed}" for seed in SEEDS}, "native 8k": "passkey_native"}


def records(out: str, stage: str, kind: str) -> list[dict]:
    path = os.path.join(out, stage, f"{kind}_records.jsonl")
    if not os.path.exists(os.path.join(out, f"{stage}.done")) or not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def paired(rows: list[dict], base: list[dict]) -> dict | None:
    """Perplexity of ``rows`` and its ratio to ``base`` over the windows both scored, with 95% bootstrap intervals
    (windows resampled together: what they share cancels)."""
    from rope_ext.eval.intervals import bootstrap, mean_nll_ppl, ppl_ratio

    theirs = {r["document"]: r for r in base}
    units = [(r["mean_nll"] * r["tokens_scored"], theirs[r["document"]]["mean_nll"] * r["tokens_scored"],
              r["tokens_scored"]) for r in rows if r["document"] in theirs]
    if not units:
        return None
    nll, ref, tokens = (sum(u[i] for u in units) for i in range(3))
    low, high = bootstrap([(u[0], u[2]) for u in units], mean_nll_ppl)
    ratio_low, ratio_high = bootstrap(units, ppl_ratio)
    return {"windows": len(units), "ppl": math.exp(nll / tokens), "low": low, "high": high,
            "ratio": math.exp((nll - ref) / tokens), "ratio_low": ratio_low, "ratio_high": ratio_high}


def report(out: str) -> dict:
    """Every finished stage's numbers: perplexity at 8k and 32k on the report texts against the unpatched model at
    8k (the same target tokens), the short-context check against the unpatched model at each length, retrieval."""
    from rope_ext.eval.intervals import wilson

    base = [r for r in records(out, "ppl_none", "ppl") if r["length"] == 8192]
    long = {}
    for name, stage in ROWS.items():
        rows = records(out, stage, "ppl")
        long[name] = {str(length): paired([r for r in rows if r["length"] == length], base)
                      for length in sorted({r["length"] for r in rows})}
    short = {}
    for name, stage in SHORT_ROWS.items():
        rows = records(out, stage, "ppl")
        methods = {r["method"] for r in rows}
        none = [r for r in records(out, "short_untrained", "ppl") if r["method"] == "none"]
        mine = [r for r in rows if r["method"] != "none" or methods == {"none"}]
        short[name] = {str(length): paired([r for r in mine if r["length"] == length],
                                           [r for r in none if r["length"] == length])
                       for length in sorted({r["length"] for r in mine})}
    retrieval = {}
    for name, stage in RETRIEVAL_ROWS.items():
        cells: dict[str, list[bool]] = {}
        for r in records(out, stage, "passkey"):
            cells.setdefault(f"{r['method']} {r['length']} {r['depth']}", []).append(bool(r["correct"]))
        retrieval[name] = {cell: {"correct": sum(hits), "trials": len(hits), "interval": wilson(sum(hits), len(hits))}
                           for cell, hits in cells.items()}
    result = {"protocol": protocol(), "long": long, "short": short, "retrieval": retrieval}
    with open(os.path.join(out, "report.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    lines = ["| model | context | perplexity (95%) | x unpatched 8k (95%, paired) | windows |", "|---|---:|---:|---:|---:|"]
    for name, cells in long.items():
        for length, cell in cells.items():
            if cell:
                lines.append(f"| {name} | {int(length) // 1024}k | {cell['ppl']:.2f} ({cell['low']:.2f}-{cell['high']:.2f}) "
                             f"| {cell['ratio']:.3f} ({cell['ratio_low']:.3f}-{cell['ratio_high']:.3f}) | {cell['windows']} |")
    lines += ["", "| model | context | x unpatched at that context (95%, paired) | windows |", "|---|---:|---:|---:|"]
    for name, cells in short.items():
        for length, cell in cells.items():
            if cell:
                lines.append(f"| {name} | {int(length) // 1024}k | {cell['ratio']:.3f} ({cell['ratio_low']:.3f}-"
                             f"{cell['ratio_high']:.3f}) | {cell['windows']} |")
    with open(os.path.join(out, "report.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/finetune_mix")
    parser.add_argument("--only", help="comma-separated stages (default: every one not done, in order)")
    parser.add_argument("--list", action="store_true", help="list the stages and which are done")
    parser.add_argument("--report", action="store_true", help="write report.md and report.json from the stages done")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "protocol.json")
    if os.path.exists(path):
        with open(path) as handle:
            if json.load(handle) != protocol():
                sys.exit(f"{path} records another protocol: give another --out")
    with open(path, "w") as handle:
        json.dump(protocol(), handle, indent=1)
    if args.report:
        report(args.out)
        return 0
    plan = stages(args.out)
    names = [name for name, _ in plan]
    chosen = args.only.split(",") if args.only else names
    unknown = [name for name in chosen if name not in names]
    if unknown:
        sys.exit(f"--only: unknown stage {unknown[0]!r}; stages: {', '.join(names)}")
    bin_dir = os.path.dirname(sys.executable)
    for name, command in plan:
        done = os.path.join(args.out, f"{name}.done")
        if args.list:
            print(f"{'done' if os.path.exists(done) else '    '}  {name}")
            continue
        if name not in chosen or os.path.exists(done) and not args.only:
            continue
        command = dict(stages(args.out))[name]  # (again: the file lists need the corpus written)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {shlex.join(command)[:300]}", flush=True)
        start = time.time()
        status = subprocess.call([os.path.join(bin_dir, command[0]), *command[1:]])
        if status != 0:
            print(f"{name} exited {status}", flush=True)
            return status
        with open(done, "w") as handle:
            json.dump({"seconds": round(time.time() - start), "command": command}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
