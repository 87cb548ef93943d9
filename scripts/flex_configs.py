"""How to run a bias of the distance as one flex-attention call on this GPU (``rope_ext.attention.flex``), measured.

1. The attention op alone, at the default model's shape (bf16, 9 heads over 3 KV heads, head size 64) and
   ``--length`` keys: SDPA's causal attention (cuDNN / flash, as SDPA picks) against flex attention under the causal
   block mask with no bias (flex's own floor), ALiBi computed from the distance (``linear``, rope_ext's form for
   ALiBi) and ALiBi read from a table by distance (``table``, the form for KERPLE and Sandwich), for each set of
   ``kernel_options`` below with static shapes (the committed set dynamic too). Each compiled after a dynamo reset
   (its compile time kept); then the configurations timed in interleaved rounds, the order reversed every other
   round, each against the SDPA of its round (median and spread). The largest distance of each biased form from
   float32 attention with the bias written out (at ``--check-length``) is kept beside it.
2. The whole model (random weights) patched with ALiBi at each ``--model-lengths`` value, with rope_ext's settings
   (``flex.KERNEL_OPTIONS`` / ``DYNAMIC`` / ``CLOSED_FORMS`` as committed) and with the fastest options of step 1,
   against the unpatched model's SDPA in the same interleaved rounds.

Writes ``$OUT/flex_configs.json`` (``--out``). Needs a CUDA GPU with Triton; ``--device cpu`` runs it uncompiled at
small sizes to check the script (its numbers mean nothing).

    python scripts/flex_configs.py [--length 16k] [--model-lengths 16k,32k] [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from bench_attention_cuda import DEFAULT_SHAPE  # (this folder is sys.path[0])

import rope_ext
from rope_ext.attention import flex
from rope_ext.methods.biases import alibi_slopes
from rope_ext.runs.values import parse_lengths

#: kernel_options tried (None: flex's defaults for the chip)
OPTIONS = [
    None,
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4},
]
#: rope_ext's settings as committed: (KERNEL_OPTIONS, DYNAMIC, FORM_OPTIONS)
COMMITTED = (flex.KERNEL_OPTIONS, flex.DYNAMIC, dict(flex.FORM_OPTIONS))
HEADS, KV_HEADS, HEAD_DIM = DEFAULT_SHAPE["num_attention_heads"], DEFAULT_SHAPE["num_key_value_heads"], 64


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _reset(options, dynamic):
    torch._dynamo.reset()
    flex._compiled.cache_clear()
    flex.FAILED.clear()
    flex.KERNEL_OPTIONS, flex.DYNAMIC = options, dynamic
    flex.FORM_OPTIONS = {} if (options, dynamic) != COMMITTED[:2] else COMMITTED[2]  # (a sweep: the same for all)


def _causal_only(q, k, v, scale):
    """Flex attention under the causal block mask with no score modification (through rope_ext's compiled call)."""
    block_mask, _ = flex._causal_mask(q.shape[2], k.shape[2], q.device)
    flex_attention, _ = flex._flex()
    call = flex._compiled() if flex.COMPILE else flex_attention
    extra = {"kernel_options": flex.FORM_OPTIONS.get("linear", flex.KERNEL_OPTIONS)} if flex.COMPILE else {}
    return call(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, **extra)


def _inputs(n, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, HEADS, n, HEAD_DIM, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, KV_HEADS, n, HEAD_DIM, device=device, dtype=dtype, generator=g)
    return q, k, v


def _biases(device):
    """The closed forms of the distance ``d`` measured, ALiBi's ``-s d`` -> ``{form: (closed form, f(d) -> [h, ...]
    float32)}`` (KERPLE's ``-r1 log(1 + r2 d)`` was measured so too, in docs/results/cuda/h200_third/run1: slower
    than its table, so rope_ext's kernel does not take it)."""
    slopes = torch.tensor(alibi_slopes(HEADS), device=device)
    return {"linear": (("linear", slopes, None), lambda d: -slopes.view(-1, *[1] * d.dim()) * d)}


def op_sweep(args, device, dtype) -> dict:
    n, scale = args.length, HEAD_DIM ** -0.5
    q, k, v = _inputs(n, device, dtype)
    cq, ck, cv = _inputs(args.check_length, device, dtype, seed=1)
    m = args.check_length
    d = torch.arange(m, device=device, dtype=torch.float32)
    distance = (d[:, None] - d[None, :]).clamp(min=0)
    groups = HEADS // KV_HEADS
    biases = _biases(device)
    exact, tables = {}, {}
    for name, (_, bias) in biases.items():  # (float32 attention with the bias written out; its table by distance)
        full = bias(distance).masked_fill(d[None, :] > d[:, None], float("-inf"))[None]
        exact[name] = F.scaled_dot_product_attention(cq.float(), ck.float().repeat_interleave(groups, 1),
                                                     cv.float().repeat_interleave(groups, 1), attn_mask=full,
                                                     scale=scale)
        tables[name] = bias(torch.arange(n, device=device, dtype=torch.float32)).contiguous()
    exact["table"] = exact["linear"]
    forms = {
        "causal": lambda x, y, z: _causal_only(x, y, z, scale),
        **{name: (lambda x, y, z, f=form: flex.distance_biased(x, y, z, scale, form=f))
           for name, (form, _) in biases.items()},
        "table": lambda x, y, z: flex.distance_biased(
            x, y, z, scale, table=tables["linear"] if x.shape[2] == n else tables["linear"][:, :m].contiguous()),
    }
    rows = []
    committed = (flex.KERNEL_OPTIONS, flex.DYNAMIC)
    # (static shapes for every option set; the committed options dynamic too, as the first sweep measured them all)
    settings = [(o, False) for o in OPTIONS] + [(flex.KERNEL_OPTIONS, True)]
    for options, dynamic in settings:
        for form, fn in forms.items():
            _reset(options, dynamic)
            row = {"options": options, "dynamic": dynamic, "form": form}
            try:
                row["compile_s"] = _timed(lambda: fn(q, k, v), device)
                out = fn(q, k, v)
                if out is None or flex.FAILED:
                    row["failed"] = True
                else:
                    if form != "causal":
                        row["max_diff_vs_float32"] = (fn(cq, ck, cv).float() - exact[form]).abs().max().item()
                    row["times"] = []
            except Exception as error:  # (a config the compiler refuses: kept with its words)
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "times"}), flush=True)
            if "times" in row:  # (timed now, on this compile, against SDPA in interleaved rounds)
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
                ratios = []
                for r in range(args.rounds):
                    pair = [("sdpa", sdpa), ("flex", lambda: fn(q, k, v))]
                    got = dict((name, _timed(f, device)) for name, f in (pair if r % 2 == 0 else pair[::-1]))
                    ratios.append(got["flex"] / got["sdpa"])
                    row["times"].append(got)
                row["ratio"] = _spread(ratios)
                print(json.dumps({"form": form, "options": options, "dynamic": dynamic, "ratio": row["ratio"]}),
                      flush=True)
    _reset(*committed)
    return {"length": n, "check_length": args.check_length, "rows": rows}


