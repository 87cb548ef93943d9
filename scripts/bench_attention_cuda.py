"""Speed and memory of the attention-rewrite methods and the biases on a CUDA GPU: whole-model prefill time and peak
GPU memory at each length for plain SDPA (unpatched: cuDNN attention on Hopper in half precision, as SDPA picks
it), SDPA held to its flash backend (``sdpa_flash``) and each method's fast path (its band regions as windowed calls
of the aten flash op, its unmasked and square causal ones on cuDNN where SDPA would use it; a bias's blocks on the
memory-efficient op), then decode after a long prompt, at each batch size.

Everything runs in one process on one model, interleaved: every round measures SDPA and each configuration at one
length, the order reversed every other round, and each ratio is taken against the SDPA of the same round (the median
over rounds is reported with the smallest and largest).

The model is the default model's architecture (SmolLM2-135M: Llama, 30 layers, 9 heads, 3 KV heads, head size
64) with random weights, since no weights can be loaded on a machine without the hub and the speed of a forward
does not depend on them. Prefill is a no-cache forward that keeps the logits of the last position only
(``logits_to_keep=1``: a 49152-word vocabulary over every position would dominate the memory at long lengths);
peak memory is ``torch.cuda.max_memory_allocated`` during it, less the memory held before it (the weights).

Decode: each configuration prefills the decode prompt under its own patch (a position rule's cache holds unrotated
keys: a cache belongs to its patch), then, in interleaved rounds, decodes ``--decode-tokens`` greedy tokens from a
copy of that cache; the first step (where a patched model builds its rotated copy of the cached keys) is reported
apart from the steady rate of the others. ``--decode-batches`` repeats it with that many rows.

``--model t5``: a T5 of t5-small's shape (random weights): its encoder over each length and 128 decoder tokens,
transformers' own T5 (SDPA with its bias written out as a ``[1, heads, n, n]`` float mask in every layer) against a
bucket method on rope_ext's strided path. No decode.

``--profile FILE``: one more forward per configuration at the first length (and one decode step), under
``torch.profiler``: the number of kernels launched and the device time by kernel, written to ``FILE`` (JSON).

``--device cpu`` runs the same code on the CPU with ``--layers`` layers, to check the script (its numbers mean
nothing).

    python scripts/bench_attention_cuda.py [--lengths 16k,32k,64k,128k] [--methods rerope,self_extend,dca,string]
        [--model default|t5] [--dtype bfloat16] [--rounds 3] [--decode-length 32k] [--decode-tokens 32]
        [--decode-batches 1,8] [--profile FILE] [--out results/bench_attention_cuda.json] [--overwrite]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import T5_DECODER_TOKENS, T5_SHAPE, decode_tokens, spec_list  # (this folder is sys.path[0])

from rope_ext.cli.options import int_at_least, option
from rope_ext.runs.values import comma_items, parse_lengths

#: the default model's architecture (SmolLM2-135M)
DEFAULT_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _model(name: str, dtype: torch.dtype, device: str, layers: int):
    torch.manual_seed(0)
    if name == "t5":
        from transformers import AutoModelForSeq2SeqLM, T5Config

        shape = T5_SHAPE | dict(num_layers=min(layers, T5_SHAPE["num_layers"]),
                                num_decoder_layers=min(layers, T5_SHAPE["num_decoder_layers"]))
        model = AutoModelForSeq2SeqLM.from_config(T5Config(**shape), attn_implementation="sdpa")
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**(DEFAULT_SHAPE | dict(num_hidden_layers=layers))))
    return model.to(device, dtype).eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def _forward(model, ids, name: str):
    if name == "t5":
        return model(input_ids=ids, decoder_input_ids=ids[:, :T5_DECODER_TOKENS], use_cache=False)
    return model(input_ids=ids, use_cache=False, logits_to_keep=1)


def _prefill(model, ids, name: str, device: str) -> tuple[float, int | None]:
    on_cuda = device == "cuda"
    _sync(device)
    before = torch.cuda.memory_allocated() if on_cuda else 0
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        seconds, _ = _timed(lambda: _forward(model, ids, name), device)
    return seconds, (torch.cuda.max_memory_allocated() - before) if on_cuda else None  # (None: not measured)


def _decode(model, cache, first_token, tokens: int, device: str) -> tuple[float, float]:
    """Greedy steps from ``cache``: (first step seconds, steady tokens/s per row of the others)."""
    token = first_token
    times = []
    with torch.no_grad():
        for _ in range(tokens):
            seconds, out = _timed(lambda: model(input_ids=token, past_key_values=cache, use_cache=True), device)
            token = out.logits[:, -1:].argmax(-1)
            times.append(seconds)
    return times[0], (tokens - 1) / sum(times[1:])


def _patch(model, config: str):
    """The context a configuration runs in: unpatched SDPA, SDPA held to its flash backend, or a patch."""
    import rope_ext

    if config == "sdpa":
        return contextlib.nullcontext()
    if config == "sdpa_flash":  # (the kernel the methods' windows use)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return rope_ext.patched(model, config)


def _ordered(configs: list[str], round_: int) -> list[str]:
    """Every other round in the reverse order (SDPA first, then last)."""
    return configs if round_ % 2 == 0 else configs[::-1]


def _measure_prefill(model, args, configs, generator) -> list[dict]:
    rows = []
    for length in args.lengths:
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=generator).to(args.device)
        for config in configs:  # warm-up (kernels, autotuning, the allocator)
            with _patch(model, config):
                _prefill(model, ids, args.model, args.device)
        for round_ in range(args.rounds):
            for config in _ordered(configs, round_):
                with _patch(model, config):
                    seconds, peak = _prefill(model, ids, args.model, args.device)
                rows.append(dict(length=length, config=config, round=round_, seconds=seconds, peak_bytes=peak))
                shown = "not measured" if peak is None else f"+{peak / 2**20:.0f} MiB"
                print(f"prefill {length} {config} round {round_}: {seconds:.3f} s, peak {shown}", flush=True)
    return rows


def _measure_decode(model, args, configs, generator) -> list[dict]:
    """Each configuration on its own copy of the model, patched for the whole measurement (its cache belongs to
    that patch)."""
    import rope_ext

    copies = {}
    for config in configs:
        copies[config] = copy.deepcopy(model)
        if config not in ("sdpa", "sdpa_flash"):
            rope_ext.patch(copies[config], config)
    rows = []
    for batch in args.decode_batches:
        ids = torch.randint(3, model.config.vocab_size, (batch, args.decode_length), generator=generator)
        ids = ids.to(args.device)
        prefilled = {}
        for config in configs:  # (each configuration's own cache)
            with _held(config), torch.no_grad():
                out = copies[config](input_ids=ids, use_cache=True, logits_to_keep=1)
            prefilled[config] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
            del out
        for round_ in range(args.rounds + 1):  # round 0 warms up (a few tokens)
            tokens = args.decode_tokens if round_ else 3
            for config in _ordered(configs, round_):
                cache, token = prefilled[config]
                cache = copy.deepcopy(cache)
                with _held(config):
                    first_step, rate = _decode(copies[config], cache, token, tokens, args.device)
                del cache
                if round_:
                    row = dict(batch=batch, config=config, round=round_ - 1, first_step_seconds=first_step,
                               steps_per_second=rate)
                    rows.append(row)
                    print(f"decode batch {batch} {config} round {row['round']}: first {first_step * 1e3:.1f} ms, "
                          f"{rate:.1f} steps/s", flush=True)
        del prefilled
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _held(config: str):
    """SDPA held to its flash backend for ``sdpa_flash``; nothing for the others (patched on their copies)."""
    return _patch(None, config) if config == "sdpa_flash" else contextlib.nullcontext()


def _profile(model, args, configs, generator) -> dict:
    """Kernels launched and device time by kernel: one prefill at the first length, one decode step after it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    length = args.lengths[0]
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=generator).to(args.device)
    result = {}
    for config in configs:
        entry = {}
        with _patch(model, config), torch.no_grad():
            stages = [("prefill", lambda: _forward(model, ids, args.model))]
            if args.model != "t5":
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                model(input_ids=token, past_key_values=cache, use_cache=True)  # (the first step builds copies)
                stages.append(("decode_step", lambda: model(input_ids=token, past_key_values=cache, use_cache=True)))
            for stage, fn in stages:
                fn()
                _sync(args.device)
                with profile(activities=activities) as prof:
                    seconds, _ = _timed(fn, args.device)
                events = prof.key_averages()
                kernels = [e for e in events if getattr(e, "device_type", None) is not None
                           and str(e.device_type).endswith("CUDA")]
                top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:15]
                entry[stage] = dict(
                    wall_ms=seconds * 1e3,
                    kernels_launched=sum(e.count for e in kernels),
                    device_ms=sum(e.self_device_time_total for e in kernels) / 1e3,
                    top=[dict(name=e.key[:120], count=e.count, device_ms=e.self_device_time_total / 1e3) for e in top],
                    syncs=sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize")),
                    copies_to_host=sum(e.count for e in events if e.key == "cudaMemcpyAsync"),
                )
                print(f"profile {config} {stage}: {entry[stage]['kernels_launched']} kernels, "
                      f"{entry[stage]['device_ms']:.1f} ms on the device, {entry[stage]['wall_ms']:.1f} ms wall",
                      flush=True)
        result[config] = entry
    return dict(length=length, configs=result)


