"""A GGUF's metadata: reading it fast, rewriting it with the tensors kept byte for byte, and the rope keys llama.cpp
reads for transformers' ``rope_parameters`` (``hf_to_gguf_rope``), so an extended model exports to llama.cpp/ollama.

* ``read_metadata``: the key/value pairs as Python values (arrays as lists; arrays longer than ``max_array``, the
  tokenizer's, as a lazy ``GGUFArray``) from the header alone, without mapping the tensors.
* ``write_with_metadata``: a copy with keys changed, added or removed, through ``gguf``'s ``GGUFReader`` and
  ``GGUFWriter``; the rope keys get the types llama.cpp's loader checks (``float32`` factors and bases,
  ``uint32`` lengths, a string type, a bool ``finetuned``), other new keys a type from their value. Written to a
  temporary file beside ``dst`` and renamed over it: nothing half-written is left on error.
* transformers 5.23 reloads a GGUF (``modeling_gguf_pytorch_utils.load_gguf_checkpoint``) with ``context_length``
  as ``max_position_embeddings`` and ``rope.freq_base`` as ``rope_theta`` but reads no ``rope.scaling.*`` key
  (only for gpt-oss, through ``field.parts[0]``, the key's length rather than its value), so an extended GGUF
  reloads in transformers as plain RoPE at the longer ``max_position_embeddings``.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from rope_ext.serving.engines.llamacpp import FACTOR_TENSORS, YARN_KEY_ARCHS, YARN_LOG_MUL_DIVISORS, mscale

ARCHITECTURE = "general.architecture"
KEY_TYPES = {
    "context_length": GGUFValueType.UINT32,
    "rope.dimension_count": GGUFValueType.UINT32,
    "rope.freq_base": GGUFValueType.FLOAT32,
    "rope.scaling.type": GGUFValueType.STRING,
    "rope.scaling.factor": GGUFValueType.FLOAT32,
    "rope.scaling.attn_factor": GGUFValueType.FLOAT32,
    "rope.scaling.original_context_length": GGUFValueType.UINT32,
    "rope.scaling.finetuned": GGUFValueType.BOOL,
    "rope.scaling.yarn_log_multiplier": GGUFValueType.FLOAT32,
    "rope.scaling.yarn_ext_factor": GGUFValueType.FLOAT32,
    "rope.scaling.yarn_attn_factor": GGUFValueType.FLOAT32,
    "rope.scaling.yarn_beta_fast": GGUFValueType.FLOAT32,
    "rope.scaling.yarn_beta_slow": GGUFValueType.FLOAT32,
}
UNSERVABLE = {
    "dynamic": "llama.cpp has no dynamic NTK: its rotation is fixed when the context is created (a static NTK base "
               "is rope.freq_base / --rope-freq-base)",
    "llama3": "llama.cpp serves llama3 through the rope_freqs.weight tensor that convert_hf_to_gguf.py writes, "
              "which metadata keys cannot express",
    "longrope": "llama.cpp serves longrope through the rope_factors_long/short.weight tensors that "
                "convert_hf_to_gguf.py writes, and picks long or short once per context from n_ctx, not per "
                "sequence as transformers does",
}
_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFArray:
    """An array left in the file by ``read_metadata``: ``length`` items of ``item_type`` at byte ``offset``."""

    path: str
    offset: int
    item_type: GGUFValueType
    length: int
    byteorder: str = "<"

    def __len__(self) -> int:
        return self.length

    def load(self) -> list:
        """The items, read from the file now."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            cursor = _Cursor(f, self.byteorder, self.path, max_array=self.length)
            return [cursor.value(self.item_type) for _ in range(self.length)]


class _Cursor:
    def __init__(self, f, byteorder: str, path: str, max_array: int) -> None:
        self.f, self.order, self.path, self.max_array = f, byteorder, path, max_array

    def read(self, fmt: str):
        size = struct.calcsize(self.order + fmt)
        data = self.f.read(size)
        if len(data) < size:
            raise ValueError(f"{self.path}: truncated GGUF header")
        return struct.unpack(self.order + fmt, data)[0]

    def string(self) -> str:
        return self.f.read(self.read("Q")).decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.read(_FORMATS[vtype])
        item, length = GGUFValueType(self.read("I")), self.read("Q")
        offset = self.f.tell()
        if length <= self.max_array:
            return [self.value(item) for _ in range(length)]
        self.skip(item, length)
        return GGUFArray(self.path, offset, item, length, self.order)

    def skip(self, item: GGUFValueType, length: int) -> None:
        if item in _FORMATS:
            self.f.seek(length * struct.calcsize(self.order + _FORMATS[item]), os.SEEK_CUR)
            return
        for _ in range(length):
            if item == GGUFValueType.STRING:
                self.f.seek(self.read("Q"), os.SEEK_CUR)
            else:
                self.skip(GGUFValueType(self.read("I")), self.read("Q"))


