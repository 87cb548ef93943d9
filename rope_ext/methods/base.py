"""Typed, validated method configs and the method registry.

Every method is a dataclass whose ``__post_init__`` raises ``ValueError`` naming the valid range, and
which round-trips through ``to_dict``/``from_dict`` (and so through ``config.json``). A config declares
the *hook kind* it needs; family adapters declare which hook kinds they support (see ``rope_ext.patches``).

This package is pure math: it imports torch, never transformers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from rope_ext.registry import Registry

#: Hook kinds a method can need. Only ``frequency`` exists so far; ``bias``, ``positions`` and
#: ``attention`` are the kinds the window and bias methods will use.
HOOK_FREQUENCY = "frequency"

_METHODS: Registry[type[MethodConfig]] = Registry("method", "valid methods")


def register_method(cls: type[MethodConfig]) -> type[MethodConfig]:
    """Class decorator: make ``cls`` available under ``cls.method``."""
    return _METHODS.register(cls.method, cls)


def list_methods() -> list[str]:
    """Registered method names, sorted."""
    return _METHODS.names()


def get_method_class(name: str) -> type[MethodConfig]:
    return _METHODS.get(name)


def make_config(method: MethodConfig | str | dict[str, Any], **kwargs: Any) -> MethodConfig:
    """Build a method config from a name plus keyword arguments, a dict with a ``"method"`` key, or a config."""
    if isinstance(method, MethodConfig):
        if kwargs:
            return dataclasses.replace(method, **kwargs)
        return method
    if isinstance(method, dict):
        if "method" not in method:
            raise ValueError(f"a method dict needs a 'method' key; valid methods: {', '.join(list_methods())}")
        return MethodConfig.from_dict({**method, **kwargs})
    if isinstance(method, str):
        cls = get_method_class(method)
        return cls._build(kwargs)
    raise TypeError(f"method must be a name, a dict or a MethodConfig, not {type(method).__name__}")


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method config."""

    method: ClassVar[str]
    hook: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> MethodConfig:
        data = dict(data)
        cls = get_method_class(data.pop("method"))
        return cls._build(data)

    @classmethod
    def _build(cls, kwargs: dict[str, Any]) -> MethodConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"{cls.method}: unknown option(s) {', '.join(unknown)}; valid options: {', '.join(names)}")
        return cls(**kwargs)


# --- validation helpers shared by the configs ------------------------------------------------------


def check_positive(method: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{method}: {name} must be a finite number > 0, got {value!r}")


def check_context_length(method: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{method}: original_max_position_embeddings must be a positive int, got {value!r}")


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    if text.startswith("["):
        return [_parse_value(item.strip()) for item in text.strip("[]").split(";") if item.strip()]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method_spec(spec: str) -> MethodConfig | None:
    """``"yarn:factor=4:beta_fast=16"`` -> ``YarnConfig(factor=4, beta_fast=16)``; ``"none"`` -> ``None``.

    Lists use ``;`` inside brackets: ``longrope:factor=4:long_factor=[1;1.5;2;...]``.
    """
    name, *options = spec.strip().split(":")
    if name == "none":
        if options:
            raise ValueError(f"'none' (the unpatched model) takes no options, got {spec!r}")
        return None
    kwargs: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"malformed method option {option!r} in {spec!r}; expected name:key=value[:key=value]")
        kwargs[key] = _parse_value(value)
    return make_config(name, **kwargs)
