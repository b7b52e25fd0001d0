"""plot_results.py's figures of memory, one line per model and strategy: what one rank held at
its peak and between steps, that state per parameter against the ZeRO paper's ideal, and the
largest model a GPU would hold at each point (projection.py).
"""

import pandas as pd
from matplotlib.figure import Figure

import projection
import results_summary
from plot_style import (
    IDEAL_STYLE,
    NotPlottable,
    figure,
    log2_axis,
    log10_y_axis,
    plot_lines,
)
from utils import MB

# What peak_mem measured, by the device the runs trained on (measure.MemoryMeter).
# Two lines: one would be taller than a one-panel figure.
PEAK_MEMORY_LABEL = {
    "cuda": "CUDA allocator peak above baseline\n(MB, max over ranks)",
    "cpu": "resident-set peak above baseline\n(MB, max over ranks)",
}


def plot_peak_memory(summary: pd.DataFrame) -> Figure:
    """peak_mem as measured (not divided by the GPU count), and beside it state_mem, the
    parameters, gradients and optimizer state one rank holds: what FSDP shards. Log axes: the
    models' state differs by orders of magnitude, and 1/N is a straight line on them."""
    has_state = summary["state_mem"].notna().any()
    fig, axes = figure(2 if has_state else 1)
    label = PEAK_MEMORY_LABEL.get(results_summary.values(summary, "device"))
    peak = summary.assign(peak_mem=summary["peak_mem"].where(summary["peak_mem"] > 0))
    plot_lines(axes[0], peak, "peak_mem", label or "peak memory (MB, max over ranks, as logged)")
    axes[0].set_title("Peak training memory per rank")
    if has_state:
        state = summary.assign(state_mem=summary["state_mem"] / MB)
        plot_lines(axes[1], state, "state_mem", "parameters + gradients + optimizer state (MB)")
        axes[1].set_title("Model state held by one rank")
    for ax in axes:
        log10_y_axis(ax)
        ax.legend()
    return fig


def state_settings(summary: pd.DataFrame) -> list[tuple[str, str]]:
    """The (optimizer, precision) pairs of the points, each point of one."""
    pairs = summary[list(results_summary.STATE_SETTING)].dropna().drop_duplicates()
    return [(o, p) for o, p in pairs.itertuples(index=False) if "/" not in o + p]


def plot_ideal_state(ax, summary: pd.DataFrame) -> list[float]:
    """The ZeRO paper's lines for each optimizer and precision the runs used: a replicated
    rank's bytes per parameter (cost_model.bytes_per_parameter: 16 with Adam in fp32) at every
    GPU count, and that over N, a rank of N holding an N-th (full sharding). Returns their
    values: the y axis' ticks."""
    try:
        import cost_model  # loads torch: only where a figure of state is drawn
    except ImportError as e:  # plot_results.sh needs pandas and matplotlib alone
        raise NotPlottable(
            f"its ideal lines are cost_model.py's, which needs torch ({e})"
        ) from None

    gpus, ticks = sorted(summary["gpus"].unique()), []
    for optimizer, precision in state_settings(summary):
        whole = cost_model.bytes_per_parameter(optimizer, precision)
        setting = f"{optimizer}, {precision} state"
        for label, color, line in (
            (f"replicated: {whole} B ({setting})", "black", [whole] * len(gpus)),
            (f"sharded: {whole} B / N", "gray", [whole / n for n in gpus]),
        ):
            ax.plot(gpus, line, color=color, label=label, **IDEAL_STYLE)
            ticks += line
    return ticks


def plot_bytes_per_parameter(summary: pd.DataFrame) -> Figure:
    """state_mem / the model's parameters per rank: flat for DDP, 1/N for FSDP."""
    if "parameters" not in summary or summary["parameters"].isna().all():
        raise NotPlottable("no parameters ([CONFIG] lines) to divide state_mem by")
    fig, (ax,) = figure()
    per_parameter = summary.assign(per_parameter=summary["state_mem"] / summary["parameters"])
    plot_lines(ax, per_parameter, "per_parameter", "state bytes per parameter, one rank")
    if ticks := plot_ideal_state(ax, per_parameter.dropna(subset=["per_parameter"])):
        log2_axis(ax, "y", ticks)  # 16, 8, 4: each ideal value labelled
    else:
        log10_y_axis(ax)
    ax.set_title("Model state per parameter vs the ZeRO paper's ideal")
    ax.legend(fontsize="small")
    return fig


def plot_largest_model(summary: pd.DataFrame, gpu_memory: float | None = None) -> Figure:
    """projection.py's largest model at each point, beside each model's own size."""
    if absent := projection.missing(summary):
        raise NotPlottable(f"no {', '.join(absent)}: the projection needs them")
    gpu, where = projection.gpu_memory(summary, gpu_memory)
    table = projection.projection_table(summary, gpu)
    fig, (ax,) = figure()
    plot_lines(ax, table.assign(largest=table["largest"] / 1e6), "largest", "parameters (M)")
    sizes = table.groupby("model")["parameters"].first() / 1e6
    for size in sizes:
        ax.axhline(size, color="gray", linewidth=1, linestyle=":")
    log10_y_axis(ax)
    for model, size in sizes.items():
        ax.annotate(f"{model} itself", (ax.get_xlim()[0], size), fontsize="x-small")
    ax.set_title(f"Largest model that fits {where}", fontsize="medium", wrap=True)
    ax.legend(fontsize="small")
    return fig