def read_metadata(path: str | os.PathLike, max_array: int = 1024) -> dict[str, Any]:
    """The GGUF's key/value pairs (``'llama.rope.freq_base': 100000.0``), arrays as lists, arrays longer than
    ``max_array`` as ``GGUFArray`` (``load()`` reads them). Parses the header only."""
    path = str(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        order = "<" if version & 0xFFFF else ">"
        version = version if order == "<" else struct.unpack(">I", struct.pack("<I", version))[0]
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        cursor = _Cursor(f, order, path, max_array)
        cursor.read("Q")
        metadata = {}
        for _ in range(cursor.read("Q")):
            name = cursor.string()
            metadata[name] = cursor.value(GGUFValueType(cursor.read("I")))
    return metadata


def read_rope_factors(path: str | os.PathLike) -> dict[str, list[float]]:
    """The per-frequency factor tensors llama.cpp divides the angles by (``rope_freqs.weight``,
    ``rope_factors_long.weight``, ``rope_factors_short.weight``) present in the file, for ``llamacpp.rotation``."""
    reader = gguf.GGUFReader(path)
    return {t.name: [float(x) for x in t.data.reshape(-1)] for t in reader.tensors if t.name in FACTOR_TENSORS}


def _infer_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple)):
        return GGUFValueType.ARRAY
    raise ValueError(f"no GGUF type for {value!r} ({type(value).__name__})")


def _typed(key: str, value: Any, existing: GGUFValueType | None) -> tuple[Any, GGUFValueType, Any]:
    """``(value, type, sub_type)`` for ``add_key_value``: the rope keys' llama.cpp types, else the key's present
    type, else one from the value; checked so that nothing is written when a value does not fit."""
    suffix = key.split(".", 1)[1] if "." in key else key
    vtype = KEY_TYPES.get(suffix, existing if existing is not None else _infer_type(value))
    fits = {
        GGUFValueType.BOOL: isinstance(value, bool),
        GGUFValueType.STRING: isinstance(value, str),
        GGUFValueType.ARRAY: isinstance(value, (list, tuple)) and len(value) > 0,
    }
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return (float(value), vtype, None) if ok else _refuse(key, value, vtype)
    if vtype in fits:
        if not fits[vtype]:
            _refuse(key, value, vtype)
        sub = _infer_type(value[0]) if vtype == GGUFValueType.ARRAY else None
        return (list(value) if sub else value), vtype, sub
    if isinstance(value, bool) or not isinstance(value, int):
        _refuse(key, value, vtype)
    unsigned = vtype.name.startswith("UINT")
    bits = struct.calcsize(_FORMATS[vtype]) * 8
    low, high = (0, 2**bits) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    return (value, vtype, None) if low <= value < high else _refuse(key, value, vtype)


def _refuse(key: str, value: Any, vtype: GGUFValueType):
    raise ValueError(f"{key}: {value!r} does not fit the GGUF type {vtype.name}")


