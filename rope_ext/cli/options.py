"""The command line's option values and parser pieces: argparse types whose messages reach the user, the options
every evaluation takes, and one flag per field of a run configuration."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any, NoReturn

from rope_ext.runs.devices import parse_device
from rope_ext.runs.folder import writable_folder
from rope_ext.runs.specs import parse_methods
from rope_ext.runs.values import (
    LengthTooShort,
    comma_items,
    field_kinds,
    name_list,
    nonempty,
    parse_length,
    parse_lengths,
    parser_of,
)
from rope_ext.train.config import MAX_THREADS

DTYPES = ("float32", "bfloat16", "float16")
MAX_TRIALS = 10_000  # keys per cell: more is a typo, not a run


# --- option values ----------------------------------------------------------------------------------


def parse_depths(text: str) -> list[float]:
    """``"0.9,0.1"`` -> ``[0.1, 0.9]`` (sorted); a depth given twice (``0.5,0.50``) is refused, naming it."""
    depths: dict[float, str] = {}
    for part in comma_items(text, "depth"):
        try:
            depth = float(part)
        except ValueError:
            depth = math.nan
        if not 0 <= depth <= 1:
            raise ValueError(f"malformed depth {part!r}; give comma-separated numbers in [0, 1], e.g. 0.1,0.5,0.9")
        if depth in depths:
            same = "" if depths[depth] == part else f" ({depths[depth]} and {part})"
            raise ValueError(f"depth {depth:g} is given twice in {text!r}{same}; give each depth once, e.g. "
                             "0.1,0.5,0.9")
        depths[depth] = part
    if not depths:
        raise ValueError("give at least one depth in [0, 1], e.g. 0.1,0.5,0.9")
    return sorted(depths)


def task_list(text: str) -> list[str]:
    """``--tasks``: RULER task names, comma-separated, or ``all``; a task given twice (``vt,vt``) is refused, naming
    it."""
    from rope_ext.eval.ruler_tasks import TASKS

    names = comma_items(text, "task")
    if names == ["all"]:
        return list(TASKS)
    if "all" in names:
        raise ValueError(f"'all' stands alone (every task); got {text!r}")
    if not names:
        raise ValueError(f"give at least one task, or all: {', '.join(TASKS)}")
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; valid tasks: all, {', '.join(TASKS)}")
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"task {twice!r} is given twice in {text!r}; give each task once, e.g. niah_single_1,vt "
                         "(or all)")
    return names


def percent(text: str) -> float:
    """A score threshold in [0, 100] (RULER's scale)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise ValueError(f"must be a score in [0, 100] (RULER's scale, e.g. 85.6), got {text!r}")
    return value


def layer_type_list(text: str) -> list[str]:
    layer_types = [part.strip() for part in text.split(",") if part.strip()]
    if not layer_types:
        raise ValueError("give at least one layer type, e.g. full_attention,sliding_attention")
    return layer_types


def length_list(text: str) -> list[int]:
    return parse_lengths(text)


