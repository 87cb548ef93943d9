"""Documents for evaluation, built with ``datasets``: the offline KJV default, text files, or any dataset."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset, load_dataset, load_from_disk

from rope_ext.eval.corpus import kjv_books


@dataclass
class Document:
    title: str
    input_ids: torch.Tensor  # [1, n]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


def load_documents(
    dataset: str | None = None,
    text_files: list[str] | None = None,
    split: str = "train",
    text_column: str = "text",
) -> Dataset:
    """A ``Dataset`` with ``title`` and ``text`` columns.

    ``dataset`` is a folder written by ``Dataset.save_to_disk`` or a hub name (online only);
    ``text_files`` are plain-text files, one document each; neither means the King James Bible, one
    document per book.
    """
    if dataset and text_files:
        raise ValueError("give --dataset or --text-files, not both")
    if text_files:
        missing = [path for path in text_files if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(f"text files not found: {', '.join(missing)}")
        for path in text_files:
            try:
                with open(path, encoding="utf-8") as handle:
                    while handle.read(1 << 20):
                        pass
            except UnicodeDecodeError as error:
                raise ValueError(f"--text-files: {path} is not UTF-8 text ({error})") from None
        data = load_dataset("text", data_files=list(text_files), sample_by="document", split="train")
        return data.add_column("title", [os.path.basename(path) for path in text_files])
    if dataset is None:
        return kjv_books()
    try:
        data = load_from_disk(dataset) if os.path.isdir(dataset) else load_dataset(dataset, split=split)
    except (OSError, ValueError) as error:  # datasets' not-found and offline errors are OSErrors
        raise ValueError(
            f"--dataset {dataset!r}: {error} (give a folder written by Dataset.save_to_disk, or a hub dataset "
            "name with HF_HUB_OFFLINE unset)"
        ) from None
    if hasattr(data, "keys"):  # a DatasetDict
        if split not in data:
            raise ValueError(f"--split {split!r}: {dataset} has splits {', '.join(data)}")
        data = data[split]
    if text_column not in data.column_names:
        raise ValueError(
            f"--text-column {text_column!r}: the dataset has no column {text_column!r}; columns: "
            f"{', '.join(data.column_names)}"
        )
    if text_column != "text":
        data = data.rename_column(text_column, "text")
    if "title" not in data.column_names:
        data = data.add_column("title", [f"doc{i}" for i in range(len(data))])
    return data.select_columns(["title", "text"])


def tokenize_documents(
    data: Dataset, tokenizer: Any, min_tokens: int = 0, max_documents: int | None = None
) -> list[Document]:
    """Tokenize, keep documents of at least ``min_tokens`` tokens (longest first), at most ``max_documents``."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "num_tokens": [len(x) for x in ids]}

    encoded = data.map(encode, batched=True, remove_columns=["text"], desc="tokenizing")
    encoded = encoded.filter(lambda row: row["num_tokens"] >= min_tokens)
    if len(encoded) == 0:
        raise ValueError(f"no document has at least {min_tokens} tokens; lower --min-tokens or give longer texts")
    encoded = encoded.sort("num_tokens", reverse=True)
    if max_documents is not None:
        encoded = encoded.select(range(min(max_documents, len(encoded))))
    return [Document(row["title"], torch.tensor([row["input_ids"]])) for row in encoded]
