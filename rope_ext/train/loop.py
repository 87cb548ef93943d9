"""The training loop every rope_ext training command runs (``rope-ext finetune``; training a model from a config):
accelerate's loop, so the same code runs in one CPU process and under ``accelerate launch`` (DDP, FSDP, DeepSpeed).

* Gradient accumulation, clipping, mixed precision and sharding are accelerate's (``accumulate``, ``backward``,
  ``clip_grad_norm_``, ``prepare``); the learning-rate schedule is transformers' ``get_scheduler``, stretched by the
  number of processes because accelerate steps a prepared scheduler once per process.
* Checkpoints (``save_state`` into ``checkpoints/checkpoint_<optimizer step>``, every ``save_every`` steps and at the
  last; the newest ``keep_checkpoints`` complete ones kept, older ones removed once a new one is complete):
  model, optimizer, scheduler, RNG states, the sampler's epoch and ``Progress`` (steps and micro-batches done, the loss log). Only the
  trainable parameters of the model are written (LoRA adapters, not a copy of the frozen base) outside FSDP and
  DeepSpeed, which save their own way. A run started again in the same folder resumes from the newest checkpoint:
  the data position is counted in micro-batches (``skip_first_batches``), so it ends with the weights an
  uninterrupted run ends with.
* The loss log (``loss.json`` / ``loss.csv``, one row per optimizer step) and evaluations every ``eval_every`` steps
  and at the last (``evaluate(model) -> dict``, run on every process, written by the main one).

``config`` is any object with the attributes of ``FinetuneConfig``'s optimisation and checkpoint fields.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from rope_ext.runs.folder import COMPLETE, drop_incomplete, latest_checkpoint, prune_checkpoints

@dataclass
class Progress:
    """What the loop has done (checkpointed with the run): optimizer steps, micro-batches (per process), the loss
    log and the evaluations."""

    step: int = 0
    micro: int = 0
    #: the number of processes the run trains on (micro-batches are counted per process)
    processes: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def make_optimizer(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters; weight decay on matrices only (not on biases and norms)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameter")
    groups = [
        {"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=config.lr, betas=(0.9, config.adam_beta2))


def run_training(
    model: nn.Module,
    dataset: Dataset,
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    config: Any,
    out: str | Path,
    *,
    evaluate: Callable[[nn.Module], dict[str, Any]] | None = None,
    on_step: Callable[[Progress], None] | None = None,
    accelerator: Any = None,
) -> tuple[nn.Module, Progress, Any]:
    """Train ``model`` (its parameters with ``requires_grad``) on ``dataset`` until ``config.max_steps``, resuming from
    ``out``'s newest checkpoint. Returns the prepared model, the progress and the accelerator."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
    from transformers import get_scheduler

    out = Path(out)
    if accelerator is None:
        accelerator = Accelerator(
            gradient_accumulation_steps=config.accumulation,
            mixed_precision=config.mixed_precision,
            # (no total_limit: the loop removes old checkpoints itself, once the new one is complete)
            project_config=ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        )
    processes = accelerator.num_processes
    _check_deepspeed_clipping(accelerator, config)
    check_mixed_precision(config, accelerator.device.type)
    optimizer = make_optimizer(model, config)
    if config.schedule != "constant" and config.warmup_steps > config.max_steps:
        accelerator.print(
            f"note: the warm-up ({config.warmup_steps} steps) is longer than the run ({config.max_steps} steps): the "
            f"learning rate never reaches --lr"
        )
    scheduler = get_scheduler(
        config.schedule, optimizer, num_warmup_steps=config.warmup_steps * processes,
        num_training_steps=config.max_steps * processes,
    )
    # its own generator: making an iterator (at each epoch, and again after a resume) then draws from it, not from the
    # global RNG that dropout uses, so a resumed run's dropout masks are an uninterrupted run's
    loader = DataLoader(dataset, batch_size=config.micro_batch, shuffle=True, collate_fn=collate, drop_last=True,
                        generator=torch.Generator().manual_seed(config.seed))
    if len(loader) == 0:
        raise ValueError(f"{len(dataset)} window(s) make no micro-batch of {config.micro_batch}; lower --micro-batch")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    trainable = {name for name, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}
    handles = [
        accelerator.register_save_state_pre_hook(_save_trainable_only(trainable)),
        accelerator.register_load_state_pre_hook(_load_trainable_only(accelerator, trainable)),
    ]
    try:
        if accelerator.is_main_process:
            drop_incomplete(out)
        accelerator.wait_for_everyone()
        resumed = latest_checkpoint(out)
        if resumed is not None:
            accelerator.load_state(str(resumed))
            if progress.processes and progress.processes != processes:
                raise ValueError(
                    f"{resumed} was written by a run on {progress.processes} process(es); this one has {processes}, "
                    "and the data position is counted per process: resume with the same number of processes"
                )
            accelerator.print(f"resuming from {resumed} (step {progress.step}, micro-batch {progress.micro})")
        progress.processes = processes
        _loop(model, loader, optimizer, scheduler, collate, config, out, accelerator, progress, evaluate, on_step)
    finally:
        for handle in handles:
            handle.remove()
    return model, progress, accelerator


def begin_run(config: Any) -> None:
    """Before a run loads anything: its thread count, its mixed precision checked, every RNG seeded. (No accelerate
    state may be made before the loop's ``Accelerator``: a ``PartialState`` made here would decide the distributed
    setup without the launcher's ``ACCELERATE_USE_CPU``.)"""
    from accelerate.utils import set_seed

    if config.threads:
        torch.set_num_threads(config.threads)
    check_mixed_precision(config, torch.accelerator.current_accelerator().type if torch.accelerator.is_available()
                          else "cpu")
    set_seed(config.seed)


