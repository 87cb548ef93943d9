"""Pictures from a results folder: perplexity vs context length, and passkey heatmaps.

Drawn with matplotlib's object-oriented API (``Figure``, saved by its own canvas): no pyplot, no
global backend, so plotting from a notebook leaves its backend and figures alone.
"""

from __future__ import annotations

import re
from pathlib import Path

from matplotlib.figure import Figure

from rope_ext.eval.results import load_results


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


def plot_perplexity(out: str | Path) -> Path | None:
    results = load_results(out, "ppl")
    if results is None or not results["summary"]:
        return None
    run, rows = results["run"], results["summary"]
    methods = list(dict.fromkeys(row["method"] for row in rows))
    outside = len(methods) > 8  # a legend that would cover the curves goes to the right of the axes
    height = max(4.8, 0.2 * len(methods) + 0.8) if outside else 4.8  # (room for every legend entry)
    figure = Figure(figsize=(10.0 if outside else 7.5, height), layout="constrained")
    axis = figure.subplots()
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "D", "v", "P", "X"]  # 10 colours x 4 styles repeat after 20 methods: then the marker
    for index, method in enumerate(methods):
        points = sorted((row["length"], row["perplexity"]) for row in rows if row["method"] == method)
        axis.plot([p[0] for p in points], [p[1] for p in points], label=method, color=f"C{index % 10}",
                  linestyle=styles[index % len(styles)], marker=markers[index // 20 % len(markers)])
    native = run.get("native_context")
    if native:
        axis.axvline(native, color="grey", linestyle="--", linewidth=1)
        axis.text(native, axis.get_ylim()[1], f" native {native}", va="top", ha="left", color="grey", fontsize=8)
    axis.set_xscale("log", base=2)
    lengths = sorted({row["length"] for row in rows})
    axis.set_xticks(lengths, [_length_label(L) for L in lengths])
    axis.minorticks_off()
    axis.set_yscale("log")
    axis.set_xlabel("context length (tokens)")
    axis.set_ylabel("perplexity (log scale)")
    protocol = {"fixed": "fixed last-token targets", "curve": "per-position buckets", "sliding": "sliding window"}
    axis.set_title(f"{run.get('model_name', run.get('model'))}: {protocol.get(run['protocol'], run['protocol'])}")
    axis.grid(True, which="both", alpha=0.3)
    if outside:
        axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        axis.legend()
    path = Path(out) / "ppl.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_passkey(out: str | Path) -> Path | None:
    results = load_results(out, "passkey")
    if results is None or not results["summary"]:
        return None
    rows = results["summary"]
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
                grid[depths.index(row["depth"])][lengths.index(row["length"])] = row["accuracy"]
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
    figure.colorbar(image, ax=flat, label="accuracy")
    path = Path(out) / "passkey.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_run(out: str | Path) -> list[Path]:
    try:
        paths = [p for p in (plot_perplexity(out), plot_passkey(out)) if p is not None]
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(
            f"{out}: ppl.json or passkey.json is not a results file rope-ext wrote ({type(error).__name__}: {error}); "
            "re-run `rope-ext eval ...` to write it again"
        ) from None
    if not paths:
        raise FileNotFoundError(f"no ppl.json or passkey.json in {out}; run `rope-ext eval ...` first")
    return paths
