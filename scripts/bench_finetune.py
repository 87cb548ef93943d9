"""Training-step cost of fine-tuning under a patch, against plain LoRA on the unpatched model in the same run.

    python scripts/bench_finetune.py --window 2k --methods none,yarn:factor=4 --rounds 3 \
        --s2-window 8k --out docs/results/finetune/bench_step.json

Time: one process loads the default model once; each round runs one training step (forward, backward, AdamW step on
LoRA q/k/v/o, r=8) of every configuration in turn (the order rotated each round), a configuration being patched and
LoRA-wrapped afresh and undone after (peft's ``unload``, ``rope_ext.unpatch``). Ratios are against the same round's
baseline (``none`` at the window; full attention, i.e. the method without S2-Attn, at ``--s2-window``); medians
with min-max over rounds.
Memory: one subprocess per configuration: resident memory after loading, patching and wrapping, then the peak over a
warm-up and a measured step (the kernel's ``VmHWM``, restarted after loading); the difference is what the step adds
(activations, gradients, optimizer state), not the model. (Before this was measured with ``ru_maxrss``, which a
child inherits from its parent: a child whose own peak stayed below the parent's reported the parent's.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    """This process's peak resident memory since ``_reset_peak`` (the kernel's ``VmHWM``; not ``ru_maxrss``, which a
    child started by ``subprocess`` inherits from its parent: every child would report the parent's peak)."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:")) / 1024


def _reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident memory (Linux's ``clear_refs``), so that what loading the model
    used at its peak is not counted."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _batch(window: int, target: int, seed: int = 0) -> dict[str, torch.Tensor]:
    from rope_ext.train.data import Collator

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 30000, (window,), generator=generator)
    return Collator(target, pose=True, seed=seed)([{"input_ids": ids, "index": 0}])


def _setup(model, spec: str, s2: bool, checkpointing: bool = False):
    import rope_ext
    from rope_ext.runs.specs import parse_method_spec
    from rope_ext.methods import get_method_class
    from rope_ext.train.lora import lora_model

    methods = parse_method_spec(spec)
    if s2:
        methods.append(get_method_class("s2_attn")())
    if methods:
        rope_ext.patch(model, methods)
    if checkpointing:  # (transformers' newer name; the old one warns that it goes in v6)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    wrapped = lora_model(model, 8, 16, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], [])
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-5)
    wrapped.train()
    return wrapped, optimizer, bool(methods)


def _teardown(model, wrapped, patched: bool) -> None:
    import rope_ext

    wrapped.unload()
    if model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
    if patched:
        rope_ext.unpatch(model)
    model.eval()


def _step(wrapped, optimizer, batch) -> float:
    began = time.perf_counter()
    loss = wrapped(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def measure_memory(spec: str, s2: bool, window: int, target: int, checkpointing: bool) -> dict[str, Any]:
    """(Run in its own process.) Resident memory before the first step and the peak over two steps, with the settings
    that decide it (S2-Attn, gradient checkpointing) in the record."""
    from rope_ext.runs.models import load_default_model

    model, _ = load_default_model()
    wrapped, optimizer, _ = _setup(model, spec, s2, checkpointing)
    batch = _batch(window, target)
    before = _rss_mb()
    _reset_peak()
    seconds = [_step(wrapped, optimizer, batch) for _ in range(2)]
    return {"rss_before_mb": before, "peak_mb": _peak_mb(), "added_mb": _peak_mb() - before, "seconds": seconds,
            "s2_attn": s2, "gradient_checkpointing": checkpointing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", default="2k")
    parser.add_argument("--target", default="32k", help="PoSE positions below this")
    parser.add_argument("--methods", default="none,yarn:factor=4", help="configurations at --window; the first is the baseline")
    parser.add_argument("--s2-window", default="8k", help="S2-Attn against full attention at this window (0: skip)")
    parser.add_argument("--s2-method", default="yarn:factor=4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--s2-rounds", type=int, default=2)
    parser.add_argument(
        "--s2-checkpointing", action="store_true",
        help="gradient checkpointing in the S2 comparison (both configurations): rope_ext's attention kernels keep "
        "every block's scores for the backward, which does not fit in memory at 8k over 30 layers without it",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from rope_ext.eval.perplexity import parse_length

    if args.memory_child:
        spec, s2, window, target, checkpointing = args.memory_child
        print(json.dumps(measure_memory(spec, s2 == "1", int(window), int(target), checkpointing == "1")))
        return 0
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        print(f"{out} exists; give --overwrite to replace it", file=sys.stderr)
        return 2
    window, target = parse_length(args.window), parse_length(args.target)
    s2_window = 0 if args.s2_window == "0" else parse_length(args.s2_window)
    groups = [("window", window, [(spec, False) for spec in args.methods.split(",")], args.rounds, False)]
    if s2_window:
        groups.append(("s2", s2_window, [(args.s2_method, False), (args.s2_method, True)], args.s2_rounds,
                       args.s2_checkpointing))

    from rope_ext.runs.models import load_default_model

    model, _ = load_default_model()
    result: dict = {"device": "cpu", "threads": args.threads, "torch": torch.__version__, "target": target, "groups": []}
    for name, length, configs, rounds, checkpointing in groups:
        batch = _batch(length, target)
        times: dict[str, list[float]] = {f"{spec}{'+s2_attn' if s2 else ''}": [] for spec, s2 in configs}
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for spec, s2 in order:
                wrapped, optimizer, patched = _setup(model, spec, s2, checkpointing)
                _step(wrapped, optimizer, _batch(256, target))  # (warm-up on a short batch)
                seconds = _step(wrapped, optimizer, batch)
                _teardown(model, wrapped, patched)
                times[f"{spec}{'+s2_attn' if s2 else ''}"].append(seconds)
                print(f"{name} {length} round {r}: {spec}{' +s2' if s2 else ''} {seconds:.2f} s", flush=True)
        labels = list(times)
        base = times[labels[0]]
        rows = []
        for label in labels:
            ratios = [t / b for t, b in zip(times[label], base)]
            rows.append({"config": label, "seconds": times[label], "median_seconds": statistics.median(times[label]),
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
        memory = {}
        for spec, s2 in configs:
            label = f"{spec}{'+s2_attn' if s2 else ''}"
            child = subprocess.run(
                [sys.executable, __file__, "--out", str(out), "--threads", str(args.threads), "--memory-child", spec,
                 "1" if s2 else "0", str(length), str(target), "1" if checkpointing else "0"], capture_output=True,
                text=True, check=True,
            )
            memory[label] = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"{name} {length} memory: {label} adds {memory[label]['added_mb']:.0f} MB", flush=True)
        for row in rows:
            row["memory"] = memory[row["config"]]
            row["memory_ratio"] = memory[row["config"]]["added_mb"] / memory[labels[0]]["added_mb"]
        result["groups"].append({"name": name, "window": length, "baseline": labels[0], "rows": rows,
                                 "gradient_checkpointing": checkpointing, "rounds": rounds})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for group in result["groups"]:
        print(f"\n{group['name']} at {group['window']} tokens (baseline {group['baseline']})")
        for row in group["rows"]:
            print(f"  {row['config']:28s} {row['median_seconds']:7.2f} s  time x{row['ratio_median']:.3f} "
                  f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f})  memory x{row['memory_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