def _spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def _summary(prefill, decode, configs, lengths, batches) -> list[dict]:
    rows = []
    for length in lengths:
        base = {r["round"]: r for r in prefill if r["length"] == length and r["config"] == "sdpa"}
        for config in configs:
            runs = [r for r in prefill if r["length"] == length and r["config"] == config]
            if not runs:
                continue
            time_ratio = _spread([r["seconds"] / base[r["round"]]["seconds"] for r in runs])
            measured = runs[0]["peak_bytes"] is not None  # (on the CPU: not measured, null)
            peak_ratio = _spread([r["peak_bytes"] / max(1, base[r["round"]]["peak_bytes"]) for r in runs]) if measured \
                else dict(median=None)
            rows.append(dict(
                stage="prefill", length=length, config=config,
                seconds=statistics.median(r["seconds"] for r in runs), time_ratio=time_ratio["median"],
                time_ratio_spread=[time_ratio["min"], time_ratio["max"]],
                peak_mib=statistics.median(r["peak_bytes"] for r in runs) / 2**20 if measured else None,
                peak_ratio=peak_ratio["median"],
            ))
    for batch in batches:
        base = {r["round"]: r for r in decode if r["batch"] == batch and r["config"] == "sdpa"}
        for config in configs:
            runs = [r for r in decode if r["batch"] == batch and r["config"] == config]
            if not runs:
                continue
            rate_ratio = _spread([r["steps_per_second"] / base[r["round"]]["steps_per_second"] for r in runs])
            rows.append(dict(
                stage="decode", batch=batch, config=config,
                first_step_ms=1e3 * statistics.median(r["first_step_seconds"] for r in runs),
                steps_per_second=statistics.median(r["steps_per_second"] for r in runs),
                rate_ratio=rate_ratio["median"], rate_ratio_spread=[rate_ratio["min"], rate_ratio["max"]],
            ))
    return rows


