"""Which flex-attention kernel options compile for the default model's shape (bf16, 9 heads over 3, d=64) on this
GPU, and their speed: ALiBi prefill of the whole model at 16k against SDPA, each option after a dynamo reset, and
the largest logit distance from the blockwise path at 2k. Writes ``$OUT/flex_configs.json`` (the current folder
without ``OUT``). Needs a CUDA GPU with Triton: ``python scripts/flex_configs.py`` (``rope_ext.attention.flex``'s
``KERNEL_OPTIONS`` were chosen with it, ``docs/results/cuda/flex_configs.json``)."""

import json
import os
import statistics
import time
import warnings

import torch
from bench_attention_cuda import DEFAULT_SHAPE  # (this folder is sys.path[0])
from transformers import LlamaConfig, LlamaForCausalLM

import rope_ext
from rope_ext.attention import flex

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**DEFAULT_SHAPE)).to("cuda", torch.bfloat16).eval()
ids = torch.randint(3, 49152, (1, 16384), device="cuda")
def timed(fn, rounds=3):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); out.append(time.perf_counter() - t)
    return statistics.median(out)
fwd = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)
results = []
with torch.no_grad():
    fwd(); sdpa = timed(fwd)
    short = ids[:, :2048]
    with rope_ext.patched(model, "alibi"):
        flex.COMPILE_FAILED = True  # the blockwise path: the reference logits at 2k
        blockwise = model(input_ids=short).logits.float()
    for options in [None, {"num_stages": 2}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2},
                    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4}, {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}]:
        torch._dynamo.reset(); flex._compiled.cache_clear(); flex.COMPILE_FAILED = False; flex.KERNEL_OPTIONS = options
        row = dict(options=options)
        try:
            with rope_ext.patched(model, "alibi"), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.perf_counter(); logits = model(input_ids=short).logits.float(); row["compile_s"] = time.perf_counter() - t0
                row["failed"] = flex.COMPILE_FAILED
                row["warnings"] = [str(w.message)[:300] for w in caught][:2]
                row["max_diff_vs_blockwise_2k"] = (logits - blockwise).abs().max().item()
                if not flex.COMPILE_FAILED:
                    fwd(); row["ratio_16k"] = timed(fwd) / sdpa
                    torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated(); fwd()
                    row["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        print(json.dumps(row), flush=True); results.append(row)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sdpa_16k_s=sdpa, results=results),
          open(os.path.join(os.environ.get("OUT", "."), "flex_configs.json"), "w"), indent=1)