def write_with_metadata(src: str | os.PathLike, dst: str | os.PathLike, changes: dict[str, Any],
                        removed: list[str] | tuple[str, ...] = (), tensors: dict[str, Any] | None = None) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with the keys in ``changes`` set (changed in place, new ones appended) and
    those in ``removed`` left out, tensors byte for byte, and the float32 ``tensors`` added (Llama 3's
    ``rope_freqs.weight``; one the file has already is refused); atomic (a temporary file renamed over ``dst``)."""
    src, dst = Path(src), Path(dst)
    added = {name: np.asarray(values, dtype=np.float32) for name, values in (tensors or {}).items()}
    removed = set(removed)
    if removed & set(changes):
        raise ValueError(f"keys both changed and removed: {sorted(removed & set(changes))}")
    reader = gguf.GGUFReader(src)
    present = sorted(set(added) & {t.name for t in reader.tensors})
    if present:
        raise ValueError(f"{src} has the tensors {', '.join(present)} already")
    fields = {name: f for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    typed = {k: _typed(k, v, fields[k].types[0] if k in fields else None) for k, v in changes.items()}
    if ARCHITECTURE not in changes and ARCHITECTURE not in fields:
        raise ValueError(f"{src}: no {ARCHITECTURE}, and changes give none")
    arch = str(changes[ARCHITECTURE] if ARCHITECTURE in changes else fields[ARCHITECTURE].contents())
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
        try:
            if "general.alignment" in fields:
                writer.data_alignment = int(fields["general.alignment"].contents())
            for name, field in fields.items():
                if name == ARCHITECTURE or name in removed:
                    continue
                if name in typed:
                    writer.add_key_value(name, *typed.pop(name))
                    continue
                vtype = field.types[0]
                sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
                writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
            for name, (value, vtype, sub) in typed.items():
                if name != ARCHITECTURE:
                    writer.add_key_value(name, value, vtype, sub_type=sub)
            for t in reader.tensors:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            for name, array in added.items():
                writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes, gguf.GGMLQuantizationType.F32)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in reader.tensors:
                writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
            for array in added.values():
                writer.write_tensor_data(array, tensor_endianess=reader.endianess)
        finally:
            writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst


def hf_to_gguf_rope(rope_parameters: dict, max_position_embeddings: int, architecture: str) -> dict[str, Any]:
    """The GGUF keys with which llama.cpp serves transformers' ``rope_parameters`` (``default``, ``linear``,
    ``yarn``) as transformers computes them, for ``write_with_metadata``: ``context_length`` (the longer length,
    llama.cpp's default ``-c``), ``rope.freq_base``, ``rope.scaling.type``/``factor``/``original_context_length``
    and ``rope.scaling.attn_factor`` (always written, so no stale one survives). YaRN's attention factor ``A``
    (``attention_factor``, the ``mscale``/``mscale_all_dim`` ratio, or ``0.1 ln s + 1``) becomes ``attn_factor = A /
    m(s)``, since llama.cpp puts ``m(s) * attn_factor`` on cos/sin. Raises ValueError, with the reason, for what
    llama.cpp cannot serve identically: dynamic, llama3, longrope and other types, YaRN with ``truncate: false``,
    with ``beta_fast``/``beta_slow`` other than 32/1 (no key for most architectures: pass ``--yarn-beta-fast``), or on
    an architecture that reads ``yarn_log_multiplier``."""
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    key = f"{architecture}.{{}}".format
    keys: dict[str, Any] = {key("context_length"): int(max_position_embeddings)}
    if params.get("rope_theta") is not None:
        keys[key("rope.freq_base")] = float(params["rope_theta"])
    if rope_type == "default":
        return keys | {key("rope.scaling.type"): "none", key("rope.scaling.attn_factor"): 1.0}
    if rope_type == "linear":
        if not params.get("factor"):
            raise ValueError("linear: a factor is needed (rope.scaling.factor)")
        return keys | {key("rope.scaling.type"): "linear", key("rope.scaling.factor"): float(params["factor"]),
                       key("rope.scaling.attn_factor"): 1.0}
    if rope_type != "yarn":
        reason = UNSERVABLE.get(rope_type, "llama.cpp's scaling types are none, linear, yarn and longrope")
        raise ValueError(f"rope_type {rope_type!r}: {reason}")
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError("yarn: original_max_position_embeddings is needed (rope.scaling.original_context_length)")
    factor = float(params.get("factor") or max_position_embeddings / original)
    if params.get("truncate", True) is False:
        raise ValueError("yarn: truncate false keeps a fractional ramp; llama.cpp always floors/ceils its ends "
                         "(ggml_rope_yarn_corr_dims)")
    if architecture in YARN_LOG_MUL_DIVISORS:
        raise ValueError(f"yarn on {architecture}: its loader reads rope.scaling.yarn_log_multiplier (DeepSeek's "
                         "mscale_all_dim); write the keys with llama.cpp's convert_hf_to_gguf.py")
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    if architecture in YARN_KEY_ARCHS:
        keys |= {key("rope.scaling.yarn_beta_fast"): beta_fast, key("rope.scaling.yarn_beta_slow"): beta_slow}
    elif (beta_fast, beta_slow) != (32.0, 1.0):
        raise ValueError(f"yarn: beta_fast {beta_fast:g} / beta_slow {beta_slow:g}: llama.cpp reads no "
                         f"rope.scaling.yarn_beta_* key for {architecture} (defaults 32 / 1); serve with "
                         f"--yarn-beta-fast {beta_fast:g} --yarn-beta-slow {beta_slow:g}")
    attention = params.get("attention_factor")
    if attention is None and params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    attention = mscale(factor) if attention is None else float(attention)
    return keys | {
        key("rope.scaling.type"): "yarn",
        key("rope.scaling.factor"): factor,
        key("rope.scaling.original_context_length"): int(original),
        key("rope.scaling.attn_factor"): attention / mscale(factor),
    }
