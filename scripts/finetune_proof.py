"""The fine-tuning proof of docs/results/finetune_mix: the README's recipe trained on a mix of texts, three seeds,
evaluated on texts held out from every choice, with intervals over target windows; beside it, attention rewrites with
no training (``TRAINING_FREE``) on the same targets.

    python scripts/finetune_proof.py --out results/finetune_mix            # every stage, in order; re-run resumes
    python scripts/finetune_proof.py --out results/finetune_mix --list     # the stages and which are done
    python scripts/finetune_proof.py --out results/finetune_mix --only ppl_seed0,short_seed0   # those, if not done
    python scripts/finetune_proof.py --out results/finetune_mix --only ppl_seed0 --redo      # again from the start
    python scripts/finetune_proof.py --out results/finetune_mix --report   # report.md / report.json of what is done
    python scripts/finetune_proof.py --out DIR --device cuda --parallel    # on a GPU: each model's stages at once

With ``--parallel`` the stages of each model (the base model; each seed; the baseline) run as one chain, the chains at
once (what a GPU affords), each stage's output in ``<stage>.log``; without it, every stage in order, the output here.
``--device`` is each evaluation's (``rope-ext eval --device``; training takes accelerate's device), ``--dtype
bfloat16`` evaluates in bf16 and trains in bf16 mixed precision (a protocol of its own: another ``--out``).

Each stage is one rope-ext command (its folder under --out resumes where it stopped); a stage is done when its command
has exited 0 once (``<stage>.done``). ``protocol.json`` (written first) records what each text is for: ``train`` (the
mix trained on), ``choose`` (the texts earlier recipes were picked on: the KJV's Psalms and Isaiah, kept out of
training), ``report`` (texts no configuration was chosen on, and which are quoted for claims). Hours of CPU: the
stages are ordered so that a first seed's full comparison comes before the other seeds and the retrieval.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
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
# attention rewrites on the same targets, no training (the best rows of docs/results.md's Psalms table, held out here)
TRAINING_FREE = {"dca:chunk_size=8192": "ppl_dca_chunk8k", "self_extend+logn": "ppl_self_extend_logn",
                 "dca": "ppl_dca"}


def stages(out: str, device: str = "cpu", dtype: str = "float32") -> list[tuple[str, list[str]]]:
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
        ("ppl_lora_none", [*ppl, "--model", baseline, "--methods", "none", *LONG[:1], "8k", *LONG[2:]]),
        ("short_lora_none", [*ppl, "--model", baseline, "--methods", "none", *SHORT]),
        ("passkey_untrained", ["rope-ext", "eval", "passkey", "--model", "default", "--methods", METHOD, *RETRIEVAL]),
    ]
    plan += [(f"passkey_seed{seed}", ["rope-ext", "eval", "passkey", "--model", os.path.join(out, f"seed{seed}"),
                                      "--methods", "saved", *RETRIEVAL]) for seed in SEEDS]
    plan.append(("passkey_native", ["rope-ext", "eval", "passkey", "--model", "default", "--methods", f"none,{METHOD}",
                                    "--lengths", "8k", "--depths", "0.1,0.5,0.9", "--trials", "10"]))
    plan += [(stage, [*ppl, "--model", "default", "--methods", method, *LONG])
             for method, stage in TRAINING_FREE.items()]
    plan.append(("passkey_dca_chunk8k", ["rope-ext", "eval", "passkey", "--model", "default", "--methods",
                                         "dca:chunk_size=8192", *RETRIEVAL]))
    evaluation = ["--device", device, "--dtype", dtype]
    training = ["--mixed-precision", "bf16"] if dtype == "bfloat16" else []
    return [(name, command + (["--out", os.path.join(out, name), *evaluation] if command[1] == "eval" else
                              training if command[1] == "finetune" else []))
            for name, command in plan]


def chain(name: str) -> str:
    """The chain a stage runs in: a seed's stages after its training, the baseline's after its own; the base model's
    stages need nothing but the corpus, each its own chain."""
    for key in [f"seed{seed}" for seed in SEEDS] + ["lora_none"]:
        if name.endswith(key):
            return key
    return name


def protocol(dtype: str = "float32") -> dict:
    return {
        "recipe": RECIPE, "method": METHOD, "seeds": list(SEEDS), **({"dtype": dtype} if dtype != "float32" else {}),
        "train": {"texts": list(TRAIN_TEXTS), "excluded": list(CHOOSE)},
        "choose": {"kjv": list(CHOOSE), "why": "earlier recipes (docs/results/finetune) were picked on these books"},
        "report": {"texts": list(REPORT_TEXTS), "why": "no configuration was chosen on them; claims quote only these"},
        "protocols": {"long": LONG, "short": SHORT, "retrieval": RETRIEVAL},
    }


# --- the report: every row against the unpatched model at the native 8k, paired over the same windows ----------------

ROWS = {"none": "ppl_none", "yarn:factor=4, untrained": "ppl_untrained",
        **{f"seed {seed}": f"ppl_seed{seed}" for seed in SEEDS}, "plain LoRA (none), same data": "ppl_lora_none",
        **{f"{method}, training-free": stage for method, stage in TRAINING_FREE.items()}}
SHORT_ROWS = {"yarn:factor=4, untrained": "short_untrained", **{f"seed {seed}": f"short_seed{seed}" for seed in SEEDS},
              "plain LoRA (none), same data": "short_lora_none"}
RETRIEVAL_ROWS = {"yarn:factor=4, untrained": "passkey_untrained",
                  **{f"seed {seed}": f"passkey_seed{seed}" for seed in SEEDS}, "native 8k": "passkey_native",
                  "dca:chunk_size=8192, training-free": "passkey_dca_chunk8k"}


def records(out: str, stage: str, kind: str, partial: bool = False) -> list[dict]:
    """A stage's records: of a finished stage, or with ``partial`` also of one stopped before its end (retrieval's
    cells are whole trials each: a stopped stage's cells are reported with the trials they have)."""
    path = os.path.join(out, stage, f"{kind}_records.jsonl")
    if not (partial or os.path.exists(os.path.join(out, f"{stage}.done"))) or not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def paired(rows: list[dict], base: list[dict]) -> dict | None:
    """Perplexity of ``rows`` and its ratio to ``base`` over the windows both scored, with 95% bootstrap intervals
    (windows resampled together: what they share cancels; ``rope_ext.eval.perplexity.paired``)."""
    from types import SimpleNamespace

    from rope_ext.eval.perplexity import paired as paired_records

    found = paired_records([SimpleNamespace(**r) for r in rows], [SimpleNamespace(**r) for r in base])
    return found and {"windows": found["documents"], "ppl": found["perplexity"],
                      **{key: found[key] for key in ("low", "high", "ratio", "ratio_low", "ratio_high")}}


