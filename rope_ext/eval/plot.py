"""Pictures from a results folder: perplexity vs context length, passkey heatmaps, RULER's scores by length and its
single-needle tasks' heatmaps by depth.

Drawn with matplotlib's object-oriented API (``Figure``, saved by its own canvas): no pyplot, no
global backend, so plotting from a notebook leaves its backend and figures alone.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatterSciNotation

from rope_ext.eval.ruler import effective_lengths
from rope_ext.eval.styles import method_styles
from rope_ext.runs.results import load_results

#: heatmaps per row of the passkey figure
PASSKEY_COLUMNS = 5


def _length_label(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def _wrapped(label: str, width: int) -> str:
    """A method spec broken into lines of about ``width`` characters after its ``+`` and ``:`` separators."""
    lines, line = [], ""
    for part in re.split(r"(?<=[+:])", label):
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        line += part
    return "\n".join([*lines, line])


#: the zoomed panel shows the perplexities up to this multiple of the best one measured at the shortest length
#: (the in-window reference); a point above it, or inf, is off-scale there
ZOOM_MULTIPLE = 3.0


class _PlainLogFormatter(LogFormatterSciNotation):
    """The log axis's own choice of ticks to label, written as plain numbers (20, 300) instead of 2 x 10^1."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


def _value_label(value: float) -> str:
    if value != value:
        return "nan"
    if math.isinf(value):
        return "inf"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _zoom_band(points: dict[str, list[tuple[int, float]]]) -> tuple[float, float] | None:
    """The y limits of the zoomed panel: every finite perplexity up to ``ZOOM_MULTIPLE`` x the best finite one
    at the shortest length, plus room at the top for the off-scale labels; ``None`` when no point is above that
    or infinite (one panel shows everything) or no point is finite."""
    values = [(length, ppl) for series in points.values() for length, ppl in series]
    finite = [(length, ppl) for length, ppl in values if math.isfinite(ppl)]
    if not finite:
        return None
    shortest = min(length for length, _ in finite)
    limit = ZOOM_MULTIPLE * min(ppl for length, ppl in finite if length == shortest)
    kept = [ppl for _, ppl in finite if ppl <= limit]
    if len(kept) == len(values):
        return None
    low, high = min(kept), max(kept)
    pad = 0.06 * (high - low) if high > low else 0.05 * high
    stacked = max(sum(1 for n, p in values if n == length and not p <= limit) for length, _ in values)
    room = min(0.4, 0.04 + 0.035 * stacked)  # the top of the panel, kept free for the off-scale labels
    low, high = low - pad, high + pad
    return low, high + (high - low) * room / (1 - room)


def _mark_off_scale(axis, points: dict[str, list[tuple[int, float]]], colors: dict[str, str], top: float | None,
                    lengths: list[int]) -> set[str]:
    """An upward marker at the top edge of ``axis`` for every point above ``top`` (``None``: only inf and nan),
    labelled with its value and stacked per length; returns the methods that have one."""
    marked: set[str] = set()
    stacks: dict[int, int] = {}
    for method, series in points.items():
        for length, ppl in series:
            if math.isfinite(ppl) and (top is None or ppl <= top):
                continue
            marked.add(method)
            row = stacks[length] = stacks.get(length, -1) + 1
            if row == 0:
                axis.plot([length], [1.0], marker="^", markersize=8, color="black", clip_on=False,
                          transform=axis.get_xaxis_transform(), linestyle="none", zorder=5)
            edge = length == lengths[-1] and len(lengths) > 1
            align = "left" if length == lengths[0] and len(lengths) > 1 else "right" if edge else "center"
            axis.annotate(f"{method}: {_value_label(ppl)}", (length, 1.0), xycoords=axis.get_xaxis_transform(),
                          xytext=(0, -12 - 9 * row), textcoords="offset points", ha=align, va="top", fontsize=7,
                          color=colors[method], gid="off-scale")
    return marked


