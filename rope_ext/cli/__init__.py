"""``rope-ext``: evaluate context-extension methods, plot results, list methods and families.

    rope-ext eval ppl --model default --methods none,yarn:factor=4 --lengths 2k,4k,8k,16k --out results/run1
    rope-ext eval passkey --methods none,yarn:factor=2 --lengths 4k,8k,12k --depths 0.1,0.5,0.9 --out results/run1
    rope-ext plot results/run1

Method specs: name[:key=value...], methods of different hook kinds combined with '+' (a+b:key=value), or
'none' (the unpatched model); values are JSON (4, 1.5, true, null, [1,1.5,2]) or else plain strings.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable

from rope_ext.cli.options import (
    MAX_TRIALS,
    Parser,
    UsageError,
    add_model_options,
    config_parser,
    dataset_name,
    file_list,
    int_at_least,
    min_tokens,
    nonempty,
    option,
    parse_depths,
    parse_length,
    percent,
    seed,
    task_list,
    writable_folder,
)
from rope_ext.eval.plan import DEFAULT_STRIDE, DEFAULT_TARGET_TOKENS, PROTOCOLS
from rope_ext.serving import TARGETS
from rope_ext.train.config import FinetuneConfig, TrainConfig

# The main job (`make demo`): ~10 minutes of forwards on a 2-core CPU (fp32 forwards of the default model take
# ~10 s at 4k, ~30 s at 8k, ~65 s at 12k). PI (~3x worse at every length without fine-tuning) and the 2k
# column (flat, like 4k) are left to `--methods` / `--lengths`; 12k shows what happens past the native 8192.
# DCA is the attention method with the lowest fixed-target perplexity at 32k (README, "Attention methods:
# quality").
DEFAULT_METHODS = "none,yarn:factor=2,dynamic_ntk:factor=2,dca"
DEFAULT_LENGTHS = "4k,8k,12k"



def command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A verb's function, imported when it runs: building the parser (and importing ``rope_ext.cli.options`` from
    a script) needs no evaluation or training library."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"rope_ext.cli.{module}"), name)(args)

    run.__name__ = name
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rope-ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    methods = sub.add_parser(
        "methods", help="list the registered methods; with a NAME, its summary and its options with their meanings"
    )
    methods.add_argument("name", nargs="?", help="a method: its summary and its options (type, default, meaning)")
    methods.set_defaults(func=command("listing", "cmd_methods"))
    families = sub.add_parser("families", help="list the supported model families")
    families.set_defaults(func=command("listing", "cmd_families"))

    evaluate = sub.add_parser("eval", help="evaluate methods").add_subparsers(dest="evaluation", required=True)
    ppl = evaluate.add_parser("ppl", help="perplexity vs context length")
    add_model_options(ppl, DEFAULT_METHODS, DEFAULT_LENGTHS, "results/main")
    ppl.add_argument(
        "--protocol", choices=PROTOCOLS, default=None,
        help="fixed, curve or sliding (causal LMs; default fixed), masked-lm (DeBERTa and other masked LMs), "
        "span-corruption (T5); default: the model's first",
    )
    ppl.add_argument(
        "--target-tokens", type=int_at_least(1), default=None,
        help="fixed protocol: tokens scored; masked-lm and span-corruption: the tokens masked or corrupted in "
        f"(default: {DEFAULT_TARGET_TOKENS})",
    )
    ppl.add_argument(
        "--stride", type=int_at_least(1), default=None,
        help=f"sliding protocol: window stride (default: {DEFAULT_STRIDE})"
    )
    data = ppl.add_mutually_exclusive_group()
    data.add_argument(
        "--dataset", type=option(dataset_name),
        help="a folder saved with Dataset.save_to_disk, or a hub dataset name (online)",
    )
    data.add_argument(
        "--text-files", nargs="+", type=option(file_list),
        help="plain-text files (UTF-8), one document each; comma- or space-separated"
    )
    ppl.add_argument("--split", type=option(nonempty), help="--dataset's split (default: train)")
    ppl.add_argument("--text-column", type=option(nonempty), help="--dataset's text column (default: text)")
    ppl.add_argument(
        "--min-tokens", type=option(min_tokens), default=None,
        help="keep documents at least this long (default: the longest length, with the results folder's when "
        "resuming: every document provides every length)",
    )
    ppl.add_argument(
        "--documents", type=int_at_least(1), default=1, help="at most this many documents, longest first (default: 1)"
    )
    ppl.add_argument(
        "--windows", type=int_at_least(1, MAX_TRIALS), default=1,
        help="fixed-target protocols: target windows per document, its consecutive stretches of the target end's "
        "tokens, each scored alike: the units of the intervals (default: 1, the document's first)",
    )
    ppl.add_argument(
        "--target-end", type=option(parse_length), default=None,
        help="fixed-target protocols: where the targets end, at least the longest --lengths (default: the longest "
        "--lengths); runs of different lengths with one --target-end score the same tokens",
    )
    ppl.set_defaults(func=command("evaluate", "cmd_eval_ppl"))

    passkey = evaluate.add_parser("passkey", help="passkey retrieval over a length x depth grid")
    add_model_options(passkey, "none,yarn:factor=2,dynamic_ntk:factor=2", "4k,8k,12k", "results/passkey")
    passkey.add_argument(
        "--depths", type=option(parse_depths), default="0.1,0.5,0.9", help="relative key positions in [0, 1] "
        "(default: %(default)s)"
    )
    passkey.add_argument(
        "--trials", type=int_at_least(1, MAX_TRIALS), default=2, help="keys per cell (default: %(default)s)"
    )
    passkey.add_argument("--seed", type=option(seed), default=0, help="chooses the keys (default: %(default)s)")
    passkey.set_defaults(func=command("evaluate", "cmd_eval_passkey"))

    ruler = evaluate.add_parser("ruler", help="RULER's synthetic tasks (needles, variable tracking, common and "
                                "frequent words), offline")
    add_model_options(ruler, "none,yarn:factor=2", "4k,8k", "results/ruler")
    ruler.add_argument(
        "--tasks", type=option(task_list), default="all",
        help="comma-separated RULER tasks, or all: niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
        "niah_multiquery, vt, cwe, fwe (default: all)",
    )
    ruler.add_argument(
        "--trials", type=int_at_least(1, MAX_TRIALS), default=5, help="samples per task and length (default: "
        "%(default)s)"
    )
    ruler.add_argument(
        "--depths", type=option(parse_depths), default=None, help="the single-needle tasks' needle depths in "
        "[0, 1], one per trial in turn: the heatmap's rows; at most --trials of them (default: 0,0.25,0.5,0.75,1; "
        "fewer trials use the first)"
    )
    ruler.add_argument(
        "--threshold", type=option(percent), default=None, help="the score (0-100) a length must keep for the "
        "effective length (default: the unpatched model's average at the shortest length; RULER's is 85.6)"
    )
    ruler.add_argument(
        "--text-files", nargs="+", type=option(file_list),
        help="plain-text files for the haystack of the text tasks (RULER's essays; default: the King James Bible)"
    )
    ruler.add_argument("--seed", type=option(seed), default=0, help="chooses the samples (default: %(default)s)")
    ruler.set_defaults(func=command("evaluate", "cmd_eval_ruler"))

    tune = sub.add_parser(
        "finetune", parents=[config_parser(FinetuneConfig)], help="fine-tune a patched model for a longer context (LoRA via peft, PoSE, S2-Attn; accelerate)",
        description="Fine-tune a patched model (rope_ext.train). Options come from --config (YAML) and flags; a re-run "
        "with the same options resumes from the folder's newest checkpoint. Runs under `accelerate launch` as well.",
    )
    tune.set_defaults(func=command("training", "cmd_finetune"))

    training = sub.add_parser(
        "train", parents=[config_parser(TrainConfig)], help="train a small model from scratch under a position method (GPT-2, Llama, T5 or DeBERTa; accelerate)",
        description="Train a small model built from a config (rope_ext.train.pretrain: GPT-2, Llama, T5 or DeBERTa) "
        "under a position method "
        "(alibi, kerple, sandwich, fire, xpos...), to test it past its training length. Options come from --config "
        "(YAML) and flags; a re-run with the same options resumes. Runs under `accelerate launch` as well.",
    )
    training.set_defaults(func=command("training", "cmd_train"))

    merging = sub.add_parser("merge", help="merge a fine-tune's LoRA adapter into its base: a standalone patched model")
    merging.add_argument("folder", type=option(nonempty), help="the --out folder of rope-ext finetune")
    merging.add_argument("out", type=option(writable_folder), help="where the merged model is written")
    merging.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")
    merging.add_argument("--target", choices=[t for t in TARGETS if t != "llama.cpp"], help="write it for a serving "
                         "engine in one go (rope-ext export's folder: the adapter merged, the engine's keys, the serving "
                         "command; --overwrite then replaces only a folder an export wrote); llama.cpp takes a GGUF: "
                         "merge, convert with convert_hf_to_gguf.py, then rope-ext export it")
    merging.set_defaults(func=command("training", "cmd_merge"))

    corpus = sub.add_parser(
        "corpus", help="the offline texts (Debian packages): list them, fetch them, write them as plain-text files"
    )
    corpus.add_argument(
        "out", nargs="?", type=option(writable_folder),
        help="write the texts here, OUT/<text>/<document> (for --text-files), with corpus.json; without it, list them",
    )
    corpus.add_argument("--texts", type=option(nonempty), help="comma-separated texts (default: every one)")
    corpus.add_argument(
        "--fetch", action="store_true", help="first download and unpack the texts' missing packages (apt-get "
        "download and dpkg-deb, no root: into $ROPE_EXT_TEXTS, default ~/.cache/rope_ext/texts)",
    )
    corpus.add_argument("--overwrite", action="store_true", help="replace a corpus folder written before")
    corpus.set_defaults(func=command("corpus", "cmd_corpus"))

    exporting = sub.add_parser(
        "export", help="write a patched model for a serving engine (transformers, vLLM, SGLang, llama.cpp), or refuse "
        "with the reason and what it can serve",
    )
    exporting.add_argument("model", type=option(nonempty), help="'default', a model folder (saved patched: its patch), "
                           "a fine-tune folder (its adapter merged), a hub id; llama.cpp: a .gguf file or 'default'")
    exporting.add_argument("out", type=option(writable_folder), help="the folder written")
    exporting.add_argument("--target", required=True, choices=TARGETS, help="the engine that serves it")
    exporting.add_argument("--methods", type=option(nonempty), help="the patch, one spec ('+' combines kinds; none: "
                           "no patch) (default: the one the folder was saved with)")
    exporting.add_argument("--max-length", type=option(parse_length), help="the context to serve (default: the one "
                           "the patch opens, s L)")
    exporting.add_argument("--layout", choices=("rope_parameters", "rope_scaling"), default="rope_parameters",
                           help="transformers 5's rope_parameters, or the legacy rope_scaling with a top-level "
                           "rope_theta (readers on transformers 4) (default: %(default)s)")
    exporting.add_argument("--allow-approximate", action="store_true", help="write the closest config where the "
                           "engine computes another rotation (the difference is printed and recorded)")
    exporting.add_argument("--overwrite", action="store_true", help="replace a folder an export wrote")
    exporting.set_defaults(func=command("serving", "cmd_export"))

    doctor = sub.add_parser("doctor", help="what each engine computes from a model's config or GGUF, mismatches "
                            "first (exit 1 on a mismatch)")
    doctor.add_argument("source", type=option(nonempty), help="a model folder, a config.json, a .gguf file, a hub id")
    doctor.set_defaults(func=command("serving", "cmd_doctor"))

    plot = sub.add_parser("plot", help="draw the plots of a results folder")
    plot.add_argument("results", type=option(nonempty), help="a results folder (the --out of rope-ext eval)")
    plot.set_defaults(func=command("evaluate", "cmd_plot"))
    return parser



def _silence_stdout() -> None:
    """After a closed pipe (``rope-ext families | head -1``): send what is left to /dev/null, so the
    interpreter's final flush does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


#: what an interrupted command keeps, by command
CHECKPOINT_KEPT = "the newest checkpoint (checkpoints/, every --save-every steps) is kept: re-run the same command to " \
                  "resume from it"
INTERRUPTED = {"finetune": CHECKPOINT_KEPT, "train": CHECKPOINT_KEPT,
               "eval": "records written so far are kept: re-run to resume"}


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return 128 + getattr(signal, "SIGPIPE", 13)  # what the shell reports for a tool killed by SIGPIPE
    except KeyboardInterrupt:
        kept = INTERRUPTED.get(getattr(args, "command", None))
        print(f"rope-ext: interrupted{f' ({kept})' if kept else ''}", file=sys.stderr)
        return 130
    except (UsageError, ValueError, OSError) as error:
        print(f"rope-ext: error: {error}", file=sys.stderr)
        return 2



if __name__ == "__main__":
    sys.exit(main())
