"""``rope-ext doctor``: what each engine computes from a model's config (or a GGUF's keys), and where they disagree.

Every engine's reader (``rope_ext.serving.engines``) runs on the same config at a short request (inside the original
context) and at the longest context the config states; each engine's cos/sin (attention factor included) are
compared with the reference's (transformers for a config, llama.cpp for a GGUF) beyond float32 rounding. Also
reported: keys an engine drops, a context each engine derives differently, ``factor`` against
``max_position_embeddings / original_max_position_embeddings`` (transformers #38224), ``type`` against ``rope_type``,
and a ``rope_ext`` block that engines do not read. A folder written by ``rope-ext export`` names its target: the
other engines' differences are then expected (they are warnings, as the export said).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rope_ext.serving.plan import (
    DCA_MODEL_TYPES,
    has_rope,
    probe_lengths,
    probe_positions,
    rope_dict,
    rotary_spec,
    rotation_gap,
)
from rope_ext.serving.saved import config_from_gguf, plain_transformers_gap

MISMATCH, WARNING, OK = "mismatch", "warning", "ok"
ORDER = {MISMATCH: 0, WARNING: 1, OK: 2}


@dataclass
class Finding:
    level: str
    engine: str
    message: str


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON model config ({error})") from None
    if not isinstance(data, dict) or not ({"hidden_size", "num_attention_heads", "model_type"} & set(data)):
        raise ValueError(f"{path}: not a model config (no model_type, hidden_size or num_attention_heads)")
    for key in ("rope_parameters", "rope_scaling"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ValueError(f"{path}: {key} must be an object (a JSON dict) or null, not {data[key]!r}")
    return data


def read_source(source: str) -> tuple[str, dict, dict | None]:
    """``("config", config.json, export.json or None)`` for a folder or a config.json, ``("gguf", keys, export.json
    or None)`` for a .gguf file or a folder holding one (a llama.cpp export), or a hub id's config (online, or in the
    local cache)."""
    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"{source} holds no config.json{' and several .gguf files' if ggufs else ''}; give a model "
                             "folder, a config.json or a .gguf file")
        path = ggufs[0]
    if path.suffix == ".gguf" and path.is_file():
        from rope_ext.serving.gguf_io import read_metadata, read_rope_factors

        export = path.parent / "export.json"  # (the export that wrote it, if any)
        try:
            metadata = {**read_metadata(path), **read_rope_factors(path)}
        except Exception as error:  # noqa: BLE001  (gguf's reader: its own errors for a file that is not GGUF)
            raise ValueError(f"{path}: not a GGUF file ({error})") from None
        return "gguf", metadata, json.loads(export.read_text()) if export.is_file() else None
    if path.is_dir():
        export = path / "export.json"
        record = json.loads(export.read_text()) if export.is_file() else None
        return "config", read_json(path / "config.json"), record
    if path.is_file():
        return "config", read_json(path), None
    try:
        from transformers import AutoConfig

        return "config", AutoConfig.from_pretrained(source).to_dict(), None
    except (OSError, ValueError) as error:
        raise ValueError(f"{source}: not a folder, a config.json, a .gguf file or a reachable hub id ({error})") from None


def rotations(kind: str, data: dict, positions: torch.Tensor, n: int) -> dict[str, object]:
    """Each engine's ``Rotation`` (or the error that stops it) for requests of ``n`` tokens."""
    from rope_ext.serving.engines import hf, llamacpp, sglang, vllm

    if kind == "gguf":
        readers = {"llama.cpp": lambda: llamacpp.rotation(data, positions, n_ctx=n),
                   "transformers": lambda: hf.rotation(config_from_gguf(data), positions)}
    else:
        from rope_ext.serving.gguf_io import hf_to_gguf_rope
        from rope_ext.serving.plan import gguf_metadata

        def converted():
            params = rope_dict(data)
            if params["rope_type"] == "llama3":  # (convert_hf_to_gguf.py writes the factors as rope_freqs.weight)
                keys = {"llama.rope.scaling.type": "none", "rope_freqs.weight": llama3_freq_factors(data).tolist()}
            else:
                keys = hf_to_gguf_rope(params, data["max_position_embeddings"], "llama")
            return llamacpp.rotation({**gguf_metadata(data), **keys}, positions, n_ctx=n)

        readers = {"transformers": lambda: hf.rotation(data, positions),
                   "vllm": lambda: vllm.rotation(data, positions, max_model_len=n),
                   "sglang": lambda: sglang.rotation(data, positions, max_model_len=n),
                   "llama.cpp": converted}
    out: dict[str, object] = {}
    for engine, read in readers.items():
        try:
            out[engine] = read()
        except KeyError as error:
            out[engine] = ValueError(f"the config lacks {error.args[0]!r}")
        except TypeError as error:
            out[engine] = ValueError(f"a value of the wrong type in the config ({error})")
        except Exception as error:  # noqa: BLE001  (an engine's config class refusing it is a finding, not a crash)
            out[engine] = error
    return out


def llama3_freq_factors(config: dict) -> torch.Tensor:
    """The per-frequency divisors of Llama 3's rotation, as llama.cpp's converter writes them (``rope_freqs.weight``:
    the default frequencies over Llama 3's)."""
    from rope_ext.methods import make_config
    from rope_ext.methods.frequency import default_inv_freq

    params = rope_dict(config)
    spec = rotary_spec(config)
    method = make_config("llama3", factor=params["factor"], low_freq_factor=params["low_freq_factor"],
                         high_freq_factor=params["high_freq_factor"])
    inv_freq, _ = method.frequencies(spec)
    return default_inv_freq(spec.base, spec.dim).double() / inv_freq.double()


