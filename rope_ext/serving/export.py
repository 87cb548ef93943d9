"""``rope-ext export``: write what a serving engine reads so that it serves the model as its patch computes it.

The source is a model (``default``, a folder, a hub id, a fine-tune folder: its adapter merged) patched as it was
saved or with ``methods``; for llama.cpp a GGUF file (``default``: the default model's). The plan
(``rope_ext.serving.plan``) says what to write and is checked by the engine's reader before anything is written;
the output folder is written whole (a temporary folder renamed) with ``export.json`` (what was exported, the plan,
the serving command). HF targets get the unpatched weights, the tokenizer and the config with the target's keys (no
``rope_ext`` block: engines ignore it, and rope_ext would patch again on top); llama.cpp gets the GGUF with its keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from rope_ext.runs.atomic import written_whole
from rope_ext.runs.folder import is_finetune_folder, within
from rope_ext.runs.saved import SavedPatch, saved_with_patch
from rope_ext.serving.doctor import OK, diagnose
from rope_ext.serving.plan import (
    APPROXIMATE,
    REFUSED,
    TARGETS,
    TargetPlan,
    applied,
    has_rope,
    target_plan,
)
from rope_ext.serving.saved import config_from_gguf

EXPORT_FILE = "export.json"
#: the GGUF key an export writes (llama.cpp ignores it): the methods, so a second export from that file is refused
EXPORTED_KEY = "rope_ext.methods"
LAYOUTS = ("rope_parameters", "rope_scaling")


def check_out(out: Path, overwrite: bool) -> None:
    """An output folder that is new or empty, or, with ``overwrite``, one an export wrote (it holds export.json)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a folder")
    if out.exists() and any(out.iterdir()):
        if not (out / EXPORT_FILE).is_file():
            raise ValueError(f"{out} is not empty and holds no {EXPORT_FILE}: give a new folder")
        if not overwrite:
            raise ValueError(f"{out} holds an export: pass --overwrite to replace it, or give a new folder")


def gguf_source(source: str) -> Path:
    """The GGUF file a llama.cpp export starts from: ``default`` (the default model's), or a ``.gguf`` file."""
    if source == "default":
        from rope_ext.runs.models import default_model_path

        folder, name = default_model_path()
        return Path(folder) / name
    path = Path(source)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(
            f"--target llama.cpp starts from a GGUF file (or 'default'), not {source!r}: convert the model first with "
            "llama.cpp's convert_hf_to_gguf.py (after `rope-ext merge` for a fine-tune), then export that file"
        )
    return path


def export_spec(methods: str | None) -> list | None:
    """``--methods``: one spec (``a+b`` combines kinds); ``none``: no patch (``[]``); ``None`` or ``saved``: the
    folder's own patch."""
    from rope_ext.runs.specs import parse_methods

    if methods is None:
        return None
    specs = parse_methods(methods)
    if len(specs) > 1:
        raise ValueError(f"--methods {methods!r}: an export serves one spec ('+' combines methods of different kinds, "
                         "yarn:factor=4+dca); export once per spec")
    return list(next(iter(specs.values())))


def load_patched(source: str, methods: str | None):
    """The source model and its tokenizer, patched as saved, or with ``methods`` (``none``: unpatched; a folder saved
    patched and other methods: refused), and the patch's resolved methods."""
    from rope_ext.core import get_patch, patch, unpatch
    from rope_ext.runs.models import load_model

    configs = export_spec(methods)  # (a bad spec refused before the model loads)
    model, tokenizer = load_model(source)
    if configs is not None and not isinstance(configs, SavedPatch):
        if get_patch(model) is not None:
            if configs:
                raise ValueError(f"{source} was saved patched ({get_patch(model)}); leave --methods out to export that "
                                 "patch, or give the unpatched base model")
            unpatch(model)  # (none: the model as it was before the patch)
        if configs:
            patch(model, configs)
    found = get_patch(model, resolved=True)
    return model, tokenizer, () if found is None else found if isinstance(found, tuple) else (found,)


def serving_commands(plan: TargetPlan, out: Path, gguf_name: str | None = None, base: str | None = None) -> list[str]:
    """The command lines that serve the export; for vLLM and SGLang also the base model served as it is with the
    plan's keys as overrides (``base``: a folder or hub id whose weights are the export's)."""
    n = plan.max_length
    overrides = json.dumps(plan.config, separators=(",", ":"))
    if plan.target == "vllm":
        context = f" --max-model-len {n}" if n else ""
        return [f"vllm serve {out}{context}"] + ([f"vllm serve {base} --hf-overrides '{overrides}'{context}"]
                                                 if base else [])
    if plan.target == "sglang":
        context = f" --context-length {n}" if n else ""
        launch = "python -m sglang.launch_server --model-path"
        return [f"{launch} {out}{context}"] + ([f"{launch} {base} --json-model-override-args '{overrides}'{context}"]
                                               if base else [])
    if plan.target == "llama.cpp":
        model = out / (gguf_name or "model.gguf")
        if plan.flags:  # (Self-Extend: llama-completion only)
            return [f"llama-completion -m {model} -c {n} {' '.join(plan.flags)} -p PROMPT"]
        kinds = {str: "str", float: "float", int: "int", bool: "bool"}
        override = " ".join(f"--override-kv {key}={kinds[type(value)]}:{value}" for key, value in plan.gguf.items()
                            if type(value) in kinds)
        return [f"llama-server -m {model} -c {n}"] + ([f"llama-server -m {base} -c {n} {override}"] if base else [])
    stated = plan.config.get("max_position_embeddings", n)
    return [f"AutoModelForCausalLM.from_pretrained({str(out)!r})  # plain transformers; max_position_embeddings {stated}"]


