"""Documents for evaluation, built with ``datasets``: the offline KJV default, text files, or any dataset."""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rope_ext.eval.corpus import kjv_books

if TYPE_CHECKING:  # (datasets is imported where documents are loaded: the CLI's parser and options need none)
    from datasets import Dataset


@dataclass
class Document:
    title: str
    input_ids: torch.Tensor  # [1, n]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])

    def fingerprint(self) -> str:
        """The first 16 hex digits of the SHA-256 of its token ids (int64, little-endian): a results folder
        tells a changed document from the one it scored, whatever its title or path."""
        ids = self.input_ids.reshape(-1).to(torch.int64).numpy().astype("<i8")
        return hashlib.sha256(ids.tobytes()).hexdigest()[:16]


def windows(documents: list[Document], size: int, count: int) -> list[Document]:
    """Each document's first ``count`` consecutive windows of ``size`` tokens (as many as it holds), titled
    ``"<title> @<start>"``: independent target windows for the fixed-target protocols, the units of their intervals."""
    out = []
    for document in documents:
        for k in range(min(count, document.num_tokens // size)):
            start = k * size
            out.append(Document(f"{document.title} @{start}", document.input_ids[:, start:start + size]))
    return out


def load_documents(
    dataset: str | None = None,
    text_files: list[str] | None = None,
    split: str | None = None,
    text_column: str = "text",
) -> Dataset:
    """A ``Dataset`` with ``title`` and ``text`` columns.

    ``dataset`` is a folder written by ``Dataset.save_to_disk`` or a hub name (online only), its ``split``
    (default ``train``; a saved ``Dataset`` is one split and takes none); ``text_files`` are plain-text files,
    one document each, known by their file names; neither means the King James Bible, one document per book.
    """
    from datasets import load_dataset, load_from_disk

    if dataset and text_files:
        raise ValueError("give --dataset or --text-files, not both")
    if text_files:
        titles = check_text_files(text_files)
        for path in text_files:
            try:
                with open(path, encoding="utf-8") as handle:
                    while handle.read(1 << 20):
                        pass
            except UnicodeDecodeError as error:
                raise ValueError(f"--text-files: {path} is not UTF-8 text ({error})") from None
        data = load_dataset("text", data_files=list(text_files), sample_by="document", split="train")
        return data.add_column("title", titles)
    if dataset is None:
        return kjv_books()
    local = os.path.isdir(dataset)
    try:
        data = load_from_disk(dataset) if local else load_dataset(dataset, split=split or "train")
    except (OSError, ValueError) as error:  # datasets' not-found and offline errors are OSErrors
        raise ValueError(
            f"--dataset {dataset!r}: {error} (give a folder written by Dataset.save_to_disk, or a hub dataset "
            "name with HF_HUB_OFFLINE unset)"
        ) from None
    if hasattr(data, "keys"):  # a DatasetDict
        if (split or "train") not in data:
            raise ValueError(f"--split {split or 'train'!r}: {dataset} has splits {', '.join(data)}")
        data = data[split or "train"]
    elif local and split is not None:
        raise ValueError(
            f"--split {split!r}: {dataset} holds one split (a saved Dataset, not a DatasetDict); leave --split out"
        )
    if text_column not in data.column_names:
        raise ValueError(
            f"--text-column {text_column!r}: the dataset has no column {text_column!r}; columns: "
            f"{', '.join(data.column_names)}"
        )
    feature = data.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"--text-column {text_column!r}: the column holds {feature}, not text")
    data = data.select_columns([name for name in ("title",) if name in data.column_names] + [text_column])
    if text_column != "text":
        data = data.rename_column(text_column, "text")
    if "title" not in data.column_names:
        data = data.add_column("title", [f"doc{i}" for i in range(len(data))])
    titles = [str(title) for title in data["title"]]
    if getattr(data.features["title"], "dtype", None) not in ("string", "large_string"):
        data = data.remove_columns("title").add_column("title", titles)
    repeated = sorted(title for title, count in Counter(titles).items() if count > 1)
    if repeated:
        raise ValueError(
            f"--dataset {dataset!r}: titles {', '.join(map(repr, repeated[:5]))} name several documents, and a "
            "document is known by its title (in the records and tables): give each its own title"
        )
    return data.select_columns(["title", "text"])


def check_text_files(text_files: list[str]) -> list[str]:
    """The documents' titles (their file names), once every file is there, a readable non-empty regular file, and
    given once under its name; else an ``OSError`` or ``ValueError`` naming every file missing, or the first other
    problem. (Nothing is read: ``load_documents`` checks the text.)"""
    missing = [path for path in text_files if _missing(path)]
    if missing:  # (every one named: a user fixes them all at once)
        raise FileNotFoundError(f"--text-files: {_and(missing)} not found")
    for path in text_files:
        _check_text_file(path)
    titles = [os.path.basename(os.path.normpath(path)) for path in text_files]
    real = [os.path.realpath(path) for path in text_files]
    for i, path in enumerate(text_files):
        for j in range(i):
            if real[i] == real[j]:
                raise ValueError(f"--text-files: {text_files[j]} and {path} are the same file; give it once")
            if titles[i] == titles[j]:
                raise ValueError(
                    f"--text-files: {text_files[j]} and {path} are both named {titles[i]!r}, and a document is "
                    "known by its file's name (in the records and tables): rename or copy one"
                )
    return titles


def _and(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _missing(path: str) -> bool:
    """Nothing at ``path``, also under a file (``doc.txt/x``); a path that cannot be looked at is not missing
    (``_check_text_file`` says why)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        pass
    return False


def _check_text_file(path: str) -> None:
    """A readable, non-empty regular file, or an ``OSError``/``ValueError`` that says what it is instead."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"--text-files: {path} not found") from None
    except OSError as error:
        raise OSError(f"--text-files: cannot read {path} ({error.strerror or error})") from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"--text-files: {path} is a folder; give plain-text files (UTF-8), one document each")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(
            f"--text-files: {path} is not a regular file (a device, pipe or socket); give plain-text files "
            "(UTF-8), one document each"
        )
    if info.st_size == 0:
        raise ValueError(f"--text-files: {path} is empty")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"--text-files: cannot read {path} (permission denied)")


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
    with warnings.catch_warnings():  # (datasets passes pyarrow >= 25 an option it deprecates; nothing to act on here)
        warnings.filterwarnings("ignore", message="Specifying null_placement in SortOptions is deprecated",
                                category=FutureWarning)
        encoded = encoded.sort("num_tokens", reverse=True)
    if max_documents is not None:
        encoded = encoded.select(range(min(max_documents, len(encoded))))
    return [Document(row["title"], torch.tensor([row["input_ids"]])) for row in encoded]