def static_checks(config: dict, folder: str | None = None) -> list[Finding]:
    params = rope_dict(config)
    found = []
    scaling = config.get("rope_scaling") or {}
    if "type" in scaling and "rope_type" in scaling and scaling["type"] != scaling["rope_type"]:
        found.append(Finding(MISMATCH, "config", f"rope_scaling.type {scaling['type']!r} and rope_type "
                             f"{scaling['rope_type']!r} disagree: engines read one or the other"))
    factor, original = params.get("factor"), params.get("original_max_position_embeddings")
    longest = config.get("max_position_embeddings")
    scaled = factor and original and longest and params.get("rope_type") == "yarn"  # (Llama 3's factor is not that)
    if scaled and abs(longest / original - factor) > 1e-6:
        found.append(Finding(WARNING, "config", f"factor {factor:g} but max_position_embeddings / original_max_"
                                 f"position_embeddings = {longest}/{original} = {longest / original:g}: transformers "
                                 "before #40320 and some engines take the factor from that ratio (transformers #38224); "
                                 f"set max_position_embeddings = {round(factor * original)}"))
    if isinstance(config.get("rope_ext"), dict):
        methods = "+".join(m.get("method", "?") for m in config["rope_ext"].get("methods", []))
        found.append(Finding(WARNING, "config", f"a rope_ext block ({methods}): only rope_ext.from_pretrained reads it; "
                             "the engines serve the rope keys below (`rope-ext export` writes each engine's)"))
        gap = plain_transformers_gap(folder) if folder else None
        if gap:
            found.append(Finding(WARNING, "config", f"served unextended without rope_ext: {gap}"))
    return found


def diagnose(source: str) -> list[Finding]:
    """The findings for ``source``, mismatches first."""
    kind, data, export = read_source(source)
    if kind == "config" and not has_rope(data):
        raise ValueError(f"{source}: a {data.get('model_type')} config states no rotary embedding; nothing to compare")
    folder = source if kind == "config" and Path(source).is_dir() else None
    findings = static_checks(data, folder) if kind == "config" else []
    if kind == "gguf":
        arch = data["general.architecture"]
        reference, longest = "llama.cpp", int(data[f"{arch}.context_length"])
    else:
        reference, longest = "transformers", int(data.get("max_position_embeddings") or 4096)
    target = (export or {}).get("target")
    saved = kind == "config" and isinstance(data.get("rope_ext"), dict)  # (save_pretrained while patched)
    if saved and target is None:
        target = "transformers"  # (what save_pretrained writes: transformers' keys; an engine's: rope-ext export)
    original = int(rope_dict(data).get("original_max_position_embeddings") or longest) if kind == "config" else longest
    dca_engines = ()  # (their own dual chunk attention: its positions are not one rotation to compare)
    if kind == "config" and data.get("dual_chunk_attention_config") and data.get("model_type") in DCA_MODEL_TYPES:
        dca_engines = ("vllm", "sglang")
        findings.append(Finding(OK, "vllm, sglang", "dual chunk attention (dual_chunk_attention_config): their own "
                                "kernel, not compared here; transformers and llama.cpp ignore the key"))
    worst: dict[str, float] = {}
    lengths: dict[str, int | None] = {}
    for n in probe_lengths(original, longest):
        positions = probe_positions(n)
        found = rotations(kind, data, positions, n)
        ref = found[reference]
        for engine, rotation in found.items():
            if isinstance(rotation, Exception):
                worst[engine] = float("inf")
                lengths[engine] = None
                level = WARNING if target and engine != target else MISMATCH
                why = f" (written for {target})" if level == WARNING else ""
                if n == longest:  # (once)
                    findings.append(Finding(level, engine, f"cannot serve it: {rotation}{why}"))
                continue
            lengths[engine] = rotation.max_length
            if n == longest:
                findings += [Finding(WARNING, engine, f"ignores {line}") for line in rotation.ignored]
                findings += [Finding(OK, engine, note) for note in rotation.notes]
            if isinstance(ref, Exception) or engine == reference or engine in dca_engines:
                continue
            gap = rotation_gap(ref.cos, ref.sin, rotation, positions)
            if gap:
                worst[engine] = max(worst.get(engine, 0.0), gap)
    for engine, gap in worst.items():
        if gap == float("inf") and lengths.get(engine) is None:
            continue  # (said above)
        level = WARNING if target and engine != target else MISMATCH
        why = ""
        if level == WARNING:
            why = (f" (saved by rope_ext for transformers: `rope-ext export --target {engine}` writes {engine}'s keys)"
                   if saved and export is None else f" (the export is for {target})")
        if kind == "gguf" and engine == "transformers":
            why += "; transformers' GGUF loader reads no rope.scaling key, so it loads this file unscaled"
        findings.append(Finding(level, engine, f"computes another rotation than {reference}: cos/sin differ by up to "
                                f"{gap:.3g} at up to {longest} tokens{why}"))
    for engine in lengths:
        if engine not in worst and engine != reference:
            findings.append(Finding(OK, engine, f"the same rotation as {reference} (checked at up to {longest} tokens)"))
    stated = {engine: length for engine, length in lengths.items() if length is not None}
    if len(set(stated.values())) > 1:
        findings.append(Finding(WARNING, "context", "the longest context each serves by default differs: "
                                + ", ".join(f"{engine} {length}" for engine, length in stated.items())))
    return sorted(findings, key=lambda finding: ORDER[finding.level])


def render(findings: list[Finding]) -> str:
    return "\n".join(f"{finding.level.upper():8} {finding.engine:12} {finding.message}" for finding in findings)