def model_runs(args, device, dtype, best) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(DEFAULT_SHAPE | dict(num_hidden_layers=args.layers))))
    model = model.to(device, dtype).eval()
    committed = (flex.KERNEL_OPTIONS, flex.DYNAMIC)
    settings = {"committed": committed}
    if best is not None and best != committed:
        settings["fastest_op"] = best
    out = []
    for length in args.model_lengths:
        ids = torch.randint(3, DEFAULT_SHAPE["vocab_size"], (1, length), device=device)
        fwd = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)
        for name, (options, dynamic) in settings.items():
            _reset(options, dynamic)
            row = {"length": length, "setting": name, "options": options, "dynamic": dynamic, "ratios": []}
            try:
                with torch.no_grad():
                    fwd()
                    with rope_ext.patched(model, "alibi"):
                        row["compile_s"] = _timed(fwd, device)
                    for r in range(args.rounds):
                        got = {}
                        for which in (("sdpa", "alibi") if r % 2 == 0 else ("alibi", "sdpa")):
                            if which == "alibi":
                                with rope_ext.patched(model, "alibi"):
                                    got[which] = _timed(fwd, device)
                            else:
                                got[which] = _timed(fwd, device)
                        row["ratios"].append(got["alibi"] / got["sdpa"])
                        row.setdefault("sdpa_s", []).append(got["sdpa"])
                    row["failed"] = bool(flex.FAILED)
                    if device == "cuda":
                        with rope_ext.patched(model, "alibi"):
                            torch.cuda.reset_peak_memory_stats()
                            before = torch.cuda.memory_allocated()
                            fwd()
                            alibi_peak = torch.cuda.max_memory_allocated() - before
                        torch.cuda.reset_peak_memory_stats()
                        before = torch.cuda.memory_allocated()
                        fwd()
                        row["peak_ratio"] = alibi_peak / (torch.cuda.max_memory_allocated() - before)
                row["ratio"] = _spread(row["ratios"])
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                traceback.print_exc()
            print(json.dumps(row), flush=True)
            out.append(row)
    _reset(*committed)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=parse_lengths, default=[16384])
    parser.add_argument("--check-length", type=int, default=4096)
    parser.add_argument("--model-lengths", type=parse_lengths, default=[16384, 32768])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=DEFAULT_SHAPE["num_hidden_layers"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    args.length = args.length[0]
    device, dtype = args.device, torch.bfloat16
    if device == "cpu":  # (a check of the script: flex's eager implementation, float32)
        flex.COMPILE, dtype = False, torch.float32
        flex.available = lambda q, k, v: True
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "committed": {"kernel_options": flex.KERNEL_OPTIONS, "dynamic": flex.DYNAMIC,
                            "form_options": flex.FORM_OPTIONS,
                            "closed_forms": flex.CLOSED_FORMS}}
    ops = op_sweep(args, device, dtype)
    result["op"] = ops
    timed = [r for r in ops["rows"] if r["form"] == "linear" and "ratio" in r]
    best = min(timed, key=lambda r: r["ratio"]["median"]) if timed else None
    result["fastest_linear"] = best and {k: best[k] for k in ("options", "dynamic", "ratio")}
    result["model"] = model_runs(args, device, dtype, best and (best["options"], best["dynamic"]))
    path = os.path.join(args.out, "flex_configs.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
