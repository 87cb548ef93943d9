"""``rope-ext finetune``, ``rope-ext train`` and ``rope-ext merge``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rope_ext.cli.options import config_flags
from rope_ext.runs.models import merge
from rope_ext.serving.saved import plain_transformers_gap
from rope_ext.train.config import FinetuneConfig, TrainConfig
from rope_ext.train.finetune import finetune
from rope_ext.train.pretrain import train


def run_command(args: argparse.Namespace, cls: type, command: Callable) -> tuple[Any, dict]:
    """The run configuration of ``cls`` from ``--config`` and the flags, run by ``command``; its record printed."""
    config = cls.from_sources(args.config, config_flags(args, cls))
    record = command(config, overwrite=args.overwrite).record
    if record:
        print_run(record)
    return config, record


def cmd_finetune(args: argparse.Namespace) -> int:
    config, record = run_command(args, FinetuneConfig, finetune)
    if record:
        if not config.full:
            print(f"output: {config.out}/ (rope-ext merge {config.out} OUT: a standalone model)")
        else:
            print(f"output: {config.out}/ (a standalone model: rope_ext.from_pretrained({str(config.out)!r}))")
    return 0


def print_run(record: dict) -> None:
    steps = f"{record['steps']} step{'' if record['steps'] == 1 else 's'}"
    print(f"\n{steps} in {record['train_seconds']:.0f} s; final loss {record['final_loss']:.4f}")
    for row in record["evals"]:
        print(f"step {row['step']}: perplexity {row['perplexity']:.3f} ({row['document']}, last {row['target_tokens']} "
              f"of {row['length']} tokens)")


def cmd_train(args: argparse.Namespace) -> int:
    config, record = run_command(args, TrainConfig, train)
    if record:
        if record.get("patch"):
            evaluate = f"--methods saved,...: 'saved' (the default there) evaluates it as trained under {config.methods}"
        else:
            evaluate = "--methods none,...: 'none' evaluates it as trained (its architecture's own positions)"
        print(f"output: {config.out}/ (rope_ext.from_pretrained({str(config.out)!r}); rope-ext eval ppl --model "
              f"{config.out} {evaluate})")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    if args.target:  # (merged and exported in one go: the export of the fine-tune folder)
        from rope_ext.cli.serving import print_export
        from rope_ext.serving.export import export

        print_export(export(args.folder, args.out, args.target, overwrite=args.overwrite), args.out)
        return 0
    path = merge(args.folder, args.out, overwrite=args.overwrite)
    print(f"merged model written to {path}/ (load it with rope_ext.from_pretrained)")
    gap = plain_transformers_gap(path)
    if gap:
        print(f"note: plain transformers loads it unextended ({gap}); rope_ext.from_pretrained loads it patched, and "
              f"`rope-ext export {args.folder} OUT --target ...` writes what an engine serves")
    return 0

