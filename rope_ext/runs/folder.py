"""One output folder for every command that writes one, and its rules.

* A folder to write into must be a folder, or creatable as one (``writable_folder``).
* A run's options are saved beside its outputs; a re-run with the same options resumes, one with other options is
  refused naming each difference, and ``--overwrite`` starts afresh: one class, ``RunFolder``, reads, compares and
  refuses for every command (``check_folder`` for training runs; ``rope_ext.runs.results.ResultStore``, a
  ``RunFolder`` for evaluations).
* ``--overwrite`` removes every file a rope-ext command writes (``clear_outputs``: ``ALL_OUTPUTS`` and the
  checkpoints), whichever command wrote it, and nothing else; so a folder reused by another command never keeps a
  previous run's adapter or weights beside the new ones.
* Local paths among the options are compared resolved (``resolved``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rope_ext.installers.params import PARAMS_ATTR
from rope_ext.runs.specs import one_spec

#: the options that name local paths, compared resolved
PATH_OPTIONS = ("model", "tokenizer", "dataset", "text_files", "out")


def writable_folder(text: str) -> str:
    """A folder to write into: an existing folder, or a path that can be created as one."""
    if not text.strip():
        raise ValueError("must not be empty; give a folder (created if missing)")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{text!r} is a file; give a folder (created if missing)")
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{text!r} cannot be created: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{text!r} cannot be written: no write permission in {str(parent)!r}")
    return text


def resolved(value: Any) -> Any:
    """A local path resolved (``doc.txt`` and its absolute path, ``dir`` and ``dir/`` are one input); 'default',
    hub ids and other values as they are."""
    if isinstance(value, list):
        return [resolved(item) for item in value]
    if isinstance(value, str) and value not in ("default", "kjv", "text files") and os.path.exists(value):
        return os.path.realpath(value)
    return value


def normalised(key: str, value: Any) -> Any:
    """Run configuration values as compared: paths resolved (a folder's older run files kept them as given)."""
    return resolved(value) if key in PATH_OPTIONS else value


#: ``rope-ext finetune``'s record and options
RUN_FILE = "finetune.json"
CONFIG_FILE = "finetune_config.json"


#: ``rope-ext train``'s record and options
TRAIN_RUN_FILE = "train.json"
TRAIN_CONFIG_FILE = "train_config.json"
#: what a run read beside its options (``input_fingerprints``), checked when it resumes
INPUTS_FILE = "inputs.json"


#: options a resumed run may change (the rest must equal the folder's): how often it logs, saves and evaluates, and
#: how long it runs (with a schedule that does not depend on the length)
MAY_CHANGE = ("eval_every", "log_every", "save_every", "keep_checkpoints", "threads", "out", "max_steps")


#: the files of a training run's folder (``rope-ext finetune``, ``train``) and of a model ``rope-ext merge`` writes
FINETUNE_OUTPUTS = ("adapter_config.json", "adapter_model.safetensors", "model.safetensors", "config.json", RUN_FILE,
                    CONFIG_FILE, INPUTS_FILE, "loss.json", "loss.csv", "loss.png", "generation_config.json", "README.md")
#: every file a rope-ext command writes into its folder, whichever command (``clear_outputs`` removes them all)
ALL_OUTPUTS = (*FINETUNE_OUTPUTS, "adapter_model.bin", "pytorch_model.bin", "model.safetensors.index.json",
               TRAIN_RUN_FILE, TRAIN_CONFIG_FILE, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "spm.model", "added_tokens.json",
               "chat_template.jinja")
#: the shards of a large model's weights, and the files of an evaluation (``rope_ext.runs.results``: ppl, passkey)
OUTPUT_PATTERNS = ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin", "ppl.*", "ppl_*", "passkey.*", "passkey_*")
#: files that make a folder a model's (a fine-tune, a merged or trained model): an evaluation never writes there
MODEL_FILES = ("config.json", "adapter_config.json", RUN_FILE, TRAIN_RUN_FILE)


def read_json(path: Path, what: str) -> Any:
    """``path``'s JSON; a file that does not parse is a ``ValueError`` naming it."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is not {what} rope-ext wrote ({type(error).__name__}: {error}); "
            "remove it or pass --overwrite to start the folder afresh"
        ) from None


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_differences(
    previous: dict[str, Any],
    current: dict[str, Any],
    *,
    may_change: Iterable[str] = (),
    normalise: Callable[[str, Any], Any] | None = None,
    labels: dict[str, str] | None = None,
) -> list[str]:
    """What differs between two run configurations, one ``"key: <old> before, <new> now"`` per key (a dict
    value: per entry that differs); keys in ``may_change`` are not compared, and ``normalise(key, value)``
    is applied to both sides before comparing (e.g. resolving paths; values are shown as given). ``labels[key]`` says what a changed value of
    ``key`` means (an entry of a dict: one in both)."""
    labels = labels or {}
    normalise = normalise or (lambda key, value: value)
    skip = set(may_change)
    differences = []
    for key in [*previous, *(k for k in current if k not in previous)]:
        if key in skip:
            continue
        old, new = normalise(key, previous.get(key)), normalise(key, current.get(key))
        if old == new:
            continue
        if not (isinstance(old, dict) and isinstance(new, dict)):  # (shown as written: a spec, not its configs)
            old, new = previous.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            for entry in [*old, *(e for e in new if e not in old)]:
                if old.get(entry) != new.get(entry):
                    before = short(old[entry]) if entry in old else "absent"
                    now = short(new[entry]) if entry in new else "absent"
                    label = f" ({labels[key]})" if key in labels and entry in old and entry in new else ""
                    differences.append(f"{key}[{entry!r}]: {before} before, {now} now{label}")
        else:
            label = f" ({labels[key]})" if key in labels else ""
            differences.append(f"{key}: {short(old)} before, {short(new)} now{label}")
    return differences


class RunFolder:
    """A folder whose options file says which run its outputs belong to: every command that resumes (``rope-ext
    finetune``, ``train``, ``eval``) reads, compares and refuses through this one class, with one message.

    ``saved()`` is the folder's options (``None``: none written); ``refuse(why)`` raises the refusal;
    ``refuse_differences`` names each option that differs (``config_differences``)."""

    def __init__(self, out: str | Path, options_file: str, holds: str, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.options_path = self.out / options_file
        self.holds = holds  # what the folder holds, in the refusal: "ppl results", "a rope-ext finetune run"
        self.overwrite = overwrite

    def saved(self) -> dict[str, Any] | None:
        """The options file's dict (``None``: no such file); one that does not parse, or holds no dict, is refused
        naming it."""
        if not self.options_path.is_file():
            return None
        saved = read_json(self.options_path, "a run configuration")
        if not isinstance(saved, dict):
            raise ValueError(
                f"{self.options_path} is not a run configuration rope-ext wrote (a JSON {type(saved).__name__}); "
                "remove it or pass --overwrite to start the folder afresh"
            )
        return saved

    def refuse(self, why: str, resume: str = "") -> None:
        """``ValueError``: the folder holds ``why``; ``resume`` says how to resume it instead, where one can."""
        raise ValueError(f"--out {self.out} holds {self.holds} {why}; {resume + ', ' if resume else ''}give another "
                         "--out, or pass --overwrite to replace them")

    def refuse_differences(self, differences: list[str]) -> None:
        self.refuse(f"of another configuration (differs in: {'; '.join(differences)})", "re-run with its options to resume")


def holds_model(path: str | os.PathLike) -> str | None:
    """The first of ``MODEL_FILES`` in ``path`` (``None``: none, or no folder)."""
    return next((name for name in MODEL_FILES if (Path(path) / name).is_file()), None)


def is_finetune_folder(path: str | os.PathLike) -> bool:
    """A folder ``rope-ext finetune`` wrote with a LoRA adapter (its base lives elsewhere)."""
    path = Path(path)
    return (path / RUN_FILE).is_file() and (path / "adapter_config.json").is_file()


def resolved_options(config: Any) -> dict[str, Any]:
    """The options as saved and compared: local paths resolved (``../doc.txt`` and its absolute path are one input)."""
    return {key: normalised(key, value) for key, value in config.options().items()}


def check_folder(
    config: Any, overwrite: bool, config_file: str = CONFIG_FILE, command: str = "rope-ext finetune"
) -> dict[str, Any] | None:
    """The folder's saved options when this run resumes it (``None``: a new run); refuses a folder of another
    configuration or of other files, unless ``overwrite``."""
    writable_folder(config.out)
    out = Path(config.out)
    for option in ("model", "tokenizer"):  # (--overwrite there would delete the base's files)
        given = getattr(config, option, None)
        if given and given != "default" and os.path.isdir(given) and (within(out, given) or within(given, out)):
            raise ValueError(f"--out {config.out}: the --{option} folder {given} is there (or the one is inside the "
                             "other); write the run to another folder")
    if not out.exists() or not any(out.iterdir()) or overwrite:
        return None
    folder = RunFolder(out, config_file, f"a {command} run")
    if not folder.options_path.is_file():
        raise ValueError(
            f"--out {config.out}: the folder holds other files (not a {command} run); give an empty or new "
            "folder, or --overwrite"
        )
    saved = folder.saved()
    renamed = getattr(type(config), "RENAMED", {})  # (a folder an older rope-ext wrote: its options' old names)
    saved = {renamed.get(key, key): value for key, value in saved.items()}
    current = resolved_options(config)
    defaults = option_defaults(config)  # (an option newer than the folder's run: its default there)
    before = {k: saved.get(k, defaults.get(k)) for k in sorted(set(saved) | set(current))}
    differ = config_differences(before, current, may_change=MAY_CHANGE, normalise=comparable)
    if saved.get("max_steps") != current["max_steps"] and config.schedule in ("linear", "cosine"):
        differ.append(f"max_steps: {saved.get('max_steps')!r} before, {current['max_steps']!r} now (the "
                      f"{config.schedule} schedule's length: a resumed run would follow another curve)")
    if differ:
        folder.refuse_differences(differ)
    return saved


def option_defaults(config: Any) -> dict[str, Any]:
    """The default of each option of a run configuration (a dataclass)."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(config)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def within(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether ``path`` is ``folder`` or inside it (links resolved)."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or folder in path.parents


def comparable(key: str, value: Any) -> Any:
    """An option as a resume compares it: the methods as their configs, so equal spellings are one
    (``yarn:factor=4.0`` and ``yarn:factor=4``)."""
    if key == "methods" and isinstance(value, str):
        try:
            return [c.to_dict() for c in one_spec(value)]
        except (ValueError, TypeError):
            return value
    return value


def clear_outputs(out: Path) -> None:
    """Remove the files rope-ext commands write (``ALL_OUTPUTS``, the weight shards, an evaluation's files, the
    checkpoints) from ``out``."""
    out = Path(out)
    remove_checkpoints(out)
    for name in ALL_OUTPUTS:
        (out / name).unlink(missing_ok=True)
    for pattern in OUTPUT_PATTERNS:
        for path in out.glob(pattern):
            path.unlink()


def input_fingerprints(parts: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of what a run reads beside its options: the training windows' token ids and, where some weights stay
    frozen (LoRA), those weights as loaded. The same paths holding other text or another model give others."""
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


def unfinished_run(path: str | os.PathLike) -> tuple[str, str, str] | None:
    """``(command, options file, record file)`` of the run a folder holds unfinished (its options written, its record
    not yet: the run was stopped or is under way), or ``None``."""
    path = Path(path)
    for command, config_file, run_file in (("rope-ext finetune", CONFIG_FILE, RUN_FILE),
                                           ("rope-ext train", TRAIN_CONFIG_FILE, TRAIN_RUN_FILE)):
        if (path / config_file).is_file() and not (path / run_file).is_file():
            return command, config_file, run_file
    return None


def finished(out: Path, run_file: str = RUN_FILE) -> dict[str, Any] | None:
    try:
        return json.loads((out / run_file).read_text())
    except (OSError, ValueError):
        return None


def complete_run(config: Any, resumed: dict[str, Any] | None, run_file: str) -> dict[str, Any] | None:
    """The record of the folder's run when it is complete at ``config.max_steps`` (nothing to do); raises when a
    finished run cannot be continued to ``max_steps``."""
    if resumed is None:
        return None
    done = finished(Path(config.out), run_file)
    if done is not None and done.get("steps") == config.max_steps:
        grows = ("a larger --max-steps continues it, " if config.schedule not in ("linear", "cosine")
                 else f"its {config.schedule} schedule is fixed by --max-steps, so it cannot grow; ")
        print(f"{config.out}: this run is complete ({done['steps']} step{'' if done['steps'] == 1 else 's'}); nothing to do ({grows}--overwrite starts "
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


# --- checkpoints ------------------------------------------------------------------------------------------


CHECKPOINTS = "checkpoints"
#: written into a checkpoint folder once ``save_state`` has returned: a folder without it was cut short (a killed run)
COMPLETE = "rope_ext_complete"


#: ``checkpoints/checkpoint_<step>``: named by the optimizer step it holds
CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")


def checkpoints(out: str | Path) -> list[tuple[int, Path, bool]]:
    """``(step, folder, complete)`` of a run folder's checkpoints, oldest first."""
    folder = Path(out) / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted((int(m[1]), p, (p / COMPLETE).is_file()) for p in folder.iterdir()
                  if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir())


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete ``checkpoints/checkpoint_N`` folder of a run folder, or ``None``."""
    complete = [path for _, path, done in checkpoints(out) if done]
    return complete[-1] if complete else None


def drop_incomplete(out: Path) -> None:
    """Checkpoint folders a killed run left half-written (no ``COMPLETE`` marker) are removed."""
    for _, path, done in checkpoints(out):
        if not done:
            shutil.rmtree(path, ignore_errors=True)


def remove_checkpoints(out: str | Path) -> None:
    shutil.rmtree(Path(out) / CHECKPOINTS, ignore_errors=True)


def prune_checkpoints(out: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (by step), removing the older ones; run once a new one is
    complete, so a run killed while saving still has its previous checkpoint."""
    complete = [path for _, path, done in checkpoints(out) if done]
    for path in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
