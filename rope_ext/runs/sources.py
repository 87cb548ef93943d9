"""What ``--model`` names, told before anything loads: a file, a path that is neither a folder nor a hub id, a
folder that holds no model, a model folder with no tokenizer; and the one-line refusal of a model that did not load."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from rope_ext.runs.folder import is_finetune_folder, unfinished_run
from rope_ext.runs.models import MissingTokenizer, UnfinishedRun, lacks_tokenizer, load_model

#: the hub's repository ids: ``name`` or ``owner/name`` of letters, digits, ``-``, ``_``, ``.``
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")

GIVE_MODEL = "give 'default', a folder written by save_pretrained, or a hub id"


def could_be_hub_id(name: str) -> bool:
    """Whether the hub would take ``name`` as a repository id (no part starting or ending with ``-`` or ``.``, no
    ``--`` or ``..``: ``./model`` and ``../model`` are paths)."""
    return bool(_HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name and not any(
        part[:1] in "-." or part[-1:] in "-." for part in name.split("/"))


def unloadable(option: str, name: str, error: Exception) -> ValueError:
    """The one-line refusal of a model ``name`` (given to ``option``) that did not load: whether it is a folder or
    could be a hub id, and the first line of why (the hub's own message says less for a path that is neither)."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if Path(name).is_dir():
        found = "a folder"
    elif could_be_hub_id(name):
        found = "no such folder, nor a hub model available"
    else:
        found, reason = "no such folder", "nor is it a hub id (a name, or owner/name)"
    return ValueError(f"{option} {name!r}: cannot load it ({found}: {reason}); {GIVE_MODEL} (downloading needs "
                      "HF_HUB_OFFLINE unset)")


def check_model_source(option: str, name: str) -> None:
    """Refuse, before anything loads (and before a results folder is compared with this run), what ``name`` shows
    it cannot be; a hub id is left to its load."""
    if name == "default":
        return
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {name!r} is a file; {GIVE_MODEL}")
    if not path.exists():
        if not could_be_hub_id(name):
            raise unloadable(option, name, FileNotFoundError(name))
        return
    if unfinished_run(path) is not None:  # (its load names the run and how to finish it)
        return
    if not is_finetune_folder(path) and not (path / "config.json").is_file():
        raise unloadable(option, name, ValueError("no config.json: it holds no model"))
    if lacks_tokenizer(name):
        raise ValueError(f"{option} {MissingTokenizer(name)}")


def load_given_model(option: str, name: str, dtype: Any, tokenizer: Any = None) -> tuple[Any, Any]:
    """``load_model`` of the model ``name`` given to ``option``, what fails refused in one line (``default``'s own
    failures are left as they are: a broken install, not the user's value)."""
    try:
        return load_model(name, dtype=dtype, tokenizer=tokenizer)
    except (MissingTokenizer, UnfinishedRun) as error:
        raise ValueError(f"{option} {error}") from None
    except (OSError, ValueError, SafetensorError) as error:  # (SafetensorError: weights that do not read)
        if name == "default":
            raise
        raise unloadable(option, name, error) from None