def perplexity_figure(run: dict, rows: list[dict]) -> Figure:
    """The perplexity figure of a summary: one log-scale panel of every method; when some point explodes
    (above ``ZOOM_MULTIPLE`` x the best perplexity at the shortest length, or inf), a second, linear panel
    zoomed on the others, where the points off its scale are marked at the top edge with their values and
    their methods say "(off-scale)" in the legend. Points of inf or nan, which no axis can place, are marked
    the same way in both panels. Returns the figure unsaved (``plot_perplexity`` saves it)."""
    methods = list(dict.fromkeys(row["method"] for row in rows))
    points = {m: sorted((row["length"], float(row["perplexity"])) for row in rows if row["method"] == m)
              for m in methods}
    styled = method_styles(methods)
    colors = {method: styled[method][0] for method in methods}
    lengths = sorted({row["length"] for row in rows})
    band = _zoom_band(points)
    outside = len(methods) > 8  # a legend that would cover the curves goes to the right of the axes
    height = max(4.8, 0.2 * len(methods) + 0.8) if outside else 4.8  # (room for every legend entry)
    if band is not None:
        height = max(height, 8.0)
    figure = Figure(figsize=(10.0 if outside else 7.5, height), layout="constrained")
    axes = list(figure.subplots(2, 1, sharex=True, height_ratios=[1, 2])) if band else [figure.subplots()]
    shaded = False
    for axis in axes:
        for method in methods:
            finite = [(n, p if math.isfinite(p) else float("nan")) for n, p in points[method]]
            axis.plot([p[0] for p in finite], [p[1] for p in finite], label=method, color=colors[method],
                      linestyle=styled[method][2], marker=styled[method][1])
            # (several windows: the 95% interval as a band, on the full panel only: the zoom is for the gaps
            # between methods, which intervals over different texts are wider than)
            band_rows = sorted((row["length"], row.get("low"), row.get("high")) for row in rows
                               if row["method"] == method and row.get("documents", 1) > 1
                               and row.get("low") is not None) if axis is axes[0] else []
            if band_rows:
                axis.fill_between([b[0] for b in band_rows], [b[1] for b in band_rows], [b[2] for b in band_rows],
                                  color=colors[method], alpha=0.15, linewidth=0)
                shaded = True
    full, zoom = axes[0], axes[-1] if band else None
    full.set_yscale("log")
    full.yaxis.set_major_formatter(_PlainLogFormatter())
    full.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))
    full.set_ylabel("perplexity (log scale)")
    full.set_label("full range")
    off_scale = _mark_off_scale(full, points, colors, None, lengths)
    if zoom is not None:
        zoom.set_ylim(*band)
        zoom.set_ylabel("perplexity")
        zoom.set_label("zoom")
        off_scale = _mark_off_scale(zoom, points, colors, band[1], lengths)
        full.set_title("every method (log scale" + ("; shaded: 95% intervals over the windows)" if shaded else ")"),
                       fontsize=9, loc="left")
        zoom.set_title(f"zoom on the perplexities within {ZOOM_MULTIPLE:g}x the best at {_length_label(lengths[0])} "
                       "(linear scale; \u25b2 = off-scale, value shown)", fontsize=9, loc="left")
    native = run.get("native_context")
    for axis in axes:
        if native:
            axis.axvline(native, color="grey", linestyle="--", linewidth=1)
        if native and axis is full:
            axis.text(native, 0.98, f" native {native}", va="top", ha="left", color="grey", fontsize=8,
                      transform=axis.get_xaxis_transform())
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths, [_length_label(L) for L in lengths])
        axis.xaxis.minorticks_off()
        axis.grid(True, which="both", alpha=0.3)
    axes[-1].set_xlabel("context length (tokens)")
    protocol = {"fixed": "fixed last-token targets", "curve": "per-position buckets", "sliding": "sliding window",
                "masked-lm": "masked-LM loss, fixed masked tokens",
                "span-corruption": "span-corruption loss (T5), fixed spans"}
    title = f"{run.get('model_name', run.get('model'))}: {protocol.get(run['protocol'], run['protocol'])}"
    if band is None:
        full.set_title(title + ("\n(shaded: 95% intervals over the windows)" if shaded else ""), fontsize=10)
    else:
        figure.suptitle(title)
    legend_axis = axes[-1]
    handles, labels = legend_axis.get_legend_handles_labels()
    labels = [f"{label} (off-scale)" if label in off_scale else label for label in labels]
    if off_scale:
        handles.append(Line2D([], [], marker="^", color="black", linestyle="none"))
        labels.append("off-scale: value at the top edge")
    if outside and band is not None:
        figure.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
    elif outside:
        legend_axis.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        legend_axis.legend(handles, labels, fontsize=8 if band else None)
    return figure


def plot_perplexity(out: str | Path) -> Path | None:
    results = load_results(out, "ppl")
    if results is None or not results["summary"]:
        return None
    figure = perplexity_figure(results["run"], results["summary"])
    path = Path(out) / "ppl.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_passkey(out: str | Path) -> Path | None:
    results = load_results(out, "passkey")
    if results is None or not results["summary"]:
        return None
    return _heatmaps(results["summary"], "accuracy", Path(out) / "passkey.png", "accuracy")