def min_tokens(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_length(text)
    except LengthTooShort:  # (1, or a negative length)
        raise ValueError(f"must be 0 (no minimum) or a length of at least 2 tokens, got {text!r}") from None


def file_list(text: str) -> list[str]:
    """Comma-separated files (a flag with ``nargs="+"`` also takes them space-separated)."""
    return name_list(text, "must not be empty; give files, comma- or space-separated")


def model_name_or_path(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty; give 'default', a folder written by save_pretrained, or a hub id")
    if text != "default" and os.path.exists(text) and not os.path.isdir(text):
        raise ValueError(f"{text!r} is a file; give 'default', a folder written by save_pretrained, or a hub id")
    return text


def dataset_name(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty; give a folder written by Dataset.save_to_disk, or a hub dataset name")
    if os.path.exists(text) and not os.path.isdir(text):
        raise ValueError(
            f"{text!r} is a file; give a folder written by Dataset.save_to_disk (or a hub dataset name), or the "
            "file to --text-files"
        )
    return text


def option(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` whose ``ValueError`` message reaches the user (argparse would replace it)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__.strip("_")
    return convert


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if high is not None and not low <= value <= high:  # (the whole range, whichever end is crossed)
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    convert.__name__ = f"integer >= {low}"
    return convert


def seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be an integer, got {text!r}") from None


def config_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def config_parser(cls: type) -> argparse.ArgumentParser:
    """A parent parser with one flag per field of the run configuration ``cls`` (``FinetuneConfig``,
    ``TrainConfig``), built by transformers' ``HfArgumentParser`` from the fields (names, help, choices, booleans,
    lists), then given rope_ext's value types (``rope_ext.runs.values``: 4k = 4096, comma-separated lists, messages
    that reach the user) and ``None`` defaults: a flag left out keeps the YAML file's value, else the field's default
    (shown in the help)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(cls, add_help=False)
    parser.add_argument("--config", type=option(nonempty), action=Once,
                        help="a YAML file of options (flags given here override it)")
    parser.add_argument("--overwrite", action="store_true", help="start again in a folder of another run")
    kinds = field_kinds(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for action in parser._actions:
        if action.dest not in fields or action.option_strings[0].startswith("--no"):
            continue
        f, (kind, optional) = fields[action.dest], kinds[action.dest]
        action.option_strings.sort(key=lambda flag: "_" in flag)  # (--lora-r shown first, --lora_r kept)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = (",".join(default) or "''") if isinstance(default, list) else default
        if "default" not in (action.help or ""):
            action.help = f"{action.help or ''} (default: {shown})"
        if kind == "list":
            action.help += "; comma- or space-separated"
            action.choices = None  # (each name is checked with the configuration)
        if (parse := parser_of(kind, optional)) is not None:
            action.type = option(parse)
        action.default = None
    return parser


def joined(groups: list[list[str]]) -> list[str]:
    """A list flag's values, given comma- or space-separated (``--exclude a,b c``), as one list: ``[a, b, c]``."""
    return [name for group in groups for name in group]


def config_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of ``cls``'s flags as parsed (``None``: not given); a list's comma-separated groups joined."""
    flags = {name: getattr(args, name) for name in config_fields(cls)}
    return {name: joined(value) if isinstance(value, list) and value and isinstance(value[0], list) else value
            for name, value in flags.items()}


class Once(argparse.Action):
    """An option given at most once (a second ``--config`` would silently replace the first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest) is not None:
            raise argparse.ArgumentError(self, "given twice; give one file (flags override it)")
        setattr(namespace, self.dest, values)


# --- parser -----------------------------------------------------------------------------------------


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """Reports bad arguments the way ``main`` reports every error: ``rope-ext: error: ...``, status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """As argparse's, with the command's own ``--help`` named, and a hint where ``--no-X`` negates a boolean."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = command_parser(self, parsed)
            hints = [hint for hint in (negation_hint(chosen, extra) for extra in extras) if hint]
            chosen.error(f"unrecognized arguments: {' '.join(extras)}{''.join(f' ({hint})' for hint in hints)}")
        return parsed


def command_parser(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command ``parsed`` ran (``rope-ext finetune``'s, ``rope-ext eval ppl``'s)."""
    for action in parser._actions:
        if isinstance(action.choices, dict) and getattr(parsed, action.dest, None) in action.choices:
            return command_parser(action.choices[getattr(parsed, action.dest)], parsed)
    return parser


def negation_hint(parser: argparse.ArgumentParser, extra: str) -> str | None:
    """How to switch off the boolean option ``--X`` where the user wrote ``--no-X``, which it does not define."""
    if not extra.startswith(("--no-", "--no_")):
        return None
    name = extra.split("=", 1)[0][5:]
    for action in parser._actions:
        if {f"--{name}", f"--{name.replace('_', '-')}"} & set(action.option_strings) and action.const is True:
            flag = action.option_strings[0]
            if action.nargs == "?":  # (transformers' booleans: --X, --X true, --X false)
                return f"{flag} is off unless given; to switch off a --config file's {action.dest}: true, give " \
                       f"{flag} false"
            return f"{flag} is off unless given: leave it out"
    return None


def add_model_options(parser: argparse.ArgumentParser, methods: str, lengths: str, out: str) -> None:
    parser.add_argument(
        "--model", type=option(model_name_or_path), default="default",
        help="'default' (embedded SmolLM2-135M), a folder or a hub id (default: default)",
    )
    parser.add_argument(
        "--methods",
        type=option(parse_methods),
        default=None,
        help="comma-separated method specs: name[:key=value...], '+' combines methods, 'none' is the unpatched "
        f"model, 'saved' the patch a model folder was saved with; values are JSON (default: {methods}; on a local "
        "folder saved with a patch, such as a fine-tune or a rope-ext train run: saved, as trained)",
    )
    parser.set_defaults(default_methods=methods)
    parser.add_argument(
        "--lengths", type=option(length_list), default=lengths, help="comma-separated token counts, 4k = 4096, "
        "1M = 1048576 (default: %(default)s)"
    )
    parser.add_argument(
        "--replace-scaling", action="store_true",
        help="let the methods replace the RoPE scaling the checkpoint already has (refused otherwise)",
    )
    parser.add_argument(
        "--layer-types", type=option(layer_type_list), default=None,
        help="comma-separated layer types to patch on models with several (Gemma 3: default full_attention)",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument(
        "--device", type=option(parse_device), default="cpu",
        help="where the model runs: cpu, cuda, cuda:N, mps, or auto (accelerate's device map: the model spread over "
        "the GPUs, then the CPU) (default: cpu)",
    )
    parser.add_argument(
        "--threads", type=int_at_least(0, MAX_THREADS), default=0, help="torch threads (default 0: torch's choice)"
    )
    parser.add_argument("--out", type=option(writable_folder), default=out,
                        help="results folder (default: %(default)s)")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace the folder's results where this run cannot resume them (another configuration or document, "
        "lengths that move the targets, unreadable files)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not plot at the end")
