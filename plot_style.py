"""The look every figure of plot_results.py shares: a curve's colour, marker and line style
(the same in every figure), the axes of rank counts and of log scales, the ideal lines, and the
subtitle that says what ran. A curve is one model's strategy: one colour per strategy, and with
several models one marker per model.
"""

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: batch nodes and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.ticker import Formatter, NullLocator, ScalarFormatter  # noqa: E402

import results_summary  # noqa: E402
import utils  # noqa: E402

IDEAL_STYLE = dict(linestyle="--", linewidth=1, alpha=0.7)


class NotPlottable(Exception):
    """The CSV lacks what one figure needs: that PNG is not written, the others are."""


# Markers and line styles by strategy: strategies that compute the same (ddp and fsdp) draw
# the same curve, and a line of one colour on top would hide the other. An open marker ("x",
# "+") over a filled one, the gaps of a dotted line and some transparency keep both in sight.
# Dashes ("--") are left to the ideal lines. With several models the markers tell the models
# apart instead, and the line styles alone the strategies of one model.
MARKERS = ("o", "x", "s", "+", "^", "1")
LINESTYLES = ("-", ":", "-.")
LINE_ALPHA = 0.8
CURVE = ["model", "strategy"]  # a curve's key: one line per model and strategy


def color(i: int) -> str:
    """The i-th colour of matplotlib's cycle, round again past its end."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return cycle[i % len(cycle)]


def line_styles(summary: pd.DataFrame) -> dict[tuple[str, str], dict]:
    """The same colour, marker and line style for a curve (model, strategy) in every figure: a
    colour per strategy; a marker per strategy where one model ran, per model where several."""
    models = sorted(summary["model"].unique())
    return {
        (model, strategy): {
            "color": color(i),
            "marker": MARKERS[(i if len(models) == 1 else j) % len(MARKERS)],
            "linestyle": LINESTYLES[i % len(LINESTYLES)],
        }
        for i, strategy in enumerate(sorted(summary["strategy"].unique()))
        for j, model in enumerate(models)
    }


def curve_label(summary: pd.DataFrame, model: str, strategy: str) -> str:
    """A curve's name in a legend: its strategy, and its model where several ran."""
    return strategy if summary["model"].nunique() == 1 else f"{strategy}, {model}"


def curves(summary: pd.DataFrame, column: str):
    """(style, label, points) of each curve that has values of the column, its points in GPU
    order."""
    styles = line_styles(summary)
    for (model, strategy), points in summary.dropna(subset=[column]).groupby(CURVE):
        points = points.sort_values("gpus")
        yield styles[model, strategy], curve_label(summary, model, strategy), points