def _heatmaps(rows: list[dict], value: str, path: Path, label: str) -> Path:
    """A heatmap per method of ``value`` (a fraction) by depth and length, each cell labelled."""
    methods = list(dict.fromkeys(row["method"] for row in rows))
    lengths = sorted({row["length"] for row in rows})
    depths = sorted({row["depth"] for row in rows})
    columns = min(len(methods), PASSKEY_COLUMNS)  # many methods wrap onto more rows of heatmaps
    rows_of_axes = -(-len(methods) // columns)
    width, height = max(2.8, 0.45 * len(lengths) + 0.8), max(3.0, 0.3 * len(depths) + 1.6)  # one heatmap
    figure = Figure(figsize=(width * columns + 1.2, height * rows_of_axes + 0.4), layout="constrained")
    axes = figure.subplots(rows_of_axes, columns, squeeze=False, sharey=True)
    flat = [axis for row in axes for axis in row]
    for axis in flat[len(methods):]:
        axis.set_visible(False)
    image = None
    for axis, method in zip(flat, methods):
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for row in rows:
            if row["method"] == method:
                grid[depths.index(row["depth"])][lengths.index(row["length"])] = row[value]
        image = axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        axis.set_xticks(range(len(lengths)), [_length_label(L) for L in lengths])
        axis.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
        axis.set_xlabel("length")
        axis.set_title(_wrapped(method, round(width * 10)), fontsize=9)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                measured = grid[i][j] == grid[i][j]
                axis.text(j, i, f"{grid[i][j]:.0%}" if measured else "not run", ha="center", va="center",
                          fontsize=7, color="black" if measured else "grey")
    for row in axes:
        row[0].set_ylabel("depth")
    figure.colorbar(image, ax=flat, label=label)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def ruler_threshold(results: dict) -> tuple[float | None, dict, str]:
    """``(threshold, {method: effective length}, where the threshold came from)`` as ``ruler.json``'s
    ``effective_length`` records them (``effective_summary``: ``--threshold`` or the unpatched model's), so the plot
    says what the run printed and wrote; a folder written before that block: the unpatched model's, as then."""
    rows = [row for row in results["summary"] if row["task"] == "average"]
    block = results.get("effective_length")
    if not isinstance(block, dict) or "threshold" not in block:
        return (*effective_lengths(rows, None), _unpatched(rows))
    if block.get("threshold_from") == "--threshold":
        return block["threshold"], block.get("lengths") or {}, "given with --threshold"
    return block["threshold"], block.get("lengths") or {}, _unpatched(rows)


def _unpatched(rows: list[dict]) -> str:
    """Where a threshold taken from the unpatched model's average came from: its shortest length."""
    base = [row["length"] for row in rows if row["method"] == "none"]
    return f"none at {_length_label(min(base))}" if base else "the unpatched model's"


def ruler_figure(results: dict) -> Figure:
    """``ruler.png``'s figure: each method's mean score over its tasks by length, with its 95% interval, the
    threshold and each method's effective length as ``ruler.json`` records them (``ruler_threshold``)."""
    rows = [row for row in results["summary"] if row["task"] == "average"]
    methods = list(dict.fromkeys(row["method"] for row in rows))
    lengths = sorted({row["length"] for row in rows})
    figure = Figure(figsize=(7.5, 4.8), layout="constrained")
    axis = figure.subplots()
    styled = method_styles(methods)
    threshold, effective, source = ruler_threshold(results)
    for method in methods:
        mine = sorted((r["length"], r["score"], r["low"], r["high"]) for r in rows if r["method"] == method)
        reach = effective.get(method)
        shown = _length_label(reach) if reach else "<" + _length_label(mine[0][0])
        label = method if threshold is None else f"{method} (effective {shown})"
        axis.errorbar([m[0] for m in mine], [m[1] for m in mine], yerr=[[m[1] - m[2] for m in mine],
                      [m[3] - m[1] for m in mine]], label=label, color=styled[method][0], capsize=3,
                      marker=styled[method][1], linestyle=styled[method][2])
    if threshold is not None:
        axis.axhline(threshold, color="grey", linestyle=":", linewidth=1, gid="threshold")
        axis.text(lengths[0], threshold, f" threshold {threshold:.1f} ({source})", va="bottom", ha="left",
                  color="grey", fontsize=8, gid="threshold")
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths, [_length_label(L) for L in lengths])
    axis.xaxis.minorticks_off()
    axis.set_ylim(-2, 102)
    axis.set_xlabel("context length (tokens)")
    axis.set_ylabel("RULER score (mean over tasks, x100)")
    tasks = sorted({task for row in rows for task in row.get("tasks", [])})
    axis.set_title(f"{results['run'].get('model_name')}: {len(tasks)} RULER task(s), 95% intervals", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return figure


def plot_ruler(out: str | Path) -> list[Path]:
    """``ruler.png`` (``ruler_figure``) and ``ruler_depths.png``: the single-needle tasks' score by needle depth and
    length, a heatmap per method."""
    results = load_results(out, "ruler")
    if results is None or not results["summary"]:
        return []
    paths = [Path(out) / "ruler.png"]
    ruler_figure(results).savefig(paths[0], dpi=120, bbox_inches="tight")
    depth_rows = _depth_rows(results.get("records") or [])
    if depth_rows:
        paths.append(_heatmaps(depth_rows, "score", Path(out) / "ruler_depths.png",
                               "the single-needle tasks' score by needle depth"))
    return paths


def _depth_rows(records: list[dict]) -> list[dict]:
    """Mean score per method, length and depth of the records that have a depth."""
    cells: dict[tuple, list[float]] = {}
    for record in records:
        if record.get("depth") is not None:
            cells.setdefault((record["method"], record["length"], record["depth"]), []).append(record["score"])
    return [{"method": m, "length": L, "depth": d, "score": sum(v) / len(v)} for (m, L, d), v in cells.items()]


def check_results_file(path: Path) -> None:
    """Refuse, in one line, a ``ppl.json`` / ``passkey.json`` / ``ruler.json`` that is not one evaluation's results
    (``run`` and ``summary``, as ``rope-ext eval`` writes them; e.g. a table collected from several runs): what it
    holds, what plot expects, and the results folders inside its folder."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # (``plot_run`` names a file that does not parse)
    if isinstance(data, dict) and isinstance(data.get("run"), dict) and isinstance(data.get("summary"), list):
        return
    if isinstance(data, dict):
        holds = f"a JSON object of {', '.join(repr(key) for key in list(data)[:4])}" if data else "an empty JSON object"
    else:
        holds = f"a JSON {type(data).__name__}"
    found = sorted({p.parent for name in RESULTS_FILES for pattern in (f"*/{name}", f"*/*/{name}")
                    for p in path.parent.glob(pattern)})
    inside = f"; results folders inside it: {', '.join(map(str, found[:3]))}{', ...' if len(found) > 3 else ''}" \
        if found else ""
    raise ValueError(
        f"{path} holds {holds}, not one evaluation's results: rope-ext plot draws a folder rope-ext eval wrote (its "
        f"{path.name} holds 'run' and 'summary'){inside}"
    )


#: the results files a folder may hold
RESULTS_FILES = ("ppl.json", "passkey.json", "ruler.json")


def plot_run(out: str | Path) -> list[Path]:
    for name in RESULTS_FILES:
        if (Path(out) / name).is_file():
            check_results_file(Path(out) / name)
    try:
        paths = [p for p in (plot_perplexity(out), plot_passkey(out)) if p is not None] + plot_ruler(out)
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(
            f"{out}: ppl.json, passkey.json or ruler.json is not a results file rope-ext wrote "
            f"({type(error).__name__}: {error}); re-run `rope-ext eval ...` to write it again"
        ) from None
    if not paths:
        raise FileNotFoundError(f"no ppl.json, passkey.json or ruler.json in {out}; run `rope-ext eval ...` first")
    return paths


def plot_training(out: str | Path) -> Path | None:
    """``loss.png`` of a training folder: the loss per optimizer step, and beside it the evaluations' perplexity
    per step when the run evaluated (``loss.json``, written by ``rope_ext.train.loop``)."""
    import json

    path = Path(out) / "loss.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    log, evals = data.get("log") or [], data.get("evals") or []
    if not log:
        return None
    panels = 2 if evals else 1
    figure = Figure(figsize=(5.2 * panels, 3.6), layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    axes[0].plot([row["step"] for row in log], [row["loss"] for row in log], color="tab:blue", linewidth=1)
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("training loss")
    axes[0].set_title("loss", fontsize=10)
    if evals:
        first = evals[0]
        axes[1].plot([e["step"] for e in evals], [e["perplexity"] for e in evals], marker="o", color="tab:red")
        axes[1].set_xlabel("optimizer step")
        axes[1].set_ylabel("perplexity")
        axes[1].set_title(f"{first['document']}: last {first['target_tokens']} of {_length_label(first['length'])} "
                          "tokens", fontsize=10)
    target = Path(out) / "loss.png"
    figure.savefig(target, dpi=120, bbox_inches="tight")
    return target
