"""Training data: documents from ``datasets`` cut into fixed-length windows, and the collator that makes batches
(PoSE position ids drawn per window from the run's seed, so a batch is the same in one process or many)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from rope_ext.eval.data import Document, tokenize_documents
from rope_ext.eval.objectives import (
    OBJECTIVE_PROTOCOLS,
    corrupt_spans,
    mask_collator,
    mask_tokens,
    random_spans,
    sentinel_ids,
    span_starts,
)
from rope_ext.train.pose import pose_position_ids


@dataclass
class TrainingText:
    """The documents a run trains on, the held-out one it evaluates (``None``: no evaluation), and what was left out."""

    train: list[Document]
    held_out: Document | None
    excluded: list[str]


def load_training_text(
    tokenizer: Any,
    data: Any,
    exclude: list[str] | None = None,
    eval_document: str | None = None,
) -> TrainingText:
    """``data`` (``rope_ext.eval.data.load_documents``: the KJV by default, text files or any dataset) tokenized, with
    the ``exclude`` titles and the held-out ``eval_document`` kept out of training; unknown titles are refused."""
    documents = tokenize_documents(data, tokenizer)
    titles = [d.title for d in documents]
    asked = [*(exclude or []), *([eval_document] if eval_document else [])]
    unknown = [t for t in asked if t not in titles]
    if unknown:
        shown = ", ".join(titles[:12]) + (", ..." if len(titles) > 12 else "")
        option = "--eval-document" if unknown[0] == eval_document else "--exclude"
        raise ValueError(f"document {unknown[0]!r} ({option}) is not in the data; its documents: {shown}")
    held_out = next((d for d in documents if d.title == eval_document), None) if eval_document else None
    left_out = set(asked)
    train = [d for d in documents if d.title not in left_out]
    if not train:
        raise ValueError("no document is left to train on after --exclude and --eval-document")
    return TrainingText(train, held_out, sorted(left_out))


def training_windows(documents: list[Document], window: int, packing: str, eos_token_id: int | None) -> torch.Tensor:
    """``[N, window]`` token windows: ``packed`` joins the documents (an EOS token between them when the tokenizer has
    one) and cuts the stream; ``document`` cuts each document on its own. A tail shorter than a window is dropped."""
    if packing == "packed":
        parts = []
        for d in documents:
            parts.append(d.input_ids[0])
            if eos_token_id is not None:
                parts.append(torch.tensor([eos_token_id], dtype=d.input_ids.dtype))
        stream = torch.cat(parts)
        count = stream.numel() // window
        windows = stream[: count * window].view(count, window)
    elif packing == "document":
        pieces = [d.input_ids[0, : d.num_tokens // window * window].view(-1, window) for d in documents]
        windows = torch.cat(pieces) if pieces else torch.empty(0, window, dtype=torch.long)
    else:
        raise ValueError(f"unknown packing {packing!r}; valid: packed, document")
    if windows.shape[0] == 0:
        total = sum(d.num_tokens for d in documents)
        longest = max(d.num_tokens for d in documents)
        raise ValueError(
            f"the training text holds no window of {window} tokens ({total} tokens in all, the longest document "
            f"{longest}{' with --packing document' if packing == 'document' else ''}); give a shorter --sequence-length or more text"
        )
    return windows.to(torch.long).contiguous()


def run_text(config: Any, tokenizer: Any, data: Any) -> tuple[TrainingText, torch.Tensor]:
    """A training run's text and windows (``config``: a ``LoopConfig``): the held-out document checked against the
    evaluated length (``config.target``), at least one micro-batch of windows."""
    text = load_training_text(tokenizer, data, config.exclude, config.eval_document)
    if text.held_out is not None and text.held_out.num_tokens < config.target:
        raise ValueError(
            f"--eval-document {text.held_out.title!r} has {text.held_out.num_tokens} tokens, fewer than the evaluated "
            f"length ({config.target}, {config.target_source()}); give a longer document, or shorten "
            f"{config.target_source().split(',')[0]}"
        )
    windows = training_windows(text.train, config.sequence_length, config.packing, tokenizer.eos_token_id)
    if windows.shape[0] < config.micro_batch:
        raise ValueError(
            f"--micro-batch {config.micro_batch}: the training text makes {windows.shape[0]} window(s) of "
            f"{config.sequence_length} tokens; lower --micro-batch or give more text"
        )
    return text, windows


class WindowDataset(Dataset):
    """The windows, each with its index (the collator seeds PoSE positions with it)."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.windows[index], "index": index}


class Collator:
    """Stacks windows into a causal-LM batch (labels are the inputs; an all-ones attention mask). With ``pose``, each
    window gets PoSE position ids below ``target`` from a generator seeded by (seed, epoch, window index): the same
    ids whatever the number of processes or micro-batch size. ``set_epoch`` is called by the training loop."""

    def __init__(self, target: int, pose: bool = False, seed: int = 0) -> None:
        self.target = target
        self.pose = pose
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def generator(self, index: int) -> torch.Generator:
        """The generator of window ``index`` this epoch: seeded by (seed, epoch, index)."""
        return torch.Generator().manual_seed(hash((self.seed, self.epoch, index)) & 0x7FFF_FFFF_FFFF_FFFF)

    def position_ids(self, window: int, index: int) -> torch.Tensor:
        return pose_position_ids(window, self.target, self.generator(index))

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.stack([s["input_ids"] for s in samples])  # [b, W]
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        if self.pose:
            batch["position_ids"] = torch.stack([self.position_ids(ids.shape[1], s["index"]) for s in samples])
        return batch


class ObjectiveCollator(Collator):
    """Batches for the objectives that are not next-token prediction (``rope_ext.eval.objectives``): ``masked-lm``
    (BERT's 80/10/10 masking by transformers' ``DataCollatorForLanguageModeling``) or ``span-corruption`` (T5's
    sentinels). Each window is corrupted by a generator seeded by (seed, epoch, window index), like PoSE's ids: the
    same batch in one process or many, and after a resume."""

    def __init__(self, protocol: str, tokenizer: Any, eos_token_id: int | None = None, seed: int = 0) -> None:
        if protocol not in OBJECTIVE_PROTOCOLS:
            raise ValueError(f"unknown objective {protocol!r}; valid: {', '.join(OBJECTIVE_PROTOCOLS)}")
        super().__init__(0, pose=False, seed=seed)
        self.protocol = protocol
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.masking = mask_collator(tokenizer) if protocol == "masked-lm" else None

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        inputs, labels = [], []
        for sample in samples:
            ids, generator = sample["input_ids"], self.generator(sample["index"])
            if self.masking is not None:
                masked, target = mask_tokens(self.masking, ids, generator)
            else:
                noise = random_spans(ids.numel(), generator)
                sentinels = sentinel_ids(self.tokenizer, int(span_starts(noise).sum()))
                masked, target = corrupt_spans(ids, noise, sentinels, self.eos_token_id)
            inputs.append(masked)
            labels.append(target)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_id
        input_ids = torch.nn.utils.rnn.pad_sequence(inputs, batch_first=True, padding_value=pad)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(i) for i in inputs], batch_first=True)
        return {"input_ids": input_ids, "attention_mask": mask,
                "labels": torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)}
