"""``rope-ext train``: a small causal model built from a config and trained from scratch under a position method,
on the fine-tuning loop (``rope_ext.train.loop.run_training``; ``accelerate launch`` runs it on many processes).

What the position-encoding papers do to compare encodings -- train short, test long -- needs models trained with
each encoding: GPT-2 with its learned table (``--sequence-length`` rows) or with a bias (``--methods alibi``, ``kerple``,
``sandwich``, ``fire``: the table then adds nothing), a Llama with RoPE or with ``xpos``. The model is patched
*before* training, so a learnable bias trains with it, and saved patched: ``rope_ext.from_pretrained(out)`` gives it
back as trained, and ``rope-ext eval ppl --model out --methods saved,...`` evaluates it (``saved``: as trained).

The output folder (``TrainConfig.out``): ``config.json`` and ``model.safetensors`` (with the ``rope_ext`` block and
the patch's own parameters), the tokenizer (``--tokenizer``; the default model's by default), ``train.json`` (what
ran), ``train_config.json``
(the options: a re-run resumes only with the same ones), ``loss.json``/``loss.csv``/``loss.png``, a model card
(``README.md``) and ``checkpoints/`` while unfinished.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rope_ext.core import get_patch, patch
from rope_ext.eval.data import load_documents
from rope_ext.eval.objectives import with_objective_tokens
from rope_ext.runs.folder import TRAIN_CONFIG_FILE, TRAIN_RUN_FILE, check_folder, complete_run, resolved
from rope_ext.runs.models import load_tokenizer
from rope_ext.runs.values import named_as_in_file
from rope_ext.train.config import TrainConfig, methods_of
from rope_ext.train.data import Collator, ObjectiveCollator, WindowDataset, run_text
from rope_ext.train.loop import begin_run
from rope_ext.train.lora import count_parameters
from rope_ext.train.run import run_record, train_into_folder

RUN_FILE = TRAIN_RUN_FILE
CONFIG_FILE = TRAIN_CONFIG_FILE


def build_model(config: TrainConfig, tokenizer: Any) -> nn.Module:
    """The untrained model ``config`` describes (seeded), with ``tokenizer``'s vocabulary and special tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}
    torch.manual_seed(config.seed)
    if config.architecture == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        # T5's own bucketing (32 buckets, max_distance 128) and its v1.0 shape (ReLU, tied embeddings)
        model_config = T5Config(
            vocab_size=len(tokenizer), d_model=config.hidden, d_kv=config.hidden // config.heads, d_ff=config.mlp_size,
            num_layers=config.layers, num_decoder_layers=config.layers, num_heads=config.heads,
            dropout_rate=config.dropout, decoder_start_token_id=special["pad_token_id"], tie_word_embeddings=True,
            attn_implementation="sdpa", **special,
        )
        return T5ForConditionalGeneration(model_config)
    if config.architecture == "deberta":
        from transformers import DebertaV2Config, DebertaV2ForMaskedLM

        # DeBERTa-v3's shape scaled to the sequence length: no absolute table, log buckets (v3: 256 over 512 positions)
        model_config = DebertaV2Config(
            vocab_size=len(tokenizer), hidden_size=config.hidden, num_hidden_layers=config.layers,
            num_attention_heads=config.heads, intermediate_size=config.mlp_size, max_position_embeddings=config.sequence_length,
            relative_attention=True, position_buckets=config.sequence_length // 2,
            max_relative_positions=config.sequence_length,
            pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True,
            hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout, legacy=False, **special,
        )
        return DebertaV2ForMaskedLM(model_config)
    if config.architecture == "gpt2":
        model_config = GPT2Config(
            vocab_size=len(tokenizer), n_positions=config.sequence_length, n_embd=config.hidden, n_layer=config.layers,
            n_head=config.heads, n_inner=config.mlp_size, resid_pdrop=config.dropout, embd_pdrop=config.dropout,
            attn_pdrop=config.dropout, tie_word_embeddings=True, attn_implementation="sdpa", **special,
        )
        model = GPT2LMHeadModel(model_config)
        model.loss_type = "ForCausalLM"  # (transformers' fallback for a class name no loss matches, without its warning)
        return model
    model_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden, intermediate_size=config.mlp_size,
        num_hidden_layers=config.layers, num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads or config.heads, max_position_embeddings=config.sequence_length,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, attention_dropout=config.dropout,
        tie_word_embeddings=True, attn_implementation="sdpa", **special,
    )
    return LlamaForCausalLM(model_config)


def prepare(config: TrainConfig) -> dict[str, Any]:
    """Every check and everything loaded, before anything is written: the data, the model built and patched."""

    begin_run(config)
    data = load_documents(config.dataset, config.text_files, config.split, config.text_column)
    try:
        tokenizer = load_tokenizer(config.tokenizer)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--tokenizer {config.tokenizer!r}: cannot load it ({reason}); give 'default', a folder "
                         "holding a tokenizer, or a hub id (downloading needs HF_HUB_OFFLINE unset)") from None
    objective = config.objective
    if objective == "span-corruption" and tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer {config.tokenizer!r} has no end-of-sequence token, which T5's span corruption "
                         "ends its inputs and targets with; give a tokenizer with an eos_token")
    text, windows = run_text(config, tokenizer, data)
    if objective != "fixed":  # (added after the text is cut: the corpus holds none of the new tokens)
        with_objective_tokens(tokenizer, objective)
    model = build_model(config, tokenizer)
    methods = methods_of(config)
    if methods:
        try:
            patch(model, methods)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValueError(f"--methods {config.methods} on --architecture {config.architecture}: {error}") from None
    model.train()
    return {
        "model": model,
        "tokenizer": tokenizer,
        "text": text,
        "dataset": WindowDataset(windows),
        "collate": Collator(config.sequence_length) if objective == "fixed" else ObjectiveCollator(objective, tokenizer,
                                                                                            seed=config.seed),
        "protocol": objective,
        "parameters": count_parameters(model),
    }