def _one_length(text: str) -> int:
    return parse_lengths(text)[0]


def _batches(text: str) -> list[int]:
    parts = comma_items(text, "batch size")
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"batch sizes of at least 1, comma-separated, got {text!r}")
    return [int(part) for part in parts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16k,32k,64k,128k", type=option(parse_lengths))
    parser.add_argument("--methods", default="rerope,leaky_rerope,self_extend,dca,string", type=option(spec_list))
    parser.add_argument("--model", choices=["default", "t5"], default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int_at_least(1), default=3)
    parser.add_argument("--decode-length", type=option(_one_length), default=32768)
    parser.add_argument("--decode-tokens", type=option(decode_tokens), default=None,
                        help="greedy steps per round (0: no decode; default 32, and 0 with --model t5)")
    parser.add_argument("--decode-batches", type=option(_batches), default=[1, 8])
    parser.add_argument("--profile", default=None, help="write the profiled kernel counts and times here (JSON)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: check the script on the CPU (with --layers), its numbers mean nothing")
    parser.add_argument("--layers", type=int_at_least(1), default=DEFAULT_SHAPE["num_hidden_layers"])
    parser.add_argument("--out", default="results/bench_attention_cuda.json")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (scripts/bench_attention.py measures the CPU; --device cpu checks this script)")
    if args.decode_tokens is None:
        args.decode_tokens = 0 if args.model == "t5" else 32
    if args.model == "t5" and args.decode_tokens:
        parser.error("--model t5 measures the prefill only: leave --decode-tokens out, or pass 0")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        parser.error(f"{out} exists; pass --overwrite")
    model = _model(args.model, DTYPES[args.dtype], args.device, args.layers)
    configs = ["sdpa"] + (["sdpa_flash"] if args.model == "default" and args.device == "cuda" else []) + args.methods
    generator = torch.Generator().manual_seed(0)
    record = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
        dtype=args.dtype, rounds=args.rounds,
        model=("T5 of t5-small's shape, random weights; prefill: encoder over the length, "
               f"{T5_DECODER_TOKENS} decoder tokens" if args.model == "t5"
               else f"SmolLM2-135M architecture ({args.layers} layer{'s' if args.layers > 1 else ''}), random weights"),
    )
    if args.profile:  # (first: short, and what a later session needs most)
        Path(args.profile).write_text(json.dumps(record | _profile(model, args, configs, generator), indent=1) + "\n")
    prefill = _measure_prefill(model, args, configs, generator)
    decode = _measure_decode(model, args, configs, generator) if args.decode_tokens else []
    batches = args.decode_batches if args.decode_tokens else []
    summary = _summary(prefill, decode, configs, args.lengths, batches)
    record |= dict(decode_length=args.decode_length, decode_tokens=args.decode_tokens, decode_batches=batches,
                   summary=summary, prefill=prefill, decode=decode)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    for row in summary:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
