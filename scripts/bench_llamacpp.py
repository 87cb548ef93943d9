"""The real llama.cpp (through llama-cpp-python) on a GGUF file: the perplexity of the last ``--target-tokens`` of the
first ``--tokens`` tokens of a text, each predicted from every token before it, with the token ids it scored, so that
``scripts/bench_llamacpp_compare.py`` scores the same ids with rope_ext.

A benchmark, not a test: CI never needs llama.cpp. It runs in its own virtual environment, with llama-cpp-python and
without rope_ext or torch (this script imports neither):

    python3 -m venv /work/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 /work/llamacpp-venv/bin/pip install llama-cpp-python
    /work/llamacpp-venv/bin/python scripts/bench_llamacpp.py --gguf EXPORTED.gguf --text-file kjv.txt \\
        --tokens 12288 --target-tokens 1024 --out llamacpp.json

The rotation llama.cpp applies comes from the file's metadata alone (what ``rope-ext export --target llama.cpp``
writes); ``--rope-scaling-type``, ``--rope-freq-scale``, ``--yarn-orig-ctx`` and ``--rope-freq-base`` override it
through ``llama_cpp.Llama``'s arguments, and are recorded when given. The KV cache is llama.cpp's default (f16) unless
``--kv-type f32``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the GGUF file llama.cpp loads")
    parser.add_argument("--text-file", required=True, help="a long UTF-8 text: its first --tokens tokens are run")
    parser.add_argument("--tokens", type=int, required=True, help="context length N (the llama.cpp context, n_ctx)")
    parser.add_argument("--target-tokens", type=int, default=1024, help="the last tokens scored (default 1024)")
    parser.add_argument("--out", required=True, help="JSON file written")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512, help="n_batch (and n_ubatch)")
    parser.add_argument("--kv-type", choices=("f16", "f32"), default="f16", help="KV cache type (llama.cpp's default f16)")
    parser.add_argument("--add-bos", action="store_true",
                        help="ask the tokenizer for a BOS token (llama.cpp adds one only where the file says so)")
    parser.add_argument("--label", default=None, help="a name for this run, recorded")
    # overrides of the file's rope metadata (left out: the file alone decides)
    parser.add_argument("--rope-scaling-type", choices=SCALING_TYPES, default=None)
    parser.add_argument("--rope-freq-scale", type=float, default=None)
    parser.add_argument("--rope-freq-base", type=float, default=None)
    parser.add_argument("--yarn-orig-ctx", type=int, default=None)
    args = parser.parse_args(argv)
    if args.tokens < 2 or not 1 <= args.target_tokens < args.tokens:
        parser.error("need --tokens >= 2 and 1 <= --target-tokens < --tokens")
    return args


def first_tokens(llm, text: str, count: int, add_bos: bool) -> tuple[list[int], int]:
    """The first ``count`` token ids of ``text`` (llama.cpp's tokenizer) and the characters tokenized for them: a
    prefix of the text, grown until it gives a margin of tokens past ``count`` (so the cut never touches them)."""
    margin = 64
    chars = min(len(text), 8 * (count + margin))
    while True:
        ids = llm.tokenize(text[:chars].encode("utf-8"), add_bos=add_bos, special=False)
        if len(ids) >= count + margin or chars == len(text):
            break
        chars = min(len(text), chars * 2)
    if len(ids) < count:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than --tokens {count}")
    return ids[:count], chars


def metadata_rope(llm) -> dict[str, str]:
    """The file's context and rope keys as llama.cpp read them."""
    return {key: value for key, value in sorted(llm.metadata.items())
            if ".rope." in key or key.endswith(".context_length") or key == "general.architecture"}


def overrides(args: argparse.Namespace) -> dict:
    import llama_cpp

    given = {}
    if args.rope_scaling_type is not None:
        given["rope_scaling_type"] = getattr(llama_cpp, f"LLAMA_ROPE_SCALING_TYPE_{args.rope_scaling_type.upper()}")
    if args.rope_freq_scale is not None:
        given["rope_freq_scale"] = args.rope_freq_scale
    if args.rope_freq_base is not None:
        given["rope_freq_base"] = args.rope_freq_base
    if args.yarn_orig_ctx is not None:
        given["yarn_orig_ctx"] = args.yarn_orig_ctx
    return given


def target_nll(scores: np.ndarray, ids: list[int], target_tokens: int) -> np.ndarray:
    """NLL (float64) of the last ``target_tokens`` of ``ids``: row ``t - 1`` of the logits predicts token ``t``."""
    n = len(ids)
    start = n - target_tokens
    logits = scores[start - 1:n - 1].astype(np.float64)  # [T, V]
    top = logits.max(axis=1, keepdims=True)
    log_z = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
    picked = logits[np.arange(target_tokens), np.asarray(ids[start:n])]
    return log_z - picked


def dumps(record: dict) -> str:
    """JSON with one key a line and each list of numbers on one line (the ids, the per-token NLL)."""
    lists = {key: value for key, value in record.items() if isinstance(value, list)}
    text = json.dumps({key: (f"@{key}@" if key in lists else value) for key, value in record.items()}, indent=1)
    for key, value in lists.items():
        text = text.replace(json.dumps(f"@{key}@"), json.dumps(value))
    return text + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import llama_cpp

    text = Path(args.text_file).read_text(encoding="utf-8")
    given = overrides(args)
    kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[args.kv_type]
    began = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.gguf, n_ctx=args.tokens, logits_all=True, n_threads=args.threads,
        n_threads_batch=args.threads, n_batch=args.batch, n_ubatch=args.batch, type_k=kv, type_v=kv,
        verbose=False, **given,
    )
    load_seconds = time.perf_counter() - began
    ids, chars = first_tokens(llm, text, args.tokens, args.add_bos)

    began = time.perf_counter()
    llm.reset()
    llm.eval(ids)
    eval_seconds = time.perf_counter() - began
    nll = target_nll(llm.scores, ids, args.target_tokens)
    mean = float(nll.mean())
    context = llm.ctx

    record = {
        "engine": "llama.cpp",
        "label": args.label,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "gguf": str(Path(args.gguf).resolve()),
        "gguf_rope_metadata": metadata_rope(llm),
        "context_used": {
            "n_ctx": llama_cpp.llama_n_ctx(context),
            "n_ctx_train": llama_cpp.llama_model_n_ctx_train(llm.model),
        },
        # what llama-cpp-python passed to llama.cpp (0 / negative / UNSPECIFIED: the file's value; llama.cpp itself
        # replaces yarn_attn_factor where YaRN is on, from the file's rope.scaling.attn_factor)
        "context_params_passed": {field: getattr(llm.context_params, field) for field in (
            "rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
            "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx", "type_k", "type_v", "flash_attn_type")},
        "overrides": {key: args.__dict__[key] for key in
                      ("rope_scaling_type", "rope_freq_scale", "rope_freq_base", "yarn_orig_ctx")
                      if args.__dict__[key] is not None},
        "settings": {"n_threads": args.threads, "n_batch": args.batch, "n_ubatch": args.batch,
                     "kv_type": args.kv_type, "flash_attn": False, "logits_all": True},
        "text_file": str(Path(args.text_file).resolve()),
        "text_chars_tokenized": chars,
        "add_bos": args.add_bos,
        "tokens": args.tokens,
        "target_tokens": args.target_tokens,
        "target_start": args.tokens - args.target_tokens,
        "mean_nll": mean,
        "perplexity": math.exp(mean),
        "nll_by_quarter": [float(part.mean()) for part in np.array_split(nll, 4)],
        "token_nll": [round(float(value), 6) for value in nll],
        "seconds": {"load": round(load_seconds, 3), "eval": round(eval_seconds, 3)},
        "tokens_per_second": round(args.tokens / eval_seconds, 1),
        "token_ids": ids,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(record))
    print(f"{args.label or Path(args.gguf).name}: N={args.tokens} last {args.target_tokens}: mean NLL {mean:.4f}, "
          f"ppl {math.exp(mean):.3f} ({eval_seconds:.1f} s, {args.tokens / eval_seconds:.0f} tok/s) -> {out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
