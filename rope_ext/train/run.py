"""What every training command shares (``rope-ext finetune``, ``rope-ext train``): the held-out evaluation, the run
into its folder (made, cleared with ``overwrite``, options and input fingerprints written, trained, saved), and the
record of what ran."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rope_ext.eval.perplexity import fixed_target_nll
from rope_ext.eval.plot import plot_training
from rope_ext.runs.folder import INPUTS_FILE, check_inputs, clear_outputs, input_fingerprints, resolved_options
from rope_ext.train.loop import run_training, step_time_summary


def fixed_target_evaluation(
    document: Any, length: int, target_tokens: int, protocol: str = "fixed", tokenizer: Any = None
):
    """``evaluate(model)``: perplexity of the last ``target_tokens`` of ``document``'s first ``length`` tokens (the
    fixed-target protocol of ``rope_ext.eval``; for ``masked-lm`` and ``span-corruption``, of the tokens masked or
    corrupted there, with ``tokenizer``)."""
    import math
    import time

    ids = document.input_ids[:, :length]
    fingerprint = None if protocol == "fixed" else document.fingerprint()

    def evaluate(model: nn.Module) -> dict[str, Any]:
        began = time.perf_counter()
        nll = fixed_target_nll(model, protocol, ids, target_tokens, tokenizer, fingerprint)
        mean = float(nll.double().mean())
        return {"document": document.title, "length": length, "target_tokens": target_tokens, "mean_nll": mean,
                "perplexity": math.exp(mean), "seconds": time.perf_counter() - began}

    return evaluate


def train_into_folder(
    config: Any,
    parts: dict[str, Any],
    resumed: dict[str, Any] | None,
    overwrite: bool,
    config_file: str,
    run_file: str,
    announce: str,
    save: Callable[[nn.Module, dict, Any, int], dict[str, Any]],
    on_step=None,
) -> tuple[dict[str, Any], nn.Module]:
    """What every training command does once its model and data are ready (``parts``): the folder made (cleared
    with ``overwrite``: every file a rope-ext command writes, ``clear_outputs``; its options written on a new run), the held-out evaluation, ``run_training``, then on the
    main process ``save(model, state_dict, progress, processes) -> record`` and the record (with mixed precision and
    step times) written as ``run_file``, and the loss plot. Returns the record (empty on other processes) and the
    trained model."""
    out = Path(config.out)
    if overwrite and out.exists():
        clear_outputs(out)
    inputs = input_fingerprints(parts)
    if resumed is not None:
        check_inputs(out, inputs)
    out.mkdir(parents=True, exist_ok=True)
    if resumed is None:
        (out / config_file).write_text(json.dumps(resolved_options(config), indent=1) + "\n")
        (out / INPUTS_FILE).write_text(json.dumps(inputs, indent=1) + "\n")
    held_out = parts["text"].held_out
    evaluate = None if held_out is None else fixed_target_evaluation(
        held_out, config.target, config.eval_target_tokens, parts.get("protocol", "fixed"), parts["tokenizer"])
    if int(os.environ.get("RANK", "0")) == 0:  # (once per run)
        print(announce)
    model, progress, accelerator = run_training(
        parts["model"], parts["dataset"], parts["collate"], config, out, evaluate=evaluate, on_step=on_step,
    )
    state = accelerator.get_state_dict(model)
    record: dict[str, Any] = {}
    if accelerator.is_main_process:
        record = save(accelerator.unwrap_model(model), state, progress, accelerator.num_processes)
        record["mixed_precision"] = accelerator.mixed_precision
        record["step_seconds"] = step_time_summary(progress)
        (out / run_file).write_text(json.dumps(record, indent=1) + "\n")
        plot_training(out)
    accelerator.wait_for_everyone()
    return record, accelerator.unwrap_model(model)


def run_record(config: Any, parts: dict[str, Any], progress: Any, processes: int) -> dict[str, Any]:
    """What every training command records of its run: steps, time, data, parameters, evaluations, machine and
    versions."""
    import accelerate
    import peft
    import transformers

    return {
        "steps": progress.step,
        "micro_batches": progress.micro,
        "train_seconds": progress.seconds,
        "windows": len(parts["dataset"]),
        "documents": [d.title for d in parts["text"].train],
        "excluded": parts["text"].excluded,
        "tokens_per_step": config.micro_batch * config.accumulation * config.sequence_length * processes,
        "parameters": parts["parameters"],
        "processes": processes,
        "evals": progress.evals,
        "final_loss": progress.log[-1]["loss"] if progress.log else None,
        "seed": config.seed,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "accelerate": accelerate.__version__},
    }

