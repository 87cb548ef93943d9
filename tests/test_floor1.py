"""Floor 1 (methods and attention, pure torch) as an extension surface: option checks declared once per option, a
window rule added from outside on the public base, fast runners registered per rule class (and the general path for
a class without one), and a bias that declares its key-only form. No model is loaded here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from rope_ext.attention import blocks, plain, rules
from rope_ext.attention.program import AttentionProgram, Bias, Call, PositionRule, kernel_override
from rope_ext.attention.reference import program_reference
from rope_ext.methods import (
    MAX_FACTOR,
    KeyOnlyBias,
    MethodConfig,
    PositionRuleConfig,
    Region,
    WindowConfig,
    WindowRule,
    get_method_class,
    list_methods,
    make_config,
    option,
)
from rope_ext.methods.biases import AlibiBias
from rope_ext.methods.options import CHECK, integer, positive

L = 64


def _own_methods() -> list[str]:
    """The methods rope_ext defines (not toys another test module registered)."""
    return [name for name in list_methods() if get_method_class(name).__module__.startswith("rope_ext.")]


def _factor_methods() -> list[str]:
    return [name for name in _own_methods() if "factor" in get_method_class(name).option_names()]


def _valid(cls: type[MethodConfig], **changes) -> dict:
    """Options that make a valid config of ``cls`` (its required ones), with ``changes``."""
    base = {"factor": 2.0, "long_factor": [1.0, 1.0], "clamp_len": 8}
    return {**{k: v for k, v in base.items() if k in cls.option_names()}, **changes}


def _message(method: str, **options) -> str:
    cls = get_method_class(method)
    with pytest.raises(ValueError) as error:
        make_config(method, **_valid(cls, **options))
    return str(error.value)


# --- option checks, declared once -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", _own_methods())
def test_every_option_declares_its_check_on_its_field(method):
    fields = dataclasses.fields(get_method_class(method))
    assert fields and all(CHECK in field.metadata for field in fields), [f.name for f in fields if CHECK not in f.metadata]


@pytest.mark.parametrize("method", _own_methods())
def test_every_refused_option_gives_one_line_naming_the_option_and_its_range(method):
    for name in get_method_class(method).option_names():
        message = _message(method, **{name: object()})
        assert "\n" not in message
        assert message.startswith(f"{method}: {name}") and " must be " in message and "got <object" in message, message


@pytest.mark.parametrize("method", _factor_methods())
def test_factor_zero_and_below_one_and_above_the_bound_give_one_message(method):
    """Factor 0 used to say "> 0" while 0.5 said ">= 1"; 1e30 was taken (a 33-digit max_position_embeddings)."""
    messages = {value: _message(method, factor=value) for value in (0, 0.5, -3.0, float("nan"), 1e30, MAX_FACTOR * 2)}
    ranges = {text.split(", got ")[0] for text in messages.values()}
    assert len(ranges) == 1, ranges
    (stated,) = ranges
    assert stated.startswith(f"{method}: factor must be a number >= 1 and <= 1e6 (") and stated.endswith("1 is the identity)")
    assert messages[0].endswith("got 0; " + messages[0.5].split("got 0.5; ")[1])  # (what a factor below 1 would do)
    assert messages[1e30].endswith("got 1e+30")
    assert make_config(method, **_valid(get_method_class(method), factor=MAX_FACTOR)).factor == MAX_FACTOR
    assert make_config(method, **_valid(get_method_class(method), factor=1)).factor == 1


def test_a_required_factor_says_it_is_required_with_an_example():
    for method in ("yarn", "t5_bucket_scale", "xlnet_interp"):
        with pytest.raises(ValueError, match=rf"^{method}: factor is required \(.*e\.g\. {method}:factor=4 for 4x; "):
            make_config(method)


def test_a_config_added_from_outside_declares_its_checks_and_keeps_its_own_rules():
    @dataclass(frozen=True)
    class Toy(MethodConfig):
        method: ClassVar[str] = "toy_options"
        hook: ClassVar[str] = "toy"

        width: int = option(4, integer(2))
        scale: float | None = option(None, positive(optional=True))

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.scale is not None and self.scale > self.width:
                raise ValueError(f"{self.method}: scale={self.scale} must be at most width={self.width}")

    assert Toy(width=np_int(6)).width == 6 and type(Toy(width=np_int(6)).width) is int  # (numpy scalars taken first)
    with pytest.raises(ValueError, match=r"^toy_options: width must be an int >= 2, got 1$"):
        Toy(width=1)
    with pytest.raises(ValueError, match=r"^toy_options: scale must be a finite number > 0, got -1$"):
        Toy(scale=-1)
    with pytest.raises(ValueError, match=r"^toy_options: scale=5 must be at most width=4$"):
        Toy(scale=5)


def np_int(value: int):
    import numpy as np

    return np.int64(value)


# --- attention programs run without a model -------------------------------------------------------------------


class _Rotation:
    """A rotary source for a position rule: fixed frequencies, attention factor 1."""

    def __init__(self, dim: int = 16) -> None:
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))

    def frequencies(self, position_ids, layer_type, device):
        return self.inv_freq.to(device), 1.0


def _qkv(n: int = 3 * L // 2, seed: int = 0):
    torch.manual_seed(seed)
    return torch.randn(2, 4, n, 16), torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16)


def _run(program: AttentionProgram, **call) -> tuple[torch.Tensor, torch.Tensor]:
    """The program's kernel and the plain reference on the same call."""
    q, k, v = _qkv()
    fast = program.run(Call(program, q, k, v, 0.25, **call))
    with kernel_override(program_reference):
        reference = program.run(Call(program, q, k, v, 0.25, **call))
    return fast, reference