def export(source: str, out: str | os.PathLike, target: str, methods: str | None = None,
           max_length: int | None = None, layout: str = "rope_parameters", allow_approximate: bool = False,
           overwrite: bool = False) -> dict[str, Any]:
    """Export ``source`` for ``target``; the record written to ``export.json`` (its ``commands`` serve it)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    out = Path(out).absolute()
    check_out(out, overwrite)
    if source != "default" and os.path.exists(source):
        source = os.path.abspath(source)
        inside = within(out, source) or within(source, out) if os.path.isdir(source) else within(source, out)
        if inside:
            raise ValueError(f"{out} is the source, inside it or holds it; write the export to another folder")
    if target == "llama.cpp":
        from rope_ext.serving.gguf_io import read_metadata

        if layout != "rope_parameters":
            raise ValueError("--layout is for config.json (transformers, vllm, sglang); a GGUF has its own keys")

        path = gguf_source(source)
        if not methods:
            raise ValueError("--target llama.cpp: give --methods (a GGUF file records no rope_ext patch)")
        configs = tuple(export_spec(methods))
        metadata = read_metadata(path)
        arch = metadata.get("general.architecture")
        if EXPORTED_KEY in metadata:  # (an export of ours: its base or scaling is changed already)
            raise ValueError(f"{source} was written by rope-ext export ({metadata[EXPORTED_KEY]}): export from the "
                             "original GGUF")
        scaling = metadata.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none") and metadata.get(f"{arch}.rope.scaling.factor", 1.0) not in (0, 1, 1.0):
            raise ValueError(f"{source} is scaled already (rope.scaling.type {scaling}, factor "
                             f"{metadata[f'{arch}.rope.scaling.factor']:g}): export from the unscaled GGUF")
        config, model, tokenizer = config_from_gguf(metadata), None, None
    else:
        from rope_ext.core import unpatch

        model, tokenizer, configs = load_patched(source, methods)
        if configs:
            unpatch(model)  # (the weights and config engines read: the patch is stated in the target's keys)
        config, metadata = model.config.to_dict(), None
    plan = target_plan(config, configs, target, max_length, layout, metadata)
    if plan.status == REFUSED:
        instead = f"; servable instead: {plan.alternative}" if plan.alternative else ""
        raise ValueError(f"{target} cannot serve this patch: {plan.reason}{instead}")
    if plan.status == APPROXIMATE and not allow_approximate:
        raise ValueError(f"{plan.reason}; pass --allow-approximate to write it anyway"
                         + (f", or export {plan.alternative} (exact)" if plan.alternative else ""))
    record = {
        "source": source, "target": target, "layout": layout,
        "methods": [method.to_dict() for method in configs],
        "plan": dataclasses.asdict(plan),
    }
    with written_whole(out, f".{out.name}-") as work_path:
        gguf_name = None
        if target == "llama.cpp":
            from rope_ext.serving.gguf_io import write_with_metadata

            gguf_name = path.name
            marker = {EXPORTED_KEY: json.dumps([method.to_dict() for method in configs])}
            write_with_metadata(path, work_path / gguf_name, {**plan.gguf, **marker}, tensors=plan.tensors)
        else:
            model.save_pretrained(work_path)
            tokenizer.save_pretrained(work_path)
            written = json.loads((work_path / "config.json").read_text())
            (work_path / "config.json").write_text(json.dumps(applied(written, plan.config), indent=2) + "\n")
        if target == "llama.cpp":
            base = str(path)
        else:
            base = None if source == "default" or is_finetune_folder(source) or saved_with_patch(source) else source
        record["commands"] = serving_commands(plan, out, gguf_name, base)
        (work_path / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")
        # what the other engines make of it (rope-ext doctor on the folder: their differences are warnings here)
        source_file = work_path / gguf_name if gguf_name else work_path
        record["other_engines"] = [f"{finding.engine}: {finding.message}" for finding in diagnose(str(source_file))
                                   if finding.level != OK and finding.engine != target] if has_rope(config) else []
        (work_path / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record