def check_mixed_precision(config: Any, device_type: str) -> None:
    """fp16 runs on accelerators only: on a CPU accelerate would ignore it silently."""
    if config.mixed_precision == "fp16" and device_type == "cpu":
        raise ValueError("--mixed-precision fp16: accelerate runs fp16 on GPUs only (on this CPU it would be ignored); "
                         "give bf16 or no")


def _check_deepspeed_clipping(accelerator: Any, config: Any) -> None:
    """DeepSpeed clips gradients itself (accelerate's ``clip_grad_norm_`` does nothing there): its configured value
    must be the run's, or the run's flag would be silently ignored."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    clipping = accelerator.state.deepspeed_plugin.deepspeed_config.get("gradient_clipping")
    if (clipping or 0.0) != (config.max_grad_norm or 0.0):
        raise ValueError(
            f"--max-grad-norm {config.max_grad_norm}: DeepSpeed clips gradients itself, with gradient_clipping "
            f"{clipping!r} in its configuration; set the same value in both"
        )


def _loop(model, loader, optimizer, scheduler, collate, config, out, accelerator, progress, evaluate, on_step) -> None:
    per_epoch = len(loader)
    params = [p for p in model.parameters() if p.requires_grad]
    bar = tqdm(total=config.max_steps, initial=progress.step, desc="training", disable=not accelerator.is_main_process,
               dynamic_ncols=True)
    losses: list[torch.Tensor] = []
    tokens = 0
    norm = None
    began = time.perf_counter()
    model.train()
    while progress.step < config.max_steps:
        epoch, skip = divmod(progress.micro, per_epoch)
        loader.set_epoch(epoch)
        if hasattr(collate, "set_epoch"):
            collate.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm:
                    norm = accelerator.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress.micro += 1
            losses.append(loss.detach())
            tokens += batch["input_ids"].numel()
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            mean = accelerator.gather(torch.stack(losses).mean()[None]).mean()
            seconds = time.perf_counter() - began
            progress.seconds += seconds
            row = {
                "step": progress.step,
                "loss": float(mean),
                "lr": scheduler.get_last_lr()[0],
                "micro_batches": len(losses),
                "tokens": tokens * accelerator.num_processes,
                "seconds": seconds,
            }
            if config.max_grad_norm:
                row["grad_norm"] = float(norm) if norm is not None else None
            progress.log.append(row)
            losses, tokens = [], 0
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}")
            if evaluate is not None and config.eval_every and progress.step % config.eval_every == 0:
                progress.evals.append({"step": progress.step, **_evaluate(model, evaluate)})
                bar.write(f"step {progress.step}: {progress.evals[-1]}")
            if config.save_every and (progress.step % config.save_every == 0 or progress.step == config.max_steps):
                accelerator.project_configuration.iteration = progress.step  # (checkpoints/checkpoint_<step>)
                saved = accelerator.save_state()  # (the last step too: a larger --max-steps continues from it)
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    (Path(saved) / COMPLETE).write_text(f"step {progress.step}\n")
                    prune_checkpoints(out, config.keep_checkpoints)
            if accelerator.is_main_process and (progress.step % config.log_every == 0 or progress.step == config.max_steps):
                write_log(out, progress)
            if on_step is not None:
                on_step(progress)
            began = time.perf_counter()
            if progress.step >= config.max_steps:
                break
    bar.close()
    if evaluate is not None and (not progress.evals or progress.evals[-1]["step"] != progress.step):
        progress.evals.append({"step": progress.step, **_evaluate(model, evaluate)})  # (the last step's)
        if accelerator.is_main_process:
            write_log(out, progress)
    model.eval()


@torch.no_grad()
def _evaluate(model: nn.Module, evaluate: Callable[[nn.Module], dict[str, Any]]) -> dict[str, Any]:
    model.eval()
    try:
        return evaluate(model)
    finally:
        model.train()


def _save_trainable_only(trainable: set[str]) -> Callable[..., None]:
    def hook(models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        for i, state in enumerate(weights):  # (empty under FSDP and DeepSpeed: they write their own)
            weights[i] = {k: v for k, v in state.items() if _plain(k) in trainable}

    return hook


def _load_trainable_only(accelerator: Any, trainable: set[str]) -> Callable[..., None]:
    from safetensors.torch import load_file

    def hook(models: list[nn.Module], input_dir: str) -> None:
        path = Path(input_dir) / "model.safetensors"
        if not models or not path.exists():
            return
        model = models.pop(0)
        saved = load_file(str(path))
        missing = sorted(trainable - {_plain(k) for k in saved})
        if missing:
            raise ValueError(f"{input_dir}: the checkpoint lacks trainable parameters ({', '.join(missing[:4])}, ...)")
        accelerator.unwrap_model(model).load_state_dict({_plain(k): v for k, v in saved.items()}, strict=False)

    return hook


def _plain(name: str) -> str:
    """A parameter name without the wrappers' prefixes (DDP's ``module.``)."""
    return name[len("module."):] if name.startswith("module.") else name


def write_log(out: str | Path, progress: Progress) -> None:
    """``loss.json`` / ``loss.csv`` (and the evaluations beside them in ``loss.json``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"steps": progress.step, "train_seconds": progress.seconds, "log": progress.log, "evals": progress.evals}
    (out / "loss.json").write_text(json.dumps(payload, indent=1) + "\n")
    if progress.log:
        columns = list(dict.fromkeys(k for row in progress.log for k in row))
        with open(out / "loss.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(progress.log)


def step_time_summary(progress: Progress) -> dict[str, float]:
    """Median and spread of the seconds per optimizer step (the first step, with its warm-up, left out)."""
    times = [row["seconds"] for row in progress.log[1:]] or [row["seconds"] for row in progress.log]
    if not times:
        return {}
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "count": len(times)}
