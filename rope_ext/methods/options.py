"""Option checks, declared once per option on the config's field.

A method config declares each option's valid values where it declares the option::

    w: int | None = option(None, integer(1, optional=True), meaning="the window: plain RoPE below it; None: L/4")

and ``MethodConfig.__post_init__`` runs every field's check, in field order, before the config's own rules that
relate several options (``beta_fast > beta_slow``). A refused value raises ``ValueError`` with one line naming the
valid range: ``"<method>: <option> must be <range>, got <value>"``. A check may normalise what it accepts (a list
of floats becomes a tuple). The option's ``meaning`` (one line: what it sets, and what ``None`` means where it may
be ``None``) is what ``rope-ext methods NAME`` prints under it.

Pure Python: imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the largest ``factor`` a method takes (a context extended a million times): beyond it the lengths a patch
#: writes overflow any sensible config (``factor=1e30`` made a 33-digit ``max_position_embeddings``)
MAX_FACTOR = 1e6
#: the keys of a field's check and of its meaning in its ``metadata``
CHECK = "rope_ext.check"
MEANING = "rope_ext.meaning"


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def _limit(value: float) -> str:
    return f"{value:.0e}".replace("e+0", "e") if value >= 1e5 else f"{value:g}"


@dataclass(frozen=True)
class Check:
    """The valid values of one option: those ``accepts`` takes, named by ``phrase`` (``"an int >= 1"``).

    ``optional``: ``None`` means "not given" (derived when patching, or unused) and passes; ``required``: the
    message's tail for a ``None`` that does not (``"{method}"`` filled in); ``label`` follows the option's name
    and ``hint`` the range, each in parentheses; ``convert`` normalises an accepted value."""

    phrase: str
    accepts: Callable[[Any], bool]
    optional: bool = False
    required: str = ""
    label: str = ""
    hint: str = ""
    convert: Callable[[Any], Any] | None = None

    def __call__(self, method: str, name: str, value: Any) -> Any:
        """``value`` (normalised) if valid, else ``ValueError`` naming the valid range."""
        if value is None and self.optional:
            return None
        if value is None and self.required:
            raise ValueError(f"{method}: {name} is required{self.required.format(method=method)}")
        if not self.accepts(value):
            raise ValueError(self.message(method, name, value))
        return value if self.convert is None else self.convert(value)

    def message(self, method: str, name: str, value: Any) -> str:
        label = f" ({self.label})" if self.label else ""
        hint = f" ({self.hint})" if self.hint else ""
        return f"{method}: {name}{label} must be {self.phrase}{hint}, got {value!r}"


@dataclass(frozen=True)
class FactorCheck(Check):
    """``factor``: ``1 .. MAX_FACTOR`` (1 the identity); a factor below 1 is refused saying what it would do."""

    below: str = ""

    def message(self, method: str, name: str, value: Any) -> str:
        tail = f"; a factor below 1 would {self.below}" if _number(value) and value < 1 and self.below else ""
        return super().message(method, name, value) + tail


@dataclass(frozen=True)
class ListCheck(Check):
    """A non-empty list of numbers, each one valid for ``entry`` (refused as ``every <name> entry``, or
    ``entries``); kept as a tuple of floats."""

    entry: Check | None = None
    entries: str = ""

    def __call__(self, method: str, name: str, value: Any) -> Any:
        value = super().__call__(method, name, value)
        if value is None:
            return None
        for item in value:
            self.entry(method, self.entries or f"every {name} entry", item)
        return tuple(float(item) for item in value)


def option(default: Any, check: Check, *, meaning: str = "", **kwargs: Any) -> Any:
    """A config field whose values ``check`` accepts and whose ``meaning`` says what it sets (other
    ``dataclasses.field`` arguments pass through)."""
    return dataclasses.field(default=default, metadata={CHECK: check, MEANING: meaning}, **kwargs)


def meaning_of(field: dataclasses.Field) -> str:
    """A config field's declared meaning (``""``: none declared)."""
    return field.metadata.get(MEANING, "")


def check_options(config: Any) -> None:
    """Every field's declared check on ``config``, in field order; an accepted value is stored as its check
    normalised it."""
    for field in dataclasses.fields(config):
        check = field.metadata.get(CHECK)
        if check is None:
            continue
        value = getattr(config, field.name)
        accepted = check(config.method, field.name, value)
        if accepted is not value:
            object.__setattr__(config, field.name, accepted)


# --- the checks the configs declare --------------------------------------------------------------------


def positive(*, optional: bool = False) -> Check:
    return Check("a finite number > 0", lambda v: _number(v) and v > 0, optional)


def at_least(low: float, *, label: str = "") -> Check:
    """A finite number ``>= low``."""
    return Check(f"a finite number >= {low}", lambda v: _number(v) and v >= low, label=label)


def interval(
    low: float, high: float | None = None, *, low_open: bool = True, high_open: bool = False, hint: str = ""
) -> Check:
    """A finite number in ``(low, high]`` (``[`` and ``)`` as asked; ``high=None``: no upper bound)."""
    left, right = "(" if low_open else "[", ")" if high is None or high_open else "]"
    phrase = f"a {'finite ' if high is None else ''}number in {left}{low}, {'inf' if high is None else high}{right}"

    def accepts(v: Any) -> bool:
        if not _number(v) or (v <= low if low_open else v < low):
            return False
        return high is None or (v < high if high_open else v <= high)

    return Check(phrase, accepts, hint=hint)


def integer(low: int, *, optional: bool = False, even: bool = False, hint: str = "") -> Check:
    """An int ``>= low`` (``even``: and even)."""
    phrase = f"an {'even ' if even else ''}int >= {low}"
    return Check(phrase, lambda v: _int(v) and v >= low and (not even or v % 2 == 0), optional, hint=hint)


def any_integer() -> Check:
    return Check("an int", _int)


def flag() -> Check:
    return Check("True or False", lambda v: isinstance(v, bool))


def one_of(*choices: str) -> Check:
    return Check(f"one of {', '.join(choices)}", lambda v: isinstance(v, str) and v in choices)


def context_length() -> Check:
    """``original_max_position_embeddings``: an int ``>= 2``, ``None`` for the rotation's or the model's."""
    return integer(2, optional=True)


def factor_range(meaning: str, below: str, *, required: bool = True) -> FactorCheck:
    """``factor``, ``1 .. MAX_FACTOR``: ``meaning`` says what it scales, ``below`` what a factor below 1 would do;
    ``required``: ``None`` is refused as not given."""
    return FactorCheck(
        f"a number >= 1 and <= {_limit(MAX_FACTOR)}",
        lambda v: _number(v) and 1 <= v <= MAX_FACTOR,
        required=f" ({meaning}, e.g. {{method}}:factor=4 for 4x; factor 1 is the identity)" if required else "",
        hint=f"{meaning}; 1 is the identity",
        below=below,
    )


def number_list(entry: Check, *, phrase: str = "a non-empty list of floats", optional: bool = False,
                required: str = "", entries: str = "") -> ListCheck:
    return ListCheck(
        phrase, lambda v: isinstance(v, (list, tuple)) and len(v) > 0, optional, required, entry=entry, entries=entries
    )
