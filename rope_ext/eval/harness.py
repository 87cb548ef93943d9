"""The lm-evaluation-harness bridge (lm-eval 0.4; ``pip install rope-ext[lm-eval]``): a model patched by rope_ext
evaluated by lm-eval as its own Hugging Face model (``HFLM``), with the context the patch opens.

* From Python: ``harness_model(model, tokenizer)`` wraps a patched model for ``lm_eval.simple_evaluate``.
* From the command line: lm-eval finds no model types outside its own package (no plugin entry points), so
  ``rope-ext-lm-eval`` is lm-eval's own command line with ``rope_ext`` registered first::

      rope-ext-lm-eval run --model rope_ext --model_args pretrained=default,methods=yarn:factor=2 \\
          --tasks niah_single_1 --metadata '{"max_seq_lengths": [16384]}'

  ``pretrained`` is what ``rope-ext eval --model`` takes ('default', a folder, a hub id online), ``methods`` one
  spec (a ``+`` combination; ``none``: unpatched), ``replace_scaling``, ``dtype``, ``device`` (``--device`` of lm-eval
  too); every other argument is ``HFLM``'s (``batch_size``, ``max_length``, ...). RULER's tasks in lm-eval generate
  their data with a tokenizer they load by name (``tokenizer=`` of ``--model_args``): ``rope-ext-lm-eval`` adds the
  model's folder there (the default model's tokenizer saved to one).

The context (``max_length``, lm-eval's truncation of every request) is the one the patch was made for: the longest
length its methods reach (a frequency method's ``factor x L``); unpatched, the config's ``max_position_embeddings``;
a patch that follows any length (dynamic methods, DCA) needs ``max_length`` given, which always wins.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from torch import nn

#: the model type ``rope-ext-lm-eval`` registers
MODEL_TYPE = "rope_ext"


def patched_context(model: nn.Module) -> int | None:
    """The longest context the active patch was made for (``rope_ext.core.patched_length``); unpatched, the config's
    ``max_position_embeddings``; ``None`` for a patch that follows any length (dynamic methods, DCA's chunks): then
    ``max_length`` is the user's to give."""
    import rope_ext
    from rope_ext.core import patched_length

    if rope_ext.get_patch(model) is not None:
        return patched_length(model)
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


def context(model: nn.Module, max_length: int | None) -> int:
    """``max_length`` as given, else the patch's context (``patched_context``), refused where neither says one."""
    length = max_length or patched_context(model)
    if length is None:
        raise ValueError("this patch follows any length (a dynamic method, DCA's chunks): give max_length, the "
                         "longest context lm-eval may give the model")
    return int(length)


def tokenizer_folder(pretrained: str) -> str:
    """A folder holding ``pretrained``'s tokenizer, for lm-eval's tasks that load one by name (RULER's): a model folder
    itself; the default model's (read from its GGUF) saved once under ``~/.cache/rope_ext``."""
    if pretrained != "default":
        return pretrained
    from rope_ext.runs.models import load_default_tokenizer

    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rope_ext" / "default-tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        load_default_tokenizer().save_pretrained(folder)
    return str(folder)


def harness_model(model: nn.Module, tokenizer: Any, *, max_length: int | None = None, batch_size: int = 1,
                  **kwargs: Any) -> Any:
    """``model`` (patched or not) as lm-eval's ``HFLM``, its ``max_length`` the patch's context unless given."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, max_length=context(model, max_length), batch_size=batch_size,
                **kwargs)


def register() -> type:
    """Register the ``rope_ext`` model type with lm-eval (once) and return its class."""
    from lm_eval.api.registry import MODEL_REGISTRY, register_model
    from lm_eval.models.huggingface import HFLM

    if MODEL_TYPE in MODEL_REGISTRY:
        return MODEL_REGISTRY[MODEL_TYPE]

    class RopeExtLM(HFLM):
        """A model loaded and patched by rope_ext (``pretrained``, ``methods``), evaluated as lm-eval's HF model."""

        def __init__(self, pretrained: str = "default", methods: str = "none", replace_scaling: bool = False,
                     dtype: str = "float32", device: str | None = "cpu", max_length: int | None = None,
                     **kwargs: Any) -> None:
            import torch

            import rope_ext
            from rope_ext.runs.devices import parse_device, placed
            from rope_ext.runs.models import load_model
            from rope_ext.runs.specs import parse_methods

            if dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"dtype={dtype!r}: give float32, bfloat16 or float16")
            model, tokenizer = load_model(str(pretrained), dtype=getattr(torch, dtype))
            specs = parse_methods(str(methods))
            if len(specs) != 1:
                raise ValueError(f"methods={methods!r}: one method spec a model ('+' combines methods), not a list")
            (configs,) = specs.values()
            if configs:
                rope_ext.patch(model, configs, **({"replace_scaling": True} if replace_scaling else {}))
            model = placed(model, parse_device(str(device or "cpu")))
            kwargs.pop("tokenizer", None)  # (the model's own; lm-eval's RULER reads a name of it from the metadata)
            super().__init__(pretrained=model, tokenizer=tokenizer, max_length=context(model, max_length), **kwargs)

    return register_model(MODEL_TYPE)(RopeExtLM)


def with_tokenizer(argv: list[str]) -> list[str]:
    """lm-eval's arguments with ``tokenizer=<folder>`` added to a ``rope_ext`` model's ``--model_args`` that names
    none (RULER's tasks load the tokenizer named there; ``pretrained=default`` names no folder)."""
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg])]
    if "--model_args" not in argv or MODEL_TYPE not in argv:  # (``--model_args=...`` split as lm-eval reads it)
        return argv
    at = argv.index("--model_args") + 1
    if at >= len(argv):
        return argv
    pairs = dict(part.split("=", 1) for part in argv[at].split(",") if "=" in part)
    if "tokenizer" not in pairs:
        argv[at] += f",tokenizer={tokenizer_folder(pairs.get('pretrained', 'default'))}"
    return argv


def main(argv: list[str] | None = None) -> None:
    """``rope-ext-lm-eval``: lm-eval's command line, with the ``rope_ext`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    register()
    try:
        sys.argv = ["lm_eval", *with_tokenizer(sys.argv[1:] if argv is None else argv)]
        cli_evaluate()
    except (ValueError, OSError) as error:  # (the rope_ext model's own refusals: one line, as rope-ext's)
        if argv is not None:
            raise
        print(f"rope-ext-lm-eval: error: {str(error).strip().splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
