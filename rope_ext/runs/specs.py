"""Method lists as runs give them: ``--methods`` of an evaluation (a comma list of specs to compare, ``saved``
among them) and of a training run (one spec), parsed into method configs."""

from __future__ import annotations

from rope_ext.methods import MethodConfig, make_configs
from rope_ext.methods.spec import parse_spec, split_spec
from rope_ext.runs.saved import SavedPatch


def parse_method_spec(spec: str) -> list[MethodConfig]:
    """``"yarn:factor=4:beta_fast=16"`` -> ``[YarnConfig(factor=4, beta_fast=16)]``; ``"none"`` -> ``[]``;
    ``"a:x=1+b:y=2"`` -> both configs (a combination for ``rope_ext.patch``: one method per hook kind)."""

    text = spec.strip()
    if text == "none":
        return []
    if any(name == "none" for name, _ in parse_spec(text)):
        raise ValueError(f"'none' (the unpatched model) takes no options and combines with nothing, got {spec!r}")
    return list(make_configs(text))


def parse_methods(text: str) -> dict[str, list[MethodConfig]]:
    """``"none,yarn:factor=4"`` -> ``{"none": [], "yarn:factor=4": [YarnConfig(factor=4)]}``; commas inside
    brackets belong to a value (``longrope:long_factor=[1,1.5]``). A method given twice, or spelled twice with
    equal configs (``yarn:factor=4,yarn:factor=4.0``), is refused, naming it."""
    specs = [spec.strip() for spec in split_spec(text, ",")]
    if not any(specs):
        raise ValueError("give at least one method, e.g. none,yarn:factor=4")
    if not all(specs):
        raise ValueError(f"an empty method spec in {text!r} (two commas in a row, or one at an end); give each method "
                         "once")
    for before, spec in zip(specs, specs[1:]):
        name = parse_spec(spec)[0][0] if spec else ""
        if "=" in name:  # "self_extend:G=4,W=16": an option after a comma, read as a method
            raise ValueError(
                f"{spec!r} after {before!r} is an option, not a method: options are separated by ':' "
                f"({before}:{spec}); commas separate methods"
            )
    methods: dict[str, list[MethodConfig]] = {}
    for spec in specs:
        configs = SavedPatch() if spec == SavedPatch.SPEC else parse_method_spec(spec)
        same = next((given for given, before in methods.items() if given == spec or (
            type(before) is type(configs) and list(before) == list(configs))), None)
        if same is not None:  # (two spellings of one patch: yarn:factor=4 and yarn:factor=4.0)
            spelled = "" if same == spec else f" ({same} and {spec}: the same configs)"
            raise ValueError(f"method {same!r} is given twice in {text!r}{spelled}; give each method once, e.g. "
                             "none,yarn:factor=4")
        methods[spec] = configs
    return methods


def one_spec(methods: str) -> list[MethodConfig]:
    """The configs of a run's ``--methods``: one spec in the evaluation's syntax (``yarn:factor=4+dca``), not the
    evaluation's comma list of specs to compare."""
    try:
        specs = parse_methods(methods)
    except ValueError as error:  # (from a YAML file as well: the message names the option)
        raise ValueError(f"--methods {methods!r}: {error}") from None
    if len(specs) > 1:  # (after its own errors: empty specs, an option after a comma)
        raise ValueError(
            f"--methods {methods!r}: a run trains under one spec; '+' joins methods of different kinds "
            "(yarn:factor=4+dca); run once per method to compare them"
        )
    return parse_method_spec(methods)



def listed_spec(specs: list) -> str:
    """A YAML file's ``methods`` given as a list, read as the flag's comma list (``[a, b]`` is ``a,b``: specs to
    compare), so a run takes a list of one spec; several are refused, saying how to combine them."""
    names = [str(spec) for spec in specs]
    if not names:
        raise ValueError("an empty list; give one spec, e.g. methods: yarn:factor=4 (none: the unpatched model)")
    if len(names) > 1:
        combined = "+".join(name for name in names if name != "none") or "none"  # ('none' combines with nothing)
        raise ValueError(
            f"a list is the evaluation's specs to compare ({', '.join(names)}), and a run trains under one spec; write "
            f"one text, '+' joining methods of different kinds (methods: {combined}), or run once per method"
        )
    return names[0]
