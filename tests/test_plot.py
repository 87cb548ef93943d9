"""The perplexity plot keeps the comparison readable when some methods explode: a second panel zooms on the
methods near the in-window perplexity, and what leaves it (or is inf, which no axis can place) is marked
off-scale with its value."""

from __future__ import annotations

import json
import math

from rope_ext.eval.plot import ZOOM_MULTIPLE, perplexity_figure, plot_perplexity

RUN = {"protocol": "fixed", "model_name": "tiny", "native_context": 1024}
LENGTHS = (1024, 2048, 4096)


def _summary(values: dict[str, tuple[float, ...]]) -> list[dict]:
    return [{"method": method, "length": length, "perplexity": ppl}
            for method, series in values.items() for length, ppl in zip(LENGTHS, series)]


def _off_scale_labels(axis) -> list[str]:
    return [text.get_text() for text in axis.texts if text.get_gid() == "off-scale"]


def test_exploded_and_inf_perplexities_are_off_scale_in_a_zoomed_panel(tmp_path):
    summary = _summary({
        "none": (14.0, 400.0, 5000.0),         # explodes past the window
        "yarn:factor=4": (15.0, 16.0, 17.0),
        "dca": (14.2, 14.8, 15.5),
        "broken": (14.5, float("inf"), 20.0),  # an overflow: inf at one length
    })
    figure = perplexity_figure(RUN, summary)
    full, zoom = figure.axes
    assert (full.get_label(), zoom.get_label()) == ("full range", "zoom")
    assert full.get_yscale() == "log"
    low, high = zoom.get_ylim()
    assert low <= 14.0 and 20.0 <= high < ZOOM_MULTIPLE * 14.0  # every value within 3x of the best at 1024
    assert high < 400.0  # the exploded values are outside the zoomed panel
    labels = _off_scale_labels(zoom)
    assert sorted(labels) == ["broken: inf", "none: 400", "none: 5,000"]
    assert _off_scale_labels(full) == ["broken: inf"]  # inf has no place on any axis: marked, not dropped
    legend = [text.get_text() for text in zoom.get_legend().get_texts()]
    assert "none (off-scale)" in legend and "broken (off-scale)" in legend and "dca" in legend
    assert any("off-scale" in text and "top edge" in text for text in legend)

    (tmp_path / "ppl.json").write_text(json.dumps({"run": RUN, "summary": summary}))  # inf as JSON's Infinity
    assert math.isinf(json.loads((tmp_path / "ppl.json").read_text())["summary"][10]["perplexity"])
    assert plot_perplexity(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_one_panel_when_nothing_explodes():
    figure = perplexity_figure(RUN, _summary({"none": (14.0, 15.0, 38.0), "yarn:factor=2": (14.5, 14.7, 15.0)}))
    (axis,) = figure.axes  # 38 stays within 3x of 14: the band is every method
    assert axis.get_yscale() == "log" and _off_scale_labels(axis) == []
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["none", "yarn:factor=2"]


def test_many_methods_with_an_exploded_one_keep_the_legend_beside_the_axes():
    methods = {f"yarn:factor={n}": (10.0 + n, 11.0 + n, 12.0 + n) for n in range(2, 12)}
    methods["none"] = (10.0, 300.0, float("inf"))
    figure = perplexity_figure(RUN, _summary(methods))
    assert len(figure.axes) == 2 and len(figure.legends) == 1  # a figure legend, outside the two panels
    width, height = figure.get_size_inches()
    assert width < 2.2 * height
    assert sorted(_off_scale_labels(figure.axes[1])) == ["none: 300", "none: inf"]


def test_methods_are_drawn_by_kind_each_distinct():
    """Methods grouped by kind: frequency methods blue circles, position rules orange squares, query scales purple
    triangles, biases green diamonds, the unpatched model black; within a kind, other shades and line styles (none
    and logn shared a blue before); a spec rope_ext does not parse (a label) grey crosses."""
    from matplotlib import colors

    from rope_ext.eval.styles import method_styles

    methods = ["none", "yarn:factor=2", "pi:factor=2", "logn", "dca", "rerope:w=8+logn", "alibi", "saved-run"]
    styles = method_styles(methods)
    assert styles["none"] == ("black", "o", "-")
    markers = {m: styles[m][1] for m in methods[1:]}
    assert markers == {"yarn:factor=2": "o", "pi:factor=2": "o", "logn": "^", "dca": "s", "rerope:w=8+logn": "s",
                       "alibi": "D", "saved-run": "x"}
    assert len({(colors.to_hex(c), marker, line) for c, marker, line in styles.values()}) == len(methods)
    assert styles["yarn:factor=2"][2] != styles["pi:factor=2"][2]  # (one kind: line styles in turn too)
    hue = lambda method: colors.rgb_to_hsv(colors.to_rgb(styles[method][0]))[0]  # noqa: E731
    assert abs(hue("yarn:factor=2") - hue("pi:factor=2")) < 0.05 and abs(hue("dca") - hue("yarn:factor=2")) > 0.2


def _ruler_results(block: dict | None) -> dict:
    summary = [{"method": method, "task": "average", "length": length, "score": score, "low": score - 5,
                "high": score + 5, "tasks": ["vt"]}
               for method, scores in {"none": (60.0, 40.0), "yarn:factor=4": (90.0, 80.0)}.items()
               for length, score in zip((1024, 2048), scores)]
    return {"run": {"model_name": "tiny"}, "summary": summary, **({"effective_length": block} if block else {})}


def _threshold(axis) -> tuple[list[float], list[str], list[str]]:
    return ([line.get_ydata()[0] for line in axis.lines if line.get_gid() == "threshold"],
            [text.get_text() for text in axis.texts if text.get_gid() == "threshold"],
            [text.get_text() for text in axis.get_legend().get_texts()])


def test_the_ruler_plot_draws_the_threshold_and_effective_lengths_ruler_json_records(tmp_path):
    """``--threshold 85``: the line at 85, said to be given, and each method's effective length at 85, as
    ``ruler.json``'s ``effective_length`` holds them (not the unpatched model's 60); ``rope-ext plot`` redraws it."""
    from rope_ext.eval.plot import plot_run, ruler_figure

    given = {"threshold": 85.0, "threshold_from": "--threshold", "lengths": {"none": None, "yarn:factor=4": 1024}}
    (axis,) = ruler_figure(_ruler_results(given)).axes
    assert _threshold(axis) == ([85.0], [" threshold 85.0 (given with --threshold)"],
                                ["none (effective <1k)", "yarn:factor=4 (effective 1k)"])
    own = {"threshold": 60.0, "lengths": {"none": 1024, "yarn:factor=4": 2048},
           "threshold_from": "the unpatched model's (none) average at its shortest length, 1024"}
    for block in (own, None):  # (a folder written before ruler.json held the block: the unpatched model's, as then)
        (axis,) = ruler_figure(_ruler_results(block)).axes
        assert _threshold(axis) == ([60.0], [" threshold 60.0 (none at 1k)"],
                                    ["none (effective 1k)", "yarn:factor=4 (effective 2k)"])
    nothing = {"threshold": None, "lengths": {}, "threshold_from": "nothing: no --threshold given and no ..."}
    (axis,) = ruler_figure(_ruler_results(nothing)).axes
    assert _threshold(axis) == ([], [], ["none", "yarn:factor=4"])
    (tmp_path / "ruler.json").write_text(json.dumps({**_ruler_results(given), "records": []}))
    assert [p.name for p in plot_run(tmp_path)] == ["ruler.png"]


def test_interval_bands_shade_the_full_panel_only_and_say_so():
    """Intervals over different texts are wider than the gaps the zoom shows: shaded above, not over the zoom."""
    summary = [{**row, "documents": 4, "low": row["perplexity"] * 0.6, "high": row["perplexity"] * 1.7}
               for row in _summary({"none": (14.0, 400.0, 5000.0), "dca": (14.2, 14.8, 15.5)})]
    full, zoom = perplexity_figure(RUN, summary).axes
    assert len(full.collections) == 2 and len(zoom.collections) == 0
    assert "shaded: 95% intervals over the windows" in full.get_title(loc="left")
    (axis,) = perplexity_figure(RUN, [row for row in summary if row["method"] == "dca"]).axes
    assert len(axis.collections) == 1 and "shaded: 95% intervals" in axis.get_title()
    one = [{**row, "documents": 1} for row in summary if row["method"] == "dca"]  # (one window: no band, no note)
    (axis,) = perplexity_figure(RUN, one).axes
    assert len(axis.collections) == 0 and "shaded" not in axis.get_title()