def _rule_program(rule) -> AttentionProgram:
    return AttentionProgram(terms=[PositionRule(rule, _Rotation(), None, L)])


@dataclass(frozen=True)
class HalfSlope(WindowRule):
    """A window rule written from outside: ``rel`` below ``w``, then ``w + (rel - w) / 2``."""

    method: ClassVar[str] = "toy_half_slope"

    def far_query(self, i):
        return self.w / 2 + i / 2

    def far_key(self, j):
        return j / 2

    def relative(self, i, j):  # (written apart from far_query / far_key)
        rel = i - j
        return torch.where(rel < self.w, rel, self.w + (rel - self.w) / 2)


@dataclass(frozen=True)
class Halved(PositionRuleConfig):
    """A rule that is no window: every distance halved (the query and the key at half their positions)."""

    method: ClassVar[str] = "toy_halved"

    def relative(self, i, j):
        return (i - j) / 2

    def regions(self):
        return [Region(None, lambda i: i / 2, lambda j: j / 2)]


def _counting(counts: dict, name: str, fn):
    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)

    return counted


@pytest.fixture
def paths(monkeypatch):
    """Counts of the general path (``blocks.masked_blocks``) and of the registered fast runners."""
    counts: dict[str, int] = {}
    monkeypatch.setattr(blocks, "masked_blocks", _counting(counts, "general", blocks.masked_blocks))
    for cls, runner in list(rules.FAST_RUNNERS.items()):
        monkeypatch.setitem(rules.FAST_RUNNERS, cls, _counting(counts, runner.__name__, runner))
    return counts


def test_a_window_rule_on_the_public_base_resolves_w_and_runs_on_the_window_runner(paths):
    rule = HalfSlope().resolved(L)
    assert rule.w == L // 4 and rule.window == L // 4 and isinstance(rule, WindowConfig)
    with pytest.raises(ValueError, match=r"^toy_half_slope: w must be an int >= 1, got 0$"):
        HalfSlope(w=0)
    with pytest.raises(ValueError, match=rf"^toy_half_slope: w={L} must be below the original context L \({L}\)"):
        HalfSlope(w=L).resolved(L)
    assert rules.fast_runner_for(rule) is rules.FAST_RUNNERS[WindowConfig]
    fast, reference = _run(_rule_program(rule))
    assert paths == {"window": 1}
    torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)
    plain_rope, _ = _run(_rule_program(None))
    assert (fast - plain_rope).abs().max() > 1e-3  # (the far region's rotation is not plain RoPE's)