@dataclass
class TrainRun:
    """A finished run: its record (``train.json``; empty on processes other than the main one) and the trained model
    (``None`` when the folder's run was complete already)."""

    record: dict[str, Any]
    model: nn.Module | None


def train(config: TrainConfig, *, overwrite: bool = False, on_step=None) -> TrainRun:
    """Train (or resume) a model from scratch into ``config.out``."""

    with named_as_in_file(*config.sources):  # (an option of the YAML file named as its key, as in from_sources)
        config.check()
        resumed = check_folder(config, overwrite, CONFIG_FILE, "rope-ext train")
        done = complete_run(config, resumed, RUN_FILE)
        if done is not None:
            return TrainRun(done, None)
        parts = prepare(config)
    say = (f"training a {config.architecture} of {parts['parameters']['total']:,} parameters"
           f"{'' if config.methods == 'none' else ' under ' + config.methods} on {len(parts['dataset'])} sequences "
           f"of {config.sequence_length} tokens ({len(parts['text'].train)} documents)")

    def save(model: nn.Module, state: dict, progress: Any, processes: int) -> dict[str, Any]:
        out = Path(config.out)
        model.save_pretrained(out, state_dict=state)
        parts["tokenizer"].save_pretrained(out)
        record = _record(config, parts, progress, processes)
        (out / "README.md").write_text(model_card(record))
        return record

    record, model = train_into_folder(config, parts, resumed, overwrite, CONFIG_FILE, RUN_FILE, say, save,
                                      on_step)
    return TrainRun(record, model.eval())


def _record(config: TrainConfig, parts: dict[str, Any], progress: Any, processes: int) -> dict[str, Any]:

    patch_in_use = get_patch(parts["model"], resolved=True) if config.methods != "none" else None
    configs = patch_in_use if isinstance(patch_in_use, tuple) else [patch_in_use] if patch_in_use else []
    return {
        "architecture": config.architecture,
        "methods": config.methods,
        "tokenizer": resolved(config.tokenizer),
        "vocab_size": len(parts["tokenizer"]),
        "patch": [c.to_dict() for c in configs],
        "sequence_length": config.sequence_length,
        "layers": config.layers,
        "heads": config.heads,
        "hidden": config.hidden,
        "intermediate": config.mlp_size,
        **run_record(config, parts, progress, processes),
    }


def model_card(record: dict[str, Any]) -> str:
    """The folder's ``README.md``: what the model is, how it was trained, how to load and evaluate it."""
    methods = record["methods"]
    evals = record["evals"]
    last = (f"Held-out perplexity at the sequence length ({evals[-1]['document']}, last {evals[-1]['target_tokens']} of "
            f"{evals[-1]['length']} tokens): {evals[-1]['perplexity']:.2f}.\n" if evals else "")
    return (
        f"# A small {record['architecture']} trained by `rope-ext train`"
        f"{'' if methods == 'none' else ' under `' + methods + '`'}\n\n"
        f"- {record['parameters']['total']:,} parameters: {record['layers']} layers, {record['heads']} heads, hidden "
        f"{record['hidden']}, MLP {record['intermediate']}; {tokenizer_words(record)}.\n"
        f"- Trained from scratch at {record['sequence_length']} tokens for {record['steps']} steps "
        f"({record['tokens_per_step']:,} tokens per step, {record['train_seconds']:.0f} s on "
        f"{record['processes']} process(es)), seed {record['seed']}; final training loss {record['final_loss']:.4f}.\n"
        f"- Data: {len(record['documents'])} documents; left out: {', '.join(record['excluded']) or 'none'}.\n"
        f"- Position encoding: "
        + ("the architecture's own" if methods == "none" else f"`{methods}` (saved in `config.json`'s `rope_ext` block; "
           "its parameters, if any, under `rope_ext.` in the weights)")
        + ".\n\n" + last
        + "\nLoad it with `rope_ext.from_pretrained(folder)`; evaluate it past its sequence length with "
        + ("`rope-ext eval ppl --model folder --methods saved,...` (`saved`, the default there: as trained; `none`: the "
           "architecture's own positions; other methods: applied to the unpatched model).\n" if record["patch"] else
           "`rope-ext eval ppl --model folder --methods none,...` (`none`: as trained, the architecture's own "
           "positions; other methods: applied to it).\n")
    )


def tokenizer_words(record: dict[str, Any]) -> str:
    """The card's words for the run's tokenizer (a record without one: the default model's)."""
    name = record.get("tokenizer", "default")
    size = f", {record['vocab_size']:,} tokens" if "vocab_size" in record else ""
    return f"the default model's tokenizer (SmolLM2{size})" if name == "default" else f"the tokenizer of `{name}`{size}"