def log2_axis(ax, which: str, ticks) -> None:
    """Log2 scale on the x or y axis, a tick at each count given, written as plain numbers."""
    getattr(ax, f"set_{which}scale")("log", base=2)
    axis = getattr(ax, f"{which}axis")
    axis.set_ticks(sorted(set(ticks)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_locator(NullLocator())


class LogLabels(Formatter):
    """A log axis' labels as plain numbers (0.5, not 5x10^-1), on the ticks whose leading digit
    the axis' span leaves room for: every one across a decade or less, 1 2 3 5 7 up to two
    decades, 1 2 5 beyond. Epoch times span about a decade with the one-rank points at its
    top, which 2, 3 and 5 alone left unlabelled (none above 0.5 s)."""

    def __call__(self, value, pos=None) -> str:
        low, high = sorted(self.axis.get_view_interval())
        decades = math.log10(high / low)
        shown = range(1, 10) if decades <= 1 else (1, 2, 3, 5, 7) if decades <= 2 else (1, 2, 5)
        return f"{value:g}" if leading_digit(value) in shown else ""


def log10_y_axis(ax) -> None:
    """Log y axis labelled 0.5, 0.7, 1, 2 rather than 10^0 alone (LogLabels)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogLabels())
    ax.yaxis.set_minor_formatter(LogLabels())


def leading_digit(value: float) -> int:
    return int(round(value / 10 ** math.floor(math.log10(value)), 6))


def rank_axis(ax, rows: pd.DataFrame) -> None:
    """The x axis of the rank counts, named after what ran: GPUs, or CPU ranks."""
    log2_axis(ax, "x", rows["gpus"])
    ax.set_xlabel(results_summary.rank_unit(rows)[1])
    ax.grid(True, which="both", alpha=0.3)


def step_mark(points: pd.DataFrame) -> str:
    """How a curve's steps ran, for its legend: ` (CUDA graph)`, ` (eager)`, or both where its
    points mix them; nothing where the logs do not say (the course's)."""
    steps = points["step"].dropna().unique() if "step" in points else []
    return f" ({'/'.join(sorted(steps)).replace('graph', 'CUDA graph')})" if len(steps) else ""


def plot_lines(ax, summary: pd.DataFrame, column: str, ylabel: str) -> pd.DataFrame:
    """One line per model and strategy; returns the rows drawn."""
    rows = summary.dropna(subset=[column])
    if rows.empty:
        raise NotPlottable(f"no {column} values")
    for style, label, points in curves(summary, column):
        x, y = points["gpus"], points[column]
        ax.plot(x, y, alpha=LINE_ALPHA, label=f"{label}{step_mark(points)}", **style)
        low, high = f"{column}_min", f"{column}_max"
        if low in points and (points["runs"] > 1).any():  # min-max over repeated runs
            spread = [y - points[low], points[high] - y]
            ax.errorbar(x, y, yerr=spread, fmt="none", ecolor=style["color"], capsize=3)
    rank_axis(ax, rows)
    ax.set_ylabel(ylabel)
    return rows


def plot_ideal_scaling(ax, summary: pd.DataFrame, column: str, exponent: int) -> None:
    """Dashed ideal from each curve's 1-GPU value: value * N**exponent (-1: time, 1: rate)."""
    for style, label, points in curves(summary, column):
        base = points.loc[points["gpus"] == 1, column]
        if not base.empty:
            gpus = points["gpus"].astype(float)
            ideal = dict(color=style["color"], label=f"{label} ideal", **IDEAL_STYLE)
            ax.plot(gpus, base.iloc[0] * gpus**exponent, **ideal)


def label_points(ax, xs, ys, texts, xytext=(4, -10), **style) -> None:
    """Each point's text beside it (below right, unless xytext says otherwise)."""
    style = {"fontsize": "small", **style}
    for x, y, text in zip(xs, ys, texts):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=xytext, **style)


def figure(panels: int = 1) -> tuple[Figure, list]:
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8), squeeze=False)
    return fig, list(axes[0])


SUBTITLE_SIZE = "small"
# Characters per inch are estimated from the widest characters a subtitle is made of, digits
# (about 0.69 em as Agg draws DejaVu Sans at this size; lower case takes 0.6), so that a line
# of sweep names does not run past the figure's edges either.
EM_PER_CHARACTER = 0.7


def add_subtitle(fig: Figure, subtitle: str) -> None:
    """The subtitle on top, wrapped to the figure's width (one line on a 720-px figure would be
    cut at both ends), and the panels laid out below all its lines."""
    points = FontProperties(size=SUBTITLE_SIZE).get_size_in_points()
    margin = 0.95  # of the width: the line's ends stay off the figure's edges
    characters_per_line = int(margin * fig.get_figwidth() * 72 / (EM_PER_CHARACTER * points))
    fig.suptitle(
        textwrap.fill(subtitle, characters_per_line, break_on_hyphens=False),
        fontsize=SUBTITLE_SIZE,
        color="dimgray",
    )
    fig.tight_layout()  # leaves room for the suptitle, however many lines it has


def save_png(fig: Figure, path: Path, subtitle: str) -> None:
    add_subtitle(fig, subtitle)
    utils.write_atomically(path, lambda temp: fig.savefig(temp, format="png", dpi=120))
    plt.close(fig)