def report(out: str, seeds_from: str | None = None) -> dict:
    """Every finished stage's numbers: perplexity at 8k and 32k on the report texts against the unpatched model at
    8k (the same target tokens), the short-context check against the unpatched model at each length, retrieval; the
    training-free rows against each seed at 32k (the seeds' records from ``seeds_from``, another run of the same
    protocol, where they ran there)."""
    from rope_ext.eval.intervals import wilson

    def by_length(rows: list[dict], base: list[dict], same_length: bool = False) -> dict:
        """``paired`` at each length of ``rows``, against ``base`` (at that length too, with ``same_length``)."""
        return {str(length): paired([r for r in rows if r["length"] == length],
                                    [r for r in base if r["length"] == length] if same_length else base)
                for length in sorted({r["length"] for r in rows})}

    base = [r for r in records(out, "ppl_none", "ppl") if r["length"] == 8192]
    long = {name: by_length(records(out, stage, "ppl"), base) for name, stage in ROWS.items()}
    lora = [r for r in records(out, "ppl_lora_none", "ppl") if r["length"] == 8192]
    # (the recipe against a fine-tune on the same data with no extension: what the data alone buys)
    against_lora = {f"seed {seed}": by_length(records(out, f"ppl_seed{seed}", "ppl"), lora) for seed in SEEDS}
    none = [r for r in records(out, "short_untrained", "ppl") if r["method"] == "none"]
    short = {}
    for name, stage in SHORT_ROWS.items():
        rows = records(out, stage, "ppl")
        methods = {r["method"] for r in rows}
        mine = [r for r in rows if r["method"] != "none" or methods == {"none"}]
        short[name] = by_length(mine, none, same_length=True)

    def here_or_there(stage: str) -> list[dict]:  # (a stage's records here, else of the run the seeds came from)
        return records(out, stage, "ppl") or (records(seeds_from, stage, "ppl") if seeds_from else [])

    # (the tax inside the window against the fine-tune on the same data with no extension, at each short context)
    lora_short = here_or_there("short_lora_none")
    against_lora_short = {f"seed {seed}": by_length(here_or_there(f"short_seed{seed}"), lora_short, same_length=True)
                          for seed in SEEDS} if lora_short else {}
    retrieval = {}
    for name, stage in RETRIEVAL_ROWS.items():
        cells: dict[str, list[bool]] = {}
        for r in records(out, stage, "passkey", partial=True):
            cells.setdefault(f"{r['method']} {r['length']} {r['depth']}", []).append(bool(r["correct"]))
        run_path, earlier = os.path.join(out, stage, "passkey_run.json"), False
        if os.path.exists(run_path):  # (a prompt of L tokens with the answer past L: rope-ext eval before 2026-11-28)
            with open(run_path) as handle:
                earlier = "answer_within_length" not in json.load(handle)
        retrieval[name] = {cell: {"correct": sum(hits), "trials": len(hits), "interval": wilson(sum(hits), len(hits)),
                                  "stage_finished": os.path.exists(os.path.join(out, f"{stage}.done")),
                                  "earlier_prompt": earlier}
                           for cell, hits in cells.items()}
    with open(os.path.join(out, "protocol.json")) as handle:
        used = json.load(handle)
    seeds = {seed: [r for r in records(seeds_from or out, f"ppl_seed{seed}", "ppl") if r["length"] == 32768]
             for seed in SEEDS}
    against_seeds = {}
    for method, stage in TRAINING_FREE.items():
        mine = [r for r in records(out, stage, "ppl") if r["length"] == 32768]
        cells = {f"seed {seed}": paired(mine, theirs) for seed, theirs in seeds.items()}
        cells = {name: cell for name, cell in cells.items() if cell}  # (None: no window scored on both sides)
        if cells:
            against_seeds[f"{method}, training-free"] = cells
    result = {"protocol": used, "long": long, "against_lora_8k": against_lora, "short": short,
              "against_lora_short": against_lora_short, "retrieval": retrieval,
              "training_free_against_seeds_32k": against_seeds, "seeds_from": seeds_from}
    with open(os.path.join(out, "report.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    texts = (f"Report texts (no configuration was chosen on them): {', '.join(used['report']['texts'])}; trained on "
             f"{', '.join(used['train']['texts'])} less {', '.join(used['train']['excluded'])} (`protocol.json`). "
             "95% bootstrap intervals over the windows; ratios paired (the same windows on both sides).")
    lines = [texts, "", "| model | context | perplexity (95%) | x unpatched 8k (95%, paired) | windows |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {int(length) // 1024}k | {cell['ppl']:.2f} ({cell['low']:.2f}-{cell['high']:.2f}) | "
              f"{cell['ratio']:.3f} ({cell['ratio_low']:.3f}-{cell['ratio_high']:.3f}) | {cell['windows']} |"
              for name, cells in long.items() for length, cell in cells.items() if cell]
    if against_seeds:
        where = f"; the seeds: {seeds_from}" if seeds_from else ""
        lines += ["", f"| model | x the seed at 32k (95%, paired{where}) | windows |", "|---|---:|---:|"]
        lines += [f"| {name} / {seed} | {cell['ratio']:.3f} ({cell['ratio_low']:.3f}-{cell['ratio_high']:.3f}) | "
                  f"{cell['windows']} |" for name, cells in against_seeds.items() for seed, cell in cells.items()]
    for heading, table in (("x plain LoRA (none) at 8k, same data", against_lora),
                           ("x unpatched at that context", short),
                           ("x plain LoRA (none) at that context, same data", against_lora_short)):
        rows = [f"| {name} | {int(length) // 1024}k | {cell['ratio']:.3f} ({cell['ratio_low']:.3f}-"
                f"{cell['ratio_high']:.3f}) | {cell['windows']} |"
                for name, cells in table.items() for length, cell in cells.items() if cell]
        if rows:
            lines += ["", f"| model | context | {heading} (95%, paired) | windows |", "|---|---:|---:|---:|", *rows]
    if any(retrieval.values()):
        lines += ["", "Retrieval: `rope-ext eval passkey`, the key in its repeated filler sentences (not the report "
                  "texts).", "", "| model | method | context | key at depth | found (95% Wilson) |",
                  "|---|---|---:|---:|---:|"]
    for name, cells in retrieval.items():
        for cell, hits in cells.items():
            method, length, depth = cell.rsplit(" ", 2)
            low, high = hits["interval"]
            stopped = "" if hits["stage_finished"] else " (stage stopped before its end)"
            stopped += " (earlier prompt: L tokens, the answer past L)" if hits["earlier_prompt"] else ""
            lines.append(f"| {name}{stopped} | {method} | {int(length) // 1024}k | {depth} | {hits['correct']}/"
                         f"{hits['trials']} ({low:.2f}-{high:.2f}) |")
    with open(os.path.join(out, "report.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def agreement(out: str, other: str) -> dict:
    """Every perplexity stage finished in both folders (another device's run of the same protocol): the largest
    relative difference of a window's mean NLL, written to ``agreement.json`` in ``out``."""
    result = {"other": other, "stages": {}}
    for stage in sorted({*ROWS.values(), *SHORT_ROWS.values()}):
        mine, theirs = ({(r["method"], r["document"], r["length"], r["start"]): r["mean_nll"]
                         for r in records(folder, stage, "ppl")} for folder in (out, other))
        shared = sorted(set(mine) & set(theirs))
        if shared:
            result["stages"][stage] = {"windows": len(shared), "max_relative_difference": max(
                abs(mine[key] - theirs[key]) / abs(theirs[key]) for key in shared)}
    with open(os.path.join(out, "agreement.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    return result


def run_stage(out: str, name: str, command: list[str], log: str | None) -> int:
    """One stage's command (``rope-ext ...`` run as ``python -m rope_ext.cli``), ``<stage>.done`` once it exits 0."""
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {shlex.join(command)[:300]}", flush=True)
    start = time.time()
    argv = [sys.executable, "-m", "rope_ext.cli", *command[1:]]
    if log:
        with open(log, "a") as handle:
            status = subprocess.call(argv, stdout=handle, stderr=subprocess.STDOUT)
    else:
        status = subprocess.call(argv)
    seconds = round(time.time() - start)
    print(f"[{time.strftime('%H:%M:%S')}] {name} exited {status} after {seconds} s", flush=True)
    if status == 0:
        with open(os.path.join(out, f"{name}.done"), "w") as handle:
            json.dump({"seconds": seconds, "command": command}, handle)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/finetune_mix")
    parser.add_argument("--only", help="comma-separated stages, those not done (default: every stage not done)")
    parser.add_argument("--redo", action="store_true",
                        help="run the --only stages again from the start, done or not (their folders overwritten)")
    parser.add_argument("--list", action="store_true", help="list the stages and which are done")
    parser.add_argument("--report", action="store_true", help="write report.md and report.json from the stages done")
    parser.add_argument("--seeds-from", metavar="OTHER", help="with --report: the seeds' records from OTHER (the same "
                        "protocol run elsewhere), to pair the training-free rows with each seed")
    parser.add_argument("--device", default="cpu", help="each evaluation's --device (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="float32, or bfloat16: evaluations in bf16, training in bf16 mixed precision")
    parser.add_argument("--parallel", action="store_true", help="each model's chain of stages at once (a GPU)")
    parser.add_argument("--compare", metavar="OTHER", help="agreement.json: each perplexity stage done here and in "
                        "OTHER (the same protocol on another device), the largest relative difference of a window")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "protocol.json")
    if os.path.exists(path):
        with open(path) as handle:
            if json.load(handle) != protocol(args.dtype):
                sys.exit(f"{path} records another protocol: give another --out")
    with open(path, "w") as handle:
        json.dump(protocol(args.dtype), handle, indent=1)
    if args.compare:
        print(json.dumps(agreement(args.out, args.compare), indent=1))
        return 0
    if args.seeds_from and not args.report:
        sys.exit("--seeds-from is an option of --report")
    if args.report:
        report(args.out, args.seeds_from)
        return 0
    names = [name for name, _ in stages(args.out)]
    chosen = args.only.split(",") if args.only else names
    unknown = [name for name in chosen if name not in names]
    if unknown:
        sys.exit(f"--only: unknown stage {unknown[0]!r}; stages: {', '.join(names)}")
    if args.redo and not args.only:
        sys.exit("--redo runs the --only stages again: name them")
    if args.list:
        for name in names:
            print(f"{'done' if os.path.exists(os.path.join(args.out, f'{name}.done')) else '    '}  {name}")
        return 0
    todo = [name for name in names if name in chosen
            and (args.redo or not os.path.exists(os.path.join(args.out, f"{name}.done")))]

    def run_chain(chain_names: list[str]) -> int:
        for name in chain_names:
            command = dict(stages(args.out, args.device, args.dtype))[name]  # (now: the file lists need the corpus)
            if args.redo and command[1] in ("eval", "finetune"):
                command = [*command, "--overwrite"]  # (else a finished stage resumes: nothing redone)
            log = os.path.join(args.out, f"{name}.log") if args.parallel else None
            status = run_stage(args.out, name, command, log)
            if status != 0:
                return status
        return 0

    if "corpus" in todo:  # (every other stage reads it)
        todo.remove("corpus")
        if run_chain(["corpus"]):
            return 1
    if not args.parallel:
        return run_chain(todo)
    chains: dict[str, list[str]] = {}
    for name in todo:
        chains.setdefault(chain(name), []).append(name)
    with concurrent.futures.ThreadPoolExecutor(len(chains) or 1) as pool:
        statuses = list(pool.map(run_chain, chains.values()))
    return next((status for status in statuses if status), 0)  # (a chain killed by a signal returns < 0)


if __name__ == "__main__":
    sys.exit(main())
