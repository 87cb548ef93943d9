"""Speed and memory of the attention-rewrite methods on a CUDA GPU: whole-model prefill time and peak GPU memory at
each length for plain SDPA (unpatched: cuDNN attention on Hopper in half precision, as SDPA picks it), SDPA held
to its flash backend (``sdpa_flash``) and each method's fast path (its band regions as windowed calls of the aten
flash op, its unmasked and square causal ones on cuDNN where SDPA would use it), then decode after a long prompt.
Everything runs in one process on one model, interleaved: every round measures SDPA and then each configuration
at one length, and each ratio is taken against the SDPA of the same round (medians over rounds are reported).

The model is the default model's architecture (SmolLM2-135M: Llama, 30 layers, 9 heads, 3 KV heads, head size
64) with random weights, since no weights can be loaded on a machine without the hub and the speed of a forward
does not depend on them. Prefill is a no-cache forward that keeps the logits of the last position only
(``logits_to_keep=1``: a 49152-word vocabulary over every position would dominate the memory at long lengths);
peak memory is ``torch.cuda.max_memory_allocated`` during it, less the memory held before it (the weights).
Decode: the decode prompt is prefilled once (unpatched), and every configuration decodes ``--decode-tokens``
greedy tokens from its own copy of that cache; the first step (where a patched model builds its rotated copy of
the cached keys) is reported apart from the steady rate of the others.

    python scripts/bench_attention_cuda.py [--lengths 16k,32k,64k,128k] [--methods rerope,self_extend,dca,string]
        [--dtype bfloat16] [--rounds 3] [--decode-length 32k] [--decode-tokens 64]
        [--out results/bench_attention_cuda.json] [--overwrite]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_attention import _methods  # (the CPU benchmark's check of --methods; this folder is sys.path[0])

from rope_ext.cli.options import int_at_least as _int_at_least, option as _option
from rope_ext.eval.perplexity import parse_lengths

#: the default model's architecture (SmolLM2-135M)
DEFAULT_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**DEFAULT_SHAPE)
    return LlamaForCausalLM(config).to("cuda", dtype).eval()


def _timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def _prefill(model, ids) -> tuple[float, int]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        seconds, _ = _timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1))
    return seconds, torch.cuda.max_memory_allocated() - before


def _decode(model, cache, first_token, tokens: int) -> tuple[float, float]:
    """Greedy steps from ``cache``: (first step seconds, steady tokens/s of the others)."""
    token = first_token
    times = []
    with torch.no_grad():
        for _ in range(tokens):
            seconds, out = _timed(lambda: model(input_ids=token, past_key_values=cache, use_cache=True))
            token = out.logits[:, -1:].argmax(-1)
            times.append(seconds)
    return times[0], (tokens - 1) / sum(times[1:])


def _with(model, config: str, fn):
    import rope_ext

    if config == "sdpa":
        return fn()
    if config == "sdpa_flash":  # SDPA held to its flash backend (the kernel the methods' windows use)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return fn()
    with rope_ext.patched(model, config):
        return fn()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16k,32k,64k,128k", type=_option(parse_lengths))
    parser.add_argument("--methods", default="rerope,leaky_rerope,self_extend,dca,string", type=_option(_methods))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=_int_at_least(1), default=3)
    parser.add_argument("--decode-length", type=_option(lambda text: parse_lengths(text)[0]), default=32768)
    parser.add_argument("--decode-tokens", type=_int_at_least(2), default=64)
    parser.add_argument("--out", default="results/bench_attention_cuda.json")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (scripts/bench_attention.py measures the CPU)")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        parser.error(f"{out} exists; pass --overwrite")
    model = _model(DTYPES[args.dtype])
    configs = ["sdpa", "sdpa_flash", *args.methods]
    generator = torch.Generator().manual_seed(0)
    prefill = []
    for length in args.lengths:
        ids = torch.randint(3, DEFAULT_SHAPE["vocab_size"], (1, length), generator=generator).to("cuda")
        for config in configs:  # warm-up (kernels, autotuning, the allocator)
            _with(model, config, lambda: _prefill(model, ids))
        for round_ in range(args.rounds):
            for config in configs:
                seconds, peak = _with(model, config, lambda: _prefill(model, ids))
                prefill.append(dict(length=length, config=config, round=round_, seconds=seconds, peak_bytes=peak))
                print(f"prefill {length} {config} round {round_}: {seconds:.3f} s, peak +{peak / 2**20:.0f} MiB",
                      flush=True)
    ids = torch.randint(3, DEFAULT_SHAPE["vocab_size"], (1, args.decode_length), generator=generator).to("cuda")
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    start_token = first.logits[:, -1:].argmax(-1)
    decode = []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for config in configs:
            cache = copy.deepcopy(first.past_key_values)
            steps = functools.partial(_decode, model, cache, start_token, args.decode_tokens)
            first_step, rate = _with(model, config, steps)
            del steps, cache
            if round_:
                row = dict(config=config, round=round_ - 1, first_step_seconds=first_step, tokens_per_second=rate)
                decode.append(row)
                print(f"decode {config} round {row['round']}: first {first_step * 1e3:.1f} ms, {rate:.1f} tok/s",
                      flush=True)
    summary = _summary(prefill, decode, configs, args.lengths)
    record = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=args.dtype, model="SmolLM2-135M "
        "architecture, random weights", rounds=args.rounds, decode_length=args.decode_length,
        decode_tokens=args.decode_tokens, summary=summary, prefill=prefill, decode=decode,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    for row in summary:
        print(json.dumps(row))
    return 0


def _summary(prefill, decode, configs, lengths) -> list[dict]:
    rows = []
    for length in lengths:
        base = {r["round"]: r for r in prefill if r["length"] == length and r["config"] == "sdpa"}
        for config in configs:
            runs = [r for r in prefill if r["length"] == length and r["config"] == config]
            rows.append(dict(
                stage="prefill", length=length, config=config,
                seconds=statistics.median(r["seconds"] for r in runs),
                time_ratio=statistics.median(r["seconds"] / base[r["round"]]["seconds"] for r in runs),
                peak_mib=statistics.median(r["peak_bytes"] for r in runs) / 2**20,
                peak_ratio=statistics.median(r["peak_bytes"] / base[r["round"]]["peak_bytes"] for r in runs),
            ))
    base = {r["round"]: r for r in decode if r["config"] == "sdpa"}
    for config in configs:
        runs = [r for r in decode if r["config"] == config]
        rows.append(dict(
            stage="decode", config=config,
            first_step_ms=1e3 * statistics.median(r["first_step_seconds"] for r in runs),
            tokens_per_second=statistics.median(r["tokens_per_second"] for r in runs),
            rate_ratio=statistics.median(r["tokens_per_second"] / base[r["round"]]["tokens_per_second"] for r in runs),
        ))
    return rows


if __name__ == "__main__":
    sys.exit(main())
