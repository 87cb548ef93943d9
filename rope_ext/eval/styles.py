"""How a method is drawn in the evaluations' plots: grouped by kind (frequency methods blue circles, position rules
orange squares, biases green diamonds...), each kind's methods in shades of its colour, the unpatched model black."""

from __future__ import annotations

from typing import Any

#: the colour map and marker of each kind of method (its first hook kind): methods of one kind share a hue and a
#: marker, told apart by the shade and the line style; the unpatched model black
KIND_STYLES = {"frequency": ("Blues", "o"), "position_rule": ("Oranges", "s"), "query_scale": ("Purples", "^"),
               "bias": ("Greens", "D"), "pair_scale": ("Reds", "v"), "wrapper": ("Greys", "P"),
               "absolute": ("BuGn", "X"), "bucket": ("YlOrBr", "h"), "log_bucket": ("YlOrBr", "h"),
               "distance": ("PuRd", "*")}
LINE_STYLES = ("-", "--", "-.", ":")


def method_kind(spec: str) -> str:
    """The kind a method spec's line is drawn as: ``none``, the hook kind of its first method, or ``other`` (a spec
    rope_ext does not parse: a saved patch, a label)."""
    if spec == "none":
        return "none"
    try:
        from rope_ext.methods import make_configs

        return make_configs(spec)[0].hook
    except (ValueError, TypeError, KeyError, IndexError):
        return "other"


def method_styles(methods: list[str]) -> dict[str, tuple[Any, str, str]]:
    """``{method: (colour, marker, line style)}``: grouped by kind (``KIND_STYLES``), each kind's methods in shades of
    its colour map from dark to light, line styles in turn."""
    from matplotlib import colormaps

    kinds = {method: method_kind(method) for method in methods}
    styles = {}
    for kind in dict.fromkeys(kinds.values()):
        members = [m for m in methods if kinds[m] == kind]
        name, marker = KIND_STYLES.get(kind, ("Greys", "x"))
        for index, method in enumerate(members):
            if kind == "none":
                styles[method] = ("black", "o", "-")
                continue
            shade = 0.9 - 0.55 * index / max(1, len(members) - 1) if len(members) > 1 else 0.75
            styles[method] = (colormaps[name](shade), marker, LINE_STYLES[index % len(LINE_STYLES)])
    return styles