def test_a_window_rule_gets_the_fast_runner_it_registers(paths):
    seen = []

    def half_slope_runner(acc, rule, *args, **kwargs):
        seen.append(rule)
        return rules.window(acc, rule, *args, **kwargs)

    rules.register_fast_runner(HalfSlope)(half_slope_runner)
    try:
        with pytest.raises(ValueError, match="a fast runner for HalfSlope is registered already"):
            rules.register_fast_runner(HalfSlope, half_slope_runner)
        rule = HalfSlope(w=9).resolved(L)
        assert rules.fast_runner_for(rule) is half_slope_runner  # (its own, before its base class's)
        fast, reference = _run(_rule_program(rule))
        assert seen == [rule] and "general" not in paths and "window" not in paths
        torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)
    finally:
        rules.unregister_fast_runner(HalfSlope)
    assert rules.fast_runner_for(HalfSlope(w=9)) is rules.FAST_RUNNERS[WindowConfig]


def test_a_rule_class_without_a_fast_runner_takes_the_general_path(paths):
    rule = Halved().resolved(L)
    assert rules.fast_runner_for(rule) is None
    fast, reference = _run(_rule_program(rule))
    assert paths == {"general": 1}
    torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="no fast runner is registered for Halved"):
        rules.unregister_fast_runner(Halved)


def test_rows_with_jumps_take_the_general_path_even_with_a_fast_runner(paths):
    n = 3 * L // 2
    jumps = torch.cat([torch.arange(20), torch.arange(20, n) + 50])[None]
    fast, reference = _run(_rule_program(HalfSlope(w=7).resolved(L)), position_ids=jumps)
    assert paths == {"general": 2}  # (one per row: positions given)
    torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)


# --- a bias that declares its key-only form --------------------------------------------------------------------


class ToyLinearBias(Bias, KeyOnlyBias):
    """``-m_h |i - j|`` (ALiBi's form with slopes of its own), declaring its key-only form ``m_h (j - c)``."""

    name = "toy linear bias"

    def __init__(self, slopes: list[float]) -> None:
        self.slopes = torch.tensor(slopes)
        self.key_calls = 0

    def bias(self, q_pos, k_pos):
        return -self.slopes[:, None, None] * (q_pos[:, None] - k_pos[None]).abs()[None]

    def key_bias(self, c, k_pos):
        self.key_calls += 1
        return self.slopes[:, None, None] * (k_pos - c)[None, None]


class ToyUndeclaredBias(Bias):
    name = "toy bias"

    def bias(self, q_pos, k_pos):
        return -0.3 * (q_pos[:, None] - k_pos[None]).abs()[None]


def test_a_toy_bias_declaring_the_key_only_form_is_run_through_it(monkeypatch):
    monkeypatch.setattr(plain, "KEY_BIAS_FAR_BLOCK", 40)  # (several far blocks and squares at 96 queries)
    monkeypatch.setattr(plain, "KEY_BIAS_BLOCK", 16)
    term = ToyLinearBias([0.5, 0.25, 0.125, 0.0625])
    program = AttentionProgram(terms=[term])
    assert term.has_key_bias
    fast, reference = _run(program)
    assert term.key_calls > 0  # (the kernel added the key part, one row per query block)
    torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)
    q, k, v = _qkv()
    assert isinstance(plain.key_bias_function(Call(program, q, k, v, 0.25)), plain.KeyBias)


def test_a_bias_without_the_declaration_is_run_whole():
    term = ToyUndeclaredBias()
    program = AttentionProgram(terms=[term])
    q, k, v = _qkv()
    assert not term.has_key_bias and plain.key_bias_function(Call(program, q, k, v, 0.25)) is None
    assert plain.key_bias_function(Call(AttentionProgram(terms=[term, ToyLinearBias([1.0] * 4)]), q, k, v, 0.25)) is None
    fast, reference = _run(program)
    torch.testing.assert_close(fast, reference, rtol=0, atol=2e-5)


def test_declaring_a_key_only_form_without_key_bias_is_refused_when_the_class_is_defined():
    with pytest.raises(TypeError, match="Forgetful declares a key-only bias \\(KeyOnlyBias\\) but defines no key_bias"):

        class Forgetful(Bias, KeyOnlyBias):
            def bias(self, q_pos, k_pos):
                return torch.zeros(1, len(q_pos), len(k_pos))

    assert issubclass(AlibiBias, KeyOnlyBias)  # (ALiBi's module declares its form; the others do not)
    assert not any(issubclass(type(make_config(m).module(4, head_dim=8)), KeyOnlyBias) for m in ("sandwich", "kerple"))
    assert math.isclose(float(AlibiBias([0.5]).key_bias(torch.tensor(2.0), torch.tensor([0.0, 4.0]))[0, 0, 1]), 1.0)
