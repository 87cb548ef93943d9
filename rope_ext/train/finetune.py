"""``rope-ext finetune``: a patched model fine-tuned for a longer context (LoRA through peft, or in full), with PoSE
position skipping and LongLoRA's shifted sparse attention as options; and ``rope-ext merge``.

The output folder (``FinetuneConfig.out``):

* ``adapter_config.json``, ``adapter_model.safetensors`` -- the peft adapter (``--full``: ``model.safetensors``);
* ``config.json`` -- the base model's config as patched: the ``rope_ext`` block (and transformers' native
  ``rope_parameters`` where the method has an equivalent), S2-Attn left out (it is for training only);
* ``finetune.json`` (what ran: base model, methods, steps, times, parameter counts, versions) and
  ``finetune_config.json`` (the run's options: a re-run in the folder resumes only with the same ones);
* ``loss.json``, ``loss.csv``, ``loss.png``; the tokenizer; ``checkpoints/`` while the run is unfinished.

It loads with ``PeftModel.from_pretrained(rope_ext.from_pretrained(out), out)``: ``rope_ext.from_pretrained`` builds
the base named in ``finetune.json`` and patches it as trained.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rope_ext.train.config import FinetuneConfig

RUN_FILE = "finetune.json"
CONFIG_FILE = "finetune_config.json"
#: what a run read beside its options (``input_fingerprints``), checked when it resumes
INPUTS_FILE = "inputs.json"
#: options a resumed run may change (the rest must equal the folder's): how often it logs, saves and evaluates, and
#: how long it runs (with a schedule that does not depend on the length)
MAY_CHANGE = ("eval_every", "log_every", "save_every", "keep_checkpoints", "threads", "out", "max_steps")
_OUTPUTS = ("adapter_config.json", "adapter_model.safetensors", "model.safetensors", "config.json", RUN_FILE,
            CONFIG_FILE, INPUTS_FILE, "loss.json", "loss.csv", "loss.png", "generation_config.json", "README.md")


def is_finetune_folder(path: str | os.PathLike) -> bool:
    """A folder ``rope-ext finetune`` wrote with a LoRA adapter (its base lives elsewhere)."""
    path = Path(path)
    return (path / RUN_FILE).is_file() and (path / "adapter_config.json").is_file()


def _resolved_options(config: Any) -> dict[str, Any]:
    """The options as saved and compared: local paths resolved (``../doc.txt`` and its absolute path are one input)."""
    from rope_ext.cli import _resolved

    options = config.options()
    for key in ("model", "dataset", "text_files"):
        if key in options:
            options[key] = _resolved(options[key])
    return options


def _methods(config: FinetuneConfig) -> list:
    from rope_ext.train.config import one_spec

    return one_spec(config.methods)


def _training_patch(config: FinetuneConfig) -> list:
    methods = _methods(config)
    if config.s2_attn:
        from rope_ext.methods import get_method_class

        methods.append(get_method_class("s2_attn")(group_size_ratio=config.s2_group_ratio))
    return methods


def check_folder(
    config: Any, overwrite: bool, config_file: str = CONFIG_FILE, command: str = "rope-ext finetune"
) -> dict[str, Any] | None:
    """The folder's saved options when this run resumes it (``None``: a new run); refuses a folder of another
    configuration or of other files, unless ``overwrite``."""
    from rope_ext.cli import _folder

    _folder(config.out)
    out = Path(config.out)
    model = getattr(config, "model", None)
    if model and model != "default" and os.path.isdir(model):  # (--overwrite there would delete the base's files)
        if _within(out, model) or _within(model, out):
            raise ValueError(f"--out {config.out}: the --model folder {model} is there (or the one is inside the "
                             "other); write the run to another folder")
    if not out.exists() or not any(out.iterdir()):
        return None
    saved_path = out / config_file
    if overwrite:
        return None
    if not saved_path.is_file():
        raise ValueError(
            f"--out {config.out}: the folder holds other files (not a {command} run); give an empty or new "
            "folder, or --overwrite"
        )
    try:
        saved = json.loads(saved_path.read_text())
    except ValueError:
        raise ValueError(f"--out {config.out}: {config_file} is unreadable; give --overwrite to start again") from None
    current = _resolved_options(config)
    differ = [k for k in sorted(set(saved) | set(current))
              if k not in MAY_CHANGE and _comparable(k, saved.get(k)) != _comparable(k, current.get(k))]
    if "max_steps" not in differ and saved.get("max_steps") != current["max_steps"] and config.schedule in ("linear", "cosine"):
        differ.append("max_steps")  # (the schedule's length: a resumed run would follow another curve)
    if differ:
        shown = "; ".join(f"{k}: {saved.get(k)!r} there, {current.get(k)!r} now" for k in differ[:4])
        raise ValueError(
            f"--out {config.out} holds a run of another configuration ({shown}); re-run with its options to resume, "
            "or give another --out, or --overwrite"
        )
    return saved


def _within(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether ``path`` is ``folder`` or inside it (links resolved)."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or folder in path.parents


def _comparable(key: str, value: Any) -> Any:
    """An option as a resume compares it: the methods as their configs, so equal spellings are one
    (``yarn:factor=4.0`` and ``yarn:factor=4``)."""
    from rope_ext.train.config import one_spec

    if key == "methods" and isinstance(value, str):
        try:
            return [c.to_dict() for c in one_spec(value)]
        except (ValueError, TypeError):
            return value
    return value


def _clear(out: Path, outputs: tuple[str, ...] = _OUTPUTS) -> None:
    from rope_ext.train.loop import remove_checkpoints

    remove_checkpoints(out)
    for name in outputs:
        (out / name).unlink(missing_ok=True)


def prepare(config: FinetuneConfig) -> dict[str, Any]:
    """Every check and everything loaded, before anything is written: the model patched and wrapped, the data."""
    from rope_ext.core import get_patch, patch, unpatch
    from rope_ext.eval.data import load_documents
    from rope_ext.installers.absolute import position_limit
    from rope_ext.models import MissingTokenizer, load_model
    from rope_ext.train.data import Collator, WindowDataset, run_text
    from rope_ext.train.lora import count_parameters, default_targets, lora_model
    from rope_ext.train.loop import begin_run

    begin_run(config)
    data = load_documents(config.dataset, config.text_files, config.split, config.text_column)  # (before the model)
    try:
        model, tokenizer = load_model(config.model, dtype=torch.float32)
    except MissingTokenizer as error:
        raise ValueError(f"--model {error}") from None
    except (OSError, ValueError) as error:
        if config.model == "default":
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--model {config.model!r}: cannot load it ({reason}); give 'default', a folder or a hub id") from None
    from rope_ext.eval.objectives import model_protocols

    try:
        causal = "fixed" in model_protocols(model)
    except ValueError:
        causal = False
    if not causal:
        raise ValueError(
            f"--model {config.model!r} is a {type(model).__name__}, not a causal language model: rope-ext finetune "
            "trains next-token prediction (with PoSE's positions); T5 and DeBERTa train with their own objectives "
            "under rope-ext train --architecture t5 / deberta"
        )
    saved = get_patch(model)
    if saved is not None:
        print(f"{config.model}: saved with rope_ext patch {saved!r}; training from the unpatched model "
              f"under --methods {config.methods}")
        unpatch(model)
    native = getattr(model.config, "max_position_embeddings", None)
    use_cache = getattr(model.config, "use_cache", None)
    text, windows = run_text(config, tokenizer, data)
    targets = None if config.full else (config.lora_targets or default_targets(model))  # (read on the unpatched model)
    training_patch = _training_patch(config)
    if training_patch:
        try:
            patch(model, training_patch)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValueError(f"--methods {config.methods}{' with --s2-attn' if config.s2_attn else ''}: {error}") from None
    limit = position_limit(model)  # (a learned table's rows, or what the patch reads of them)
    if limit is not None and config.target > limit:
        reach = "--target-length" if config.target_length is not None else "--window"
        raise ValueError(
            f"{reach} {config.target}: {type(model).__name__}'s position table holds {limit} positions"
            f"{' under --methods ' + config.methods if config.methods != 'none' else ''}; give a length up to {limit}, "
            "or a method that reads the table further (abs_interp, abs_hierarchical, sinusoidal) or replaces it (alibi)"
        )
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # (training only: _save_outputs writes the model's own value back)
    if config.full:
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        model = lora_model(model, config.lora_r, config.lora_alpha, config.lora_dropout, targets, config.trainable)
    return {
        "model": model,
        "tokenizer": tokenizer,
        "native": native,
        "use_cache": use_cache,
        "text": text,
        "dataset": WindowDataset(windows),
        "collate": Collator(config.target, config.pose, config.seed),
        "parameters": count_parameters(model),
    }


def fixed_target_evaluation(
    document: Any, length: int, target_tokens: int, protocol: str = "fixed", tokenizer: Any = None
):
    """``evaluate(model)``: perplexity of the last ``target_tokens`` of ``document``'s first ``length`` tokens (the
    fixed-target protocol of ``rope_ext.eval``; for ``masked-lm`` and ``span-corruption``, of the tokens masked or
    corrupted there, with ``tokenizer``)."""
    import math
    import time

    from rope_ext.eval.perplexity import fixed_target_nll

    ids = document.input_ids[:, :length]
    fingerprint = None if protocol == "fixed" else document.fingerprint()

    def evaluate(model: nn.Module) -> dict[str, Any]:
        began = time.perf_counter()
        nll = fixed_target_nll(model, protocol, ids, target_tokens, tokenizer, fingerprint)
        mean = float(nll.double().mean())
        return {"document": document.title, "length": length, "target_tokens": target_tokens, "mean_nll": mean,
                "perplexity": math.exp(mean), "seconds": time.perf_counter() - began}

    return evaluate


@dataclass
class FinetuneRun:
    """A finished run: its record (``finetune.json``; empty on processes other than the main one) and the trained
    model (the peft model, or the model itself for ``--full``), in eval mode; ``None`` when the folder's run was
    complete already (nothing trained)."""

    record: dict[str, Any]
    model: nn.Module | None


def finetune(config: FinetuneConfig, *, overwrite: bool = False, on_step=None) -> FinetuneRun:
    """Run (or resume) a fine-tune into ``config.out``."""
    config.check()
    resumed = check_folder(config, overwrite)
    done = _complete_run(config, resumed, RUN_FILE)
    if done is not None:
        return FinetuneRun(done, None)
    parts = prepare(config)
    say = f"training {parts['parameters']['trainable']:,} of {parts['parameters']['total']:,} parameters on " \
          f"{len(parts['dataset'])} windows of {config.window} tokens ({len(parts['text'].train)} documents)" \
          + (f", PoSE positions below {config.target}" if config.pose else "")

    def save(model: nn.Module, state: dict, progress: Any, processes: int) -> dict[str, Any]:
        return _save_outputs(config, parts, model, state, progress, processes)

    record, model = train_into_folder(config, parts, resumed, overwrite, _OUTPUTS, CONFIG_FILE, RUN_FILE, say, save,
                                      on_step)
    return FinetuneRun(record, model)


def input_fingerprints(parts: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of what a run reads beside its options: the training windows' token ids and, where some weights stay
    frozen (LoRA), those weights as loaded. The same paths holding other text or another model give others."""
    import hashlib

    from rope_ext.installers.params import PARAMS_ATTR

    windows = parts["dataset"].windows.contiguous()
    found = {"windows_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest()}
    frozen = [(name, p) for name, p in parts["model"].named_parameters()  # (a patch's own: initialised, not read)
              if not p.requires_grad and f"{PARAMS_ATTR}." not in name]
    if frozen:
        digest = hashlib.sha256()
        for name, p in frozen:
            digest.update(name.encode())
            digest.update(p.detach().float().contiguous().cpu().numpy().tobytes())
        found["frozen_weights_sha256"] = digest.hexdigest()
    return found


def check_inputs(out: Path, inputs: dict[str, str]) -> None:
    """Refuse to resume a run whose data or base model changed under the same paths (a folder written before the
    fingerprints were recorded resumes unchecked)."""
    try:
        saved = json.loads((out / INPUTS_FILE).read_text())
    except (OSError, ValueError):
        return
    changed = [k.removesuffix("_sha256").replace("_", " ") for k in inputs if saved.get(k) not in (None, inputs[k])]
    if changed:
        raise ValueError(
            f"--out {out}: its run was trained on other {' and '.join(changed)} under the same options (a file or the "
            "model changed since); restore them to resume, or give another --out, or --overwrite"
        )


def train_into_folder(
    config: Any,
    parts: dict[str, Any],
    resumed: dict[str, Any] | None,
    overwrite: bool,
    outputs: tuple[str, ...],
    config_file: str,
    run_file: str,
    announce: str,
    save: Callable[[nn.Module, dict, Any, int], dict[str, Any]],
    on_step=None,
) -> tuple[dict[str, Any], nn.Module]:
    """What every training command does once its model and data are ready (``parts``): the folder made (cleared
    with ``overwrite``, its options written on a new run), the held-out evaluation, ``run_training``, then on the
    main process ``save(model, state_dict, progress, processes) -> record`` and the record (with mixed precision and
    step times) written as ``run_file``, and the loss plot. Returns the record (empty on other processes) and the
    trained model."""
    from rope_ext.eval.plot import plot_training
    from rope_ext.train.loop import run_training, step_time_summary

    out = Path(config.out)
    if overwrite and out.exists():
        _clear(out, outputs)
    inputs = input_fingerprints(parts)
    if resumed is not None:
        check_inputs(out, inputs)
    out.mkdir(parents=True, exist_ok=True)
    if resumed is None:
        (out / config_file).write_text(json.dumps(_resolved_options(config), indent=1) + "\n")
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


def _finished(out: Path, run_file: str = RUN_FILE) -> dict[str, Any] | None:
    try:
        return json.loads((out / run_file).read_text())
    except (OSError, ValueError):
        return None


def _complete_run(config: Any, resumed: dict[str, Any] | None, run_file: str) -> dict[str, Any] | None:
    """The record of the folder's run when it is complete at ``config.max_steps`` (nothing to do); raises when a
    finished run cannot be continued to ``max_steps``."""
    from rope_ext.train.loop import latest_checkpoint

    if resumed is None:
        return None
    done = _finished(Path(config.out), run_file)
    if done is not None and done.get("steps") == config.max_steps:
        grows = ("a larger --max-steps continues it, " if config.schedule not in ("linear", "cosine")
                 else f"its {config.schedule} schedule is fixed by --max-steps, so it cannot grow; ")
        print(f"{config.out}: this run is complete ({done['steps']} steps); nothing to do ({grows}--overwrite starts "
              "again)")
        return done
    if done is not None and latest_checkpoint(Path(config.out)) is None:
        raise ValueError(
            f"--out {config.out}: the run there finished at step {done.get('steps')} and kept no checkpoint "
            f"(--save-every 0, or checkpoints deleted), so --max-steps {config.max_steps} cannot continue it; "
            "give --overwrite to start again"
        )
    if done is not None and done.get("steps", 0) > config.max_steps:
        raise ValueError(
            f"--max-steps {config.max_steps}: the run in {config.out} is at step {done['steps']} already; give a "
            "larger --max-steps to continue it, or --overwrite"
        )
    return None


def _save_outputs(config, parts, model: nn.Module, state: dict, progress, processes: int) -> dict[str, Any]:
    from rope_ext.core import _anchor, get_patch, patch, unpatch

    out = Path(config.out)
    base = _anchor(model)
    if parts.get("use_cache") is not None:  # (gradient checkpointing turned it off for training)
        base.config.use_cache = parts["use_cache"]
    if config.s2_attn:  # the saved patch is the inference one: S2-Attn trains only
        unpatch(base)
        if _methods(config):
            patch(base, _methods(config))
    if config.full:
        base.save_pretrained(out, state_dict=state)
    else:
        name = _resolved_options(config)["model"]
        if name != "default" and os.path.isdir(name):  # (absolute: peft writes the path as typed otherwise, which
            for adapter in model.peft_config.values():  # its AutoPeftModel resolves from wherever it runs)
                adapter.base_model_name_or_path = name
        model.save_pretrained(out, state_dict=state)
        base.config.save_pretrained(out)
    parts["tokenizer"].save_pretrained(out)
    patch_in_use = get_patch(base, resolved=True)
    configs = patch_in_use if isinstance(patch_in_use, tuple) else [patch_in_use] if patch_in_use else []
    return {
        "base_model": _resolved_options(config)["model"],
        "methods": config.methods,
        "patch": [c.to_dict() for c in configs],
        "s2_attn": config.s2_attn,
        "pose": config.pose,
        "target_length": config.target,
        "window": config.window,
        "native_context": parts["native"],
        "full": config.full,
        **run_record(config, parts, progress, processes),
    }


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
        "tokens_per_step": config.micro_batch * config.accumulation * config.window * processes,
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


# --- loading and merging ---------------------------------------------------------------------------------


def load_finetune_base(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """The base model a fine-tune folder names, patched as it was trained (what its adapter applies to)."""
    from transformers import AutoConfig

    from rope_ext.core import get_patch, patch, saved_patch, unpatch
    from rope_ext.methods import MethodConfig
    from rope_ext.models import load_model

    path = Path(path)
    try:
        record = json.loads((path / RUN_FILE).read_text())
    except ValueError as error:
        raise ValueError(f"{path / RUN_FILE} is not valid JSON ({error}); re-run the fine-tune to write it") from None
    name = record.get("base_model") if isinstance(record, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path / RUN_FILE} names no base_model (the model the adapter was trained on)")
    if name != "default" and os.path.isabs(name) and not os.path.isdir(name):
        raise ValueError(f"{path}: its base model {name} ({RUN_FILE}'s base_model) is not found; the adapter needs it")
    base, _ = load_model(name, dtype=dtype or torch.float32)
    if get_patch(base) is not None:
        unpatch(base)
    found = saved_patch(AutoConfig.from_pretrained(path))
    if found is not None:
        methods, options, _, _ = found
        patch(base, [MethodConfig.from_dict(m) for m in methods], **options)
    return base


def load_finetuned(path: str | os.PathLike, dtype: torch.dtype | None = None, merge: bool = True) -> nn.Module:
    """A fine-tune folder's model: its patched base with the adapter (merged into the weights by default)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_finetune_base(path, dtype), str(path))
    return model.merge_and_unload() if merge else model


def merge(folder: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """``rope-ext merge``: the adapter merged into the base, saved as a standalone patched model (native
    ``rope_parameters`` where the method has an equivalent, the ``rope_ext`` block always)."""
    from transformers import AutoTokenizer

    from rope_ext.cli import _folder

    folder, out = Path(folder), Path(out)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder; give the --out folder of rope-ext finetune")
    if not is_finetune_folder(folder):
        full = (folder / RUN_FILE).is_file()
        raise ValueError(
            f"{folder} is not a LoRA fine-tune folder: "
            + ("a --full fine-tune is a standalone model already (load it with rope_ext.from_pretrained)" if full else
               f"it lacks {RUN_FILE} and adapter_config.json; give the --out folder of rope-ext finetune")
        )
    if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ValueError(f"{folder} has no adapter weights (adapter_model.safetensors); re-run the fine-tune to write them")
    _folder(str(out))
    if _within(out, folder):
        raise ValueError(f"{out} is the fine-tune folder or inside it; write the merged model to another folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; give a new folder or --overwrite")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)  # (before anything is written)
    except (OSError, ValueError) as error:
        raise ValueError(f"{folder}: its tokenizer does not load ({str(error).strip().splitlines()[0]}); the fine-tune "
                         "saves it beside the adapter") from None
    model = load_finetuned(folder)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
