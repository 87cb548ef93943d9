"""Typed, validated method configs and the method registry.

Every method is a dataclass whose options declare their valid values on their fields (``rope_ext.methods.options``:
a refused value raises ``ValueError`` naming the valid range), and which round-trips through ``to_dict``/``from_dict``
(and so through ``config.json``). A config declares
the *hook kind* it needs; family adapters declare which hook kinds they support (see ``rope_ext.families``).

This package is pure math: it imports torch, never transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from rope_ext.methods.options import check_options, meaning_of
from rope_ext.methods.spec import parse_spec, split_spec
from rope_ext.registry import Registry

#: The hook kind of the frequency methods. Each kind has an installer in ``rope_ext.installers``; the position-rule,
#: bias and absolute-table methods bring kinds of their own (``position_rule``, ``bias``, ``absolute``).
HOOK_FREQUENCY = "frequency"
#: The hook kinds of the position rules (the attention rewrites: ReRoPE, Self-Extend, DCA, STRING), of query scaling
#: and of wrappers around the whole attention call (S2-Attn; ``rope_ext.methods.position_rules``, ``query_scales``,
#: ``wrappers``). ``HOOK_ATTENTION`` (``"attention"``) is the position rules' name before 0.2: the attention module
#: is a *site* kind, which every kind here uses (``get_hook("attention")`` still finds the installer).
HOOK_POSITION_RULE = "position_rule"
HOOK_ATTENTION = HOOK_POSITION_RULE
HOOK_QUERY_SCALE = "query_scale"
HOOK_WRAPPER = "wrapper"
#: The hook kinds of the additive biases (ALiBi...; ``rope_ext.methods.biases``) and of the learned absolute tables
#: read past their rows (``rope_ext.methods.absolute``).
HOOK_BIAS = "bias"
HOOK_ABSOLUTE = "absolute"
#: The hook kind of xPos: a per-pair scale of queries and keys on top of RoPE (``rope_ext.methods.xpos``).
HOOK_PAIR_SCALE = "pair_scale"
#: The hook kind of T5's relative-position buckets read past their trained distances (``rope_ext.methods.buckets``).
HOOK_BUCKET = "bucket"
#: The hook kind of DeBERTa's log-bucketed relative positions remapped (``rope_ext.methods.buckets``).
HOOK_LOG_BUCKET = "log_bucket"
#: The hook kind of XLNet's sinusoidal relative distances remapped (``rope_ext.methods.distances``).
HOOK_DISTANCE = "distance"

_METHODS: Registry[type[MethodConfig]] = Registry("method", "valid methods")


def register_method(cls: type[MethodConfig]) -> type[MethodConfig]:
    """Class decorator: make ``cls`` available under ``cls.method``."""
    return _METHODS.register(cls.method, cls)


def unregister_method(name: str) -> None:
    _METHODS.unregister(name)


def list_methods() -> list[str]:
    """Registered method names, sorted."""
    return _METHODS.names()


def get_method_class(name: str) -> type[MethodConfig]:
    return _METHODS.get(name)


def undocumented(cls: type[MethodConfig]) -> list[str]:
    """What a method config leaves without a description in ``rope-ext methods``: ``"summary"`` when the class does
    not declare its own, and each option without a declared meaning (``option(..., meaning=...)``)."""
    missing = [] if str(cls.__dict__.get("summary", "")).strip() else ["summary"]
    return missing + [field.name for field in dataclasses.fields(cls) if not meaning_of(field).strip()]


def methods_with_hooks(kinds: Any) -> list[str]:
    """Registered methods whose hook kind is one of ``kinds`` (a kind's name, or a collection of them), sorted."""
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    return [name for name in list_methods() if get_method_class(name).hook in kinds]


def make_config(method: MethodConfig | str | dict[str, Any], **kwargs: Any) -> MethodConfig:
    """Build a method config from a name plus keyword arguments, a spec such as ``"yarn:factor=4"``
    (``rope_ext.methods.spec``; plus keyword arguments for other options), a dict with a ``"method"`` key (plus
    keyword arguments for other options), or a config (keyword arguments replace its fields, as
    ``dataclasses.replace`` does)."""
    if isinstance(method, MethodConfig):
        if kwargs:
            return MethodConfig.from_dict({**method.to_dict(), **kwargs})
        return method
    if isinstance(method, dict):
        if not isinstance(method.get("method"), str):
            raise ValueError(
                f"a method dict needs a 'method' key naming one method, got {method.get('method')!r}; valid methods: "
                f"{', '.join(list_methods())}"
            )
        twice = sorted(set(method) & set(kwargs))
        if twice:
            raise ValueError(f"option(s) {', '.join(twice)} given both in {method!r} and as keyword arguments")
        return MethodConfig.from_dict({**method, **kwargs})
    if isinstance(method, str):
        parts = parse_spec(method)
        if len(parts) > 1:
            raise ValueError(
                f"{method!r} combines {len(parts)} methods; pass it to rope_ext.patch or make_configs (one config each)"
            )
        (name, options), = parts
        twice = sorted(set(options) & set(kwargs))
        if twice:
            raise ValueError(f"option(s) {', '.join(twice)} given both in {method!r} and as keyword arguments")
        return get_method_class(name)._build({**options, **kwargs})
    raise TypeError(
        f"method must be a name or spec ('yarn:factor=4'), a dict with a 'method' key, a method config or a list of "
        f"those, not "
        f"{type(method).__name__} {method!r:.60}; valid methods: {', '.join(list_methods())}"
    )


def make_configs(method: Any, **kwargs: Any) -> tuple[MethodConfig, ...]:
    """One config, or several from a list or a ``"+"`` spec such as ``"yarn:factor=4+dca"`` (a combination: at
    most one method per hook kind; a list may hold such specs too).

    Options given as keyword arguments go to the method that has them (an option of several methods of a
    combination goes inside its own dict, config or spec). A combination's configs come in ``HOOK_ORDER``.
    """
    if isinstance(method, str) and len(parse_spec(method)) > 1:
        method = [method]
    if not isinstance(method, (list, tuple)):
        return (make_config(method, **kwargs),)
    method = [part for item in method for part in (split_spec(item.strip(), "+") if isinstance(item, str) else [item])]
    if not method:
        raise ValueError(f"give at least one method; valid methods: {', '.join(list_methods())}")
    if len(method) == 1:
        return (make_config(method[0], **kwargs),)
    configs = tuple(make_config(item, **options) for item, options in zip(method, _share_options(method, kwargs)))
    kinds: dict[str, str] = {}
    for config in configs:
        if config.hook in kinds:
            raise ValueError(
                f"methods {kinds[config.hook]!r} and {config.method!r} are both {config.hook!r} methods; a combination "
                "takes at most one method per hook kind"
            )
        kinds[config.hook] = config.method
    return tuple(sorted(configs, key=lambda config: _hook_rank(config.hook)))


#: the order of a combination's configs (``get_patch``, saved configs): the position encoding, then the attention
#: computed with it, then what scales it, then what wraps the whole call (its installer sees the others' terms);
#: kinds not listed follow in the order given
HOOK_ORDER = (
    HOOK_FREQUENCY, HOOK_ABSOLUTE, HOOK_BUCKET, HOOK_LOG_BUCKET, HOOK_DISTANCE, HOOK_BIAS, HOOK_POSITION_RULE,
    HOOK_PAIR_SCALE, HOOK_QUERY_SCALE, HOOK_WRAPPER,
)


def _hook_rank(hook: str) -> int:
    return HOOK_ORDER.index(hook) if hook in HOOK_ORDER else len(HOOK_ORDER)


def _method_class(item: Any) -> type[MethodConfig]:
    if isinstance(item, MethodConfig):
        return type(item)
    if isinstance(item, dict) and "method" in item:
        return get_method_class(item["method"])
    if isinstance(item, str):
        return get_method_class(parse_spec(item)[0][0])
    return type(make_config(item))  # (raises what make_config says of an item that names no method)


#: options that describe the model rather than a method: a combination gives them to every method that has them
SHARED_OPTIONS = frozenset({"original_max_position_embeddings"})


def _share_options(items: list[Any], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Keyword options of a combination, each to the one method that has it (``"yarn+dca", factor=4``)."""
    shares: list[dict[str, Any]] = [{} for _ in items]
    if not kwargs:
        return shares
    classes = [_method_class(item) for item in items]
    for key, value in kwargs.items():
        takers = [i for i, cls in enumerate(classes) if key in cls.option_names()]
        takers = takers or [i for i, cls in enumerate(classes) if key in cls.renamed_options]  # (an old name)
        if key in SHARED_OPTIONS and takers:  # one fact about the model: every method that has it takes it
            users = [i for i in takers if key not in classes[i].unused_shared_options]
            for i in users or takers:  # (only methods that do not use it: let the method say so)
                shares[i][key] = value
            continue
        if len(takers) != 1:
            where = "; ".join(f"{cls.method}: {', '.join(cls.option_names())}" for cls in classes)
            problem = "is an option of none" if not takers else "is ambiguous: an option of several"
            raise ValueError(
                f"{key} {problem} of the methods combined ({where}); give each method's options in its own dict, "
                'config or spec, e.g. [{"method": "yarn", "factor": 4}, "logn"] or "yarn:factor=4+logn"'
            )
        shares[takers[0]][key] = value
    return shares


def plain_value(value: Any) -> Any:
    """A numpy scalar or a 0-d tensor as the Python number it holds (``np.int64(8)`` -> ``8``), an array or a tensor
    as a list of numbers; lists and tuples element by element; anything else as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(plain_value(v) for v in value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and callable(getattr(value, "item", None)):
        return value.item()
    if shape is not None and callable(getattr(value, "tolist", None)):  # an array or tensor: its numbers, as a list
        return value.tolist()
    return value


def _plain_fields(config: Any) -> None:
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        plain = plain_value(value)
        if plain is not value:
            object.__setattr__(config, field.name, plain)


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method config.

    Options given as numpy scalars or 0-d tensors (``w=np.int64(8)``) are taken as the Python numbers they hold
    before a config checks them (and so round-trip through ``config.json``). Each option's valid values are
    declared on its field (``option(default, check)``, ``rope_ext.methods.options``) and checked here, in field
    order; a subclass with rules between options checks them in its own ``__post_init__`` after
    ``super().__post_init__()``."""

    method: ClassVar[str]
    hook: ClassVar[str]
    #: what the method does, in one or two sentences naming its paper (``rope-ext methods`` prints it; the list, its
    #: first sentence); each option's meaning is declared on its field
    summary: ClassVar[str] = ""
    #: options of ``SHARED_OPTIONS`` this method has but refuses: a combination's keyword passes it by
    unused_shared_options: ClassVar[frozenset[str]] = frozenset()
    #: options whose ``None`` default means "not given" and is refused (a required ``factor``), not derived when
    #: patching
    required_options: ClassVar[frozenset[str]] = frozenset()
    #: options renamed, by their old names: a spec, a dict or a saved config that uses an old name still builds
    renamed_options: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        _plain_fields(self)
        check_options(self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "_plain_first", False):

            def __post_init__(self, _own=own) -> None:
                _plain_fields(self)
                _own(self)

            __post_init__._plain_first = True  # type: ignore[attr-defined]
            cls.__post_init__ = __post_init__

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def option_names(cls) -> list[str]:
        """The options, the method's own first and the shared ones (``L``) after them, as listings show them."""
        names = [f.name for f in dataclasses.fields(cls)]
        return [n for n in names if n not in SHARED_OPTIONS] + [n for n in names if n in SHARED_OPTIONS]

    @staticmethod
    def from_dict(data: dict[str, Any]) -> MethodConfig:
        data = dict(data)
        cls = get_method_class(data.pop("method"))
        return cls._build(data)

    @classmethod
    def _build(cls, kwargs: dict[str, Any]) -> MethodConfig:
        kwargs = dict(kwargs)
        for old, new in cls.renamed_options.items():
            if old in kwargs:
                if new in kwargs:
                    raise ValueError(f"{cls.method}: {old} is the old name of {new}; give {new} alone")
                kwargs[new] = kwargs.pop(old)
        names = cls.option_names()
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"{cls.method}: unknown option(s) {', '.join(unknown)}; valid options: {', '.join(names)}")
        return cls(**kwargs)


# --- checks against the model a method is resolved for --------------------------------------------


def check_length_within(method: str, requested: int | None, native: int | None, extended_by: Any = None) -> None:
    """A stated ``L`` may not exceed the model config's original context, or, for a rule on an extended rotation
    (``extended_by``, the frequency method), the context that rotation handles (``native`` is then that one)."""
    if requested and native and requested > native:
        what = (f"the context {native} that {extended_by.method}:factor={extended_by.factor:g} handles"
                if extended_by is not None else f"the model's original context {native} (from its config)")
        raise ValueError(f"{method}: original_max_position_embeddings={requested} exceeds {what}; valid: 2..{native}")

