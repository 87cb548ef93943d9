"""rope_ext's side of ``scripts/bench_llamacpp.py``: the same token ids (read from its JSON), the same targets (the last
``target_tokens``), scored by the default model (fp32, dequantized from the same Q4_1 GGUF file) patched with each of
``--methods`` and unpatched (``none``); per method the mean NLL, the perplexity, and how far its per-token NLL lies from
each llama.cpp run given.

    .venv/bin/python scripts/bench_llamacpp_compare.py --llamacpp yarn.json [--llamacpp original.json ...] \\
        --methods yarn:factor=4 --out compare.json

All ``--llamacpp`` files must hold the same ids (runs of one text at one length). The default model's tokenizer
(transformers') is checked against llama.cpp's ids on the same text, and the result recorded; the ids scored are
llama.cpp's either way.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

import rope_ext
from rope_ext.eval.perplexity import token_nll


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp", action="append", required=True,
                        help="a JSON file bench_llamacpp.py wrote (repeat for several runs of the same ids)")
    parser.add_argument("--methods", default="yarn:factor=4",
                        help="comma-separated rope_ext specs scored besides the unpatched model (default yarn:factor=4)")
    parser.add_argument("--out", required=True, help="JSON file written")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    return parser.parse_args(argv)


def tokenizer_check(tokenizer, run: dict) -> dict:
    """Whether transformers' tokenizer gives llama.cpp's ids on the same characters of the same text."""
    path = Path(run["text_file"])
    if not path.is_file():
        return {"checked": False, "why": f"{path} not found"}
    text = path.read_text(encoding="utf-8")[:run["text_chars_tokenized"]]
    ours = tokenizer(text, add_special_tokens=run.get("add_bos", False))["input_ids"][:len(run["token_ids"])]
    theirs = run["token_ids"]
    first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first_difference is None and len(ours) < len(theirs):
        first_difference = len(ours)
    return {"checked": True, "same_ids": first_difference is None, "first_difference": first_difference}


def agreement(ours: torch.Tensor, run: dict) -> dict:
    """How rope_ext's per-token NLL compares with a llama.cpp run's on the same targets."""
    theirs = torch.tensor(run["token_nll"], dtype=torch.float64)
    ours = ours.to(torch.float64)
    difference = ours - theirs
    correlation = torch.corrcoef(torch.stack([ours, theirs]))[0, 1].item()
    return {
        "llamacpp_label": run.get("label"),
        "llamacpp_mean_nll": run["mean_nll"],
        "llamacpp_perplexity": run["perplexity"],
        "mean_nll_difference": float(ours.mean() - theirs.mean()),  # rope_ext minus llama.cpp
        "perplexity_ratio": math.exp(float(ours.mean() - theirs.mean())),
        "token_nll_mean_abs_difference": float(difference.abs().mean()),
        "token_nll_max_abs_difference": float(difference.abs().max()),
        "token_nll_correlation": correlation,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = [json.loads(Path(file).read_text()) for file in args.llamacpp]
    ids_list = runs[0]["token_ids"]
    target_tokens = runs[0]["target_tokens"]
    for file, run in zip(args.llamacpp, runs):
        if run["token_ids"] != ids_list or run["target_tokens"] != target_tokens:
            raise SystemExit(f"{file} holds other ids or targets than {args.llamacpp[0]}: give runs of one text and length")
    ids = torch.tensor([ids_list])
    start = ids.shape[-1] - target_tokens

    began = time.perf_counter()
    model, tokenizer = rope_ext.load_default_model(dtype=torch.float32)
    load_seconds = time.perf_counter() - began
    specs = ["none"] + [spec.strip() for spec in args.methods.split(",") if spec.strip()]
    results = []
    for spec in specs:
        if spec != "none":
            rope_ext.patch(model, spec)
        began = time.perf_counter()
        nll = token_nll(model, ids, start=start)
        seconds = time.perf_counter() - began
        if spec != "none":
            rope_ext.unpatch(model)
        mean = float(nll.double().mean())
        results.append({
            "method": spec,
            "mean_nll": mean,
            "perplexity": math.exp(mean),
            "nll_by_quarter": [float(part.double().mean()) for part in torch.tensor_split(nll, 4)],
            "seconds": round(seconds, 3),
            "against_llamacpp": [agreement(nll, run) for run in runs],
            "token_nll": [round(float(value), 6) for value in nll],
        })
        print(f"rope_ext {spec}: N={ids.shape[-1]} last {target_tokens}: mean NLL {mean:.4f}, ppl {math.exp(mean):.3f} "
              f"({seconds:.1f} s)", file=sys.stderr)

    import transformers

    record = {
        "engine": "rope_ext (transformers, fp32 dequantized from the GGUF)",
        "rope_ext": getattr(rope_ext, "__version__", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": args.threads,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "llamacpp_files": [str(Path(file).resolve()) for file in args.llamacpp],
        "tokens": ids.shape[-1],
        "target_tokens": target_tokens,
        "target_start": start,
        "tokenizer_check": tokenizer_check(tokenizer, runs[0]),
        "load_seconds": round(load_seconds, 3),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lists = {}
    for number, result in enumerate(results):  # (each per-token list on one line)
        lists[f"@token_nll_{number}@"], result["token_nll"] = result["token_nll"], f"@token_nll_{number}@"
    text = json.dumps(record, indent=1)
    for key, value in lists.items():
        text = text.replace(json.dumps(key), json.dumps(value))
    out.write_text(text + "\n")
    for result in results:
        for against in result["against_llamacpp"]:
            print(f"  {result['method']} vs llama.cpp {against['llamacpp_label']}: ppl {result['perplexity']:.3f} vs "
                  f"{against['llamacpp_perplexity']:.3f} (ratio {against['perplexity_ratio']:.4f}, per-token |dNLL| "
                  f"{against['token_nll_mean_abs_difference']:.4f}, r {against['token_nll_correlation']:.4f})",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
