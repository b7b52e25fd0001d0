"""Plot how training scales with the GPU count: one PNG per question, one line per strategy.

    python plot_results.py                           # results.csv -> plots/*.png
    python plot_results.py --csv FILE --out-dir DIR

Reads the CSV of collect_results.py, or the course's results_*.csv (`method,gpus,epoch,time,
val_loss,acc,peak_mem`). The points are results_summary.summarize's, so the plots and the
printed table agree: steady epoch time and throughput are medians of the epochs after the
first, loss and accuracy are the final epoch's, memory is per rank as measured (max over
ranks). Every figure says under its title what ran: device, data set and images per epoch,
global batch, epochs and sweep, as far as the CSV tells. Prints the path of every PNG written,
one per line.
"""

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: batch nodes and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import results_summary  # noqa: E402
import utils  # noqa: E402
from layout import COMM_CSV, DEFAULT_RESULTS, GPU_TIMELINE_CSV, side_path  # noqa: E402
from memory_figures import plot_bytes_per_parameter, plot_largest_model, plot_peak_memory  # noqa: E402
from plot_style import (  # noqa: E402
    IDEAL_STYLE,
    NotPlottable,
    color,
    figure,
    label_points,
    log2_axis,
    log10_y_axis,
    plot_ideal_scaling,
    plot_lines,
    save_png,
)

COURSE_NAMES = {"method": "strategy"}  # the course's CSV calls the strategy "method"
REQUIRED = ("strategy", "gpus", *results_summary.COURSE_COLUMNS)
NUMERIC = ("gpus", *results_summary.COURSE_COLUMNS)
# Numbers where known (the course's CSV has no throughput; `na` where a run has no such number).
MAY_BE_EMPTY = ("throughput", *utils.MAY_BE_NA)


def read_csv(path: Path) -> pd.DataFrame:
    """A CSV, or UsageError with one line of why not."""
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise utils.UsageError(f"{path} is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise utils.UsageError(f"{path} is not a CSV: {reason}") from None


def read_results(path: Path) -> pd.DataFrame:
    """The results, checked: the columns every figure needs, numbers where numbers belong."""
    if not path.exists():
        raise utils.UsageError(f"no results file {path} (run collect_results.py first)")
    results = read_csv(path).rename(columns=COURSE_NAMES)
    missing = [c for c in REQUIRED if c not in results]
    if missing:
        raise utils.UsageError(f"{path} is not a results CSV: no column {', '.join(missing)}")
    if results.empty:
        raise utils.UsageError(f"{path} has no rows")
    for column in (*NUMERIC, *MAY_BE_EMPTY):
        if column in results:
            numbers = pd.to_numeric(results[column], errors="coerce")
            if column not in MAY_BE_EMPTY and numbers.isna().any():
                row = int(numbers.isna().idxmax()) + 2  # + header, 1-based
                raise utils.UsageError(f"{path} line {row}: {column} is not a number")
            results[column] = numbers
    if results["strategy"].isna().any():
        raise utils.UsageError(f"{path}: a row has no strategy")
    if (results["gpus"] < 1).any():
        raise utils.UsageError(f"{path}: gpus must be at least 1")
    return results


def steady(summary: pd.DataFrame) -> str:
    """How the points' epoch times were taken (results_summary.median_after_first): the median
    of the epochs after the first, or a run's only epoch where it logged one (the course's CSV
    keeps only the last)."""
    logged = summary["epochs_logged"]
    if (logged > 1).all():
        return "median after epoch 1"
    if (logged == 1).all():
        return "the only epoch logged"
    return "median after epoch 1, or the only epoch logged"


def plot_epoch_time(summary: pd.DataFrame) -> Figure:
    fig, (ax,) = figure()
    plot_lines(ax, summary, "time", "time per epoch (s), log scale")
    plot_ideal_scaling(ax, summary, "time", -1)
    log10_y_axis(ax)
    ax.set_title(f"Training time per epoch ({steady(summary)}) vs ideal 1/N")
    ax.legend()
    return fig


def plot_quality(summary: pd.DataFrame) -> Figure:
    """Final loss and accuracy on axes from 0 (accuracy up to 100%): fitted to the points, a
    difference of 0.001 between rank counts, smaller than a rerun's, filled the panel and read
    as a finding. Where every point is a single run, the titles say no spread was measured."""
    fig, (loss_ax, acc_ax) = figure(2)
    plot_lines(loss_ax, summary, "val_loss", "validation loss (final epoch)")
    plot_lines(acc_ax, summary, "acc", "validation accuracy (%, final epoch)")
    single = (summary["runs"] == 1).all()
    once = "\n(one run per point: no run-to-run spread measured)" if single else ""
    loss_ax.set_title(f"Validation loss{once}")
    acc_ax.set_title(f"Validation accuracy{once}")
    loss_ax.set_ylim(0, 1.1 * summary["val_loss"].max())  # the top point clear of the edge
    acc_ax.set_ylim(0, 100)
    for ax in (loss_ax, acc_ax):
        # The values themselves on the axis: an offset ("+1.918") makes 0.001 look like a lot.
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.legend()
    return fig


def plot_speedup(summary: pd.DataFrame) -> Figure:
    if summary["speedup"].isna().all():
        raise NotPlottable("no 1-GPU run to compare with")
    fig, (speed_ax, eff_ax) = figure(2)
    one = results_summary.rank_unit(summary)[0]
    rows = plot_lines(speed_ax, summary, "speedup", f"speedup over 1 {one} (x), log scale")
    gpus = sorted(rows["gpus"].unique())
    speed_ax.plot(gpus, gpus, color="black", label="ideal", **IDEAL_STYLE)
    # log-log: the ideal is the diagonal. A speedup below 1 (slower than one GPU) gets ticks of
    # its own (1/2, 1/4...) and every point its value: the GPU counts alone label none of it.
    below_one = math.floor(math.log2(min(rows["speedup"].min(), 1)))
    log2_axis(speed_ax, "y", [*gpus, *(2.0**k for k in range(below_one, 0))])
    label_points(speed_ax, rows["gpus"], rows["speedup"], rows["speedup"].map("{:.2f}".format))
    speed_ax.set_title(f"Speedup (epoch time on 1 {one} / on N)")
    speed_ax.legend()
    plot_lines(eff_ax, summary, "efficiency", "parallel efficiency (%)")
    eff_ax.axhline(100, color="black", label="ideal", **IDEAL_STYLE)
    eff_ax.set_ylim(0, max(110, rows["efficiency"].max() * 1.1))
    eff_ax.set_title("Efficiency (speedup / N)")
    eff_ax.legend()
    return fig


def plot_throughput(summary: pd.DataFrame) -> Figure:
    """Images/s of all GPUs against the ideal and, where the runs reported it, the model
    TFLOP/s each GPU achieved, each point labelled with its MFU where the peak was known."""
    has_tflops = "tflops" in summary and summary["tflops"].notna().any()
    fig, axes = figure(2 if has_tflops else 1)
    one, many = results_summary.rank_unit(summary)
    plot_lines(axes[0], summary, "throughput", f"throughput (images/s, all {many})")
    plot_ideal_scaling(axes[0], summary, "throughput", 1)
    axes[0].set_title(f"Training throughput ({steady(summary)}) vs ideal N x")
    if has_tflops:
        rows = plot_lines(axes[1], summary, "tflops", f"model TFLOP/s per {one} (cost_model.py)")
        rows = rows.dropna(subset=["mfu"])
        label_points(axes[1], rows["gpus"], rows["tflops"], rows["mfu"].map("MFU {:.1f}%".format))
        axes[1].set_title("How close to the hardware: achieved model FLOP rate")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.legend()
    return fig


BAR_WIDTH = 0.7


def plot_time_breakdown(summary: pd.DataFrame) -> Figure:
    """A stacked bar per strategy and GPU count of where the epoch went (the parts add up to the
    epoch time), and each strategy's ideal: its 1-GPU time / N."""
    rows = summary.dropna(subset=list(utils.TIME_PARTS)).sort_values(results_summary.POINT)
    if rows.empty:
        raise NotPlottable(f"no {', '.join(utils.TIME_PARTS)} values")
    fig, (ax,) = figure()
    one = results_summary.rank_unit(rows)[0]
    fig.set_figwidth(max(8.5, 0.9 * len(rows) + 4))  # room for the legend beside the bars
    x = range(len(rows))
    bottom = pd.Series(0.0, index=rows.index)
    for part in utils.TIME_PARTS:
        height = rows[part]
        ax.bar(x, height, bottom=bottom, label=utils.LABEL[part], width=BAR_WIDTH)
        bottom += height
    curve = results_summary.POINT[:-1]
    one_gpu = rows[rows["gpus"] == 1].set_index(curve)["time"]
    ideal = pd.Series(rows[curve].itertuples(index=False, name=None), index=rows.index)
    ideal = ideal.map(one_gpu) / rows["gpus"]
    # A dash across each bar: a line, so that its legend entry is as small as the others'.
    dash = dict(color="black", zorder=3, label=f"ideal: time on 1 {one} / N", **IDEAL_STYLE)
    ax.hlines(ideal, [i - BAR_WIDTH / 2 for i in x], [i + BAR_WIDTH / 2 for i in x], **dash)
    mark_gpu_busy(ax, rows.get("gpu_busy", pd.Series(math.nan, index=rows.index)), bottom)
    ax.set_xticks(
        list(x),
        [results_summary.point_name(rows, r).replace(" on ", "\n") for _, r in rows.iterrows()],
    )
    ax.set_ylabel(f"seconds in one epoch ({steady(summary)})")  # steady_breakdown's epoch
    ax.set_title("Where an epoch's time goes")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def mark_gpu_busy(ax, shares: pd.Series, tops: pd.Series) -> None:
    """Each bar's gpu_busy above it, so that a bar whose time is the host's says so; nothing
    where the share is unknown (a CPU's runs)."""
    known = shares.notna().to_numpy()
    if known.any():
        bars = [i for i, k in enumerate(known) if k]
        marks = [results_summary.gpu_busy_mark(share, "\n") for share in shares[known]]
        label_points(ax, bars, tops[known], marks, (0, 3), ha="center", fontsize="x-small")
        ax.set_ylim(top=1.15 * ax.get_ylim()[1])  # room for the marks above the tallest bar


def comm_points(comm: pd.DataFrame | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The [COMM] lines at world sizes above 1 (a single rank moves nothing between ranks: its
    bus bandwidth is 0 by definition), median over runs: the message-size sweep, and the
    model's own messages (DDP's buckets, each FSDP unit: comm_bench.messages)."""
    if comm is None or comm.empty:
        raise NotPlottable(f"no [COMM] lines ({COMM_CSV}: run with --comm-benchmark)")
    between = comm[comm["world_size"] > 1]
    is_sweep = between["label"] == "sweep"
    if not is_sweep.any():
        raise NotPlottable("no message-size sweep at a world size above 1")
    # The whole gradient (label grad) is no message either strategy sends: DDP sends buckets.
    own = between[~is_sweep & (between["label"] != "grad")]
    keys = ["op", "world_size", "bytes"]
    return tuple(
        rows.groupby(keys, as_index=False)["busbw_gbps"].median()
        for rows in (between[is_sweep], own)
    )


# How each collective's own messages are named on the figure.
OWN_MESSAGES = {
    "all_reduce": "DDP's gradient buckets",
    "all_gather": "FSDP's units (gathered)",
    "reduce_scatter": "FSDP's units (gradients)",
}


def plot_comm_bandwidth(comm: pd.DataFrame | None) -> Figure:
    """Bus bandwidth over message size, one curve per world size, and on them where this
    model's own messages sit: left of the knee they are latency-bound, on the plateau
    bandwidth-bound."""
    points, own = comm_points(comm)
    ops = sorted(points["op"].unique())
    fig, axes = figure(len(ops))
    for ax, op in zip(axes, ops):
        for world_size, line in points[points["op"] == op].groupby("world_size"):
            (curve,) = ax.plot(
                line["bytes"], line["busbw_gbps"], marker="o", label=f"{world_size} ranks"
            )
            mine = own[(own["op"] == op) & (own["world_size"] == world_size)]
            if not mine.empty:  # the model's own messages: stars of the curve's colour
                star = dict(marker="*", s=140, color=curve.get_color(), edgecolors="black")
                label = f"{OWN_MESSAGES[op]}, {world_size} ranks"
                ax.scatter(mine["bytes"], mine["busbw_gbps"], zorder=3, label=label, **star)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes), log scale")
        ax.set_ylabel("bus bandwidth (GB/s, nccl-tests' busbw)")
        ax.set_title(op)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    return fig


def plot_gpu_timeline(timeline: pd.DataFrame | None) -> Figure:
    """Memory used and utilisation of every sampled GPU over its job's time (nvidia-smi, by
    run.sh's samplers): one line per GPU, coloured by run."""
    if timeline is None or timeline.empty:
        raise NotPlottable(
            f"no GPU samples ({GPU_TIMELINE_CSV}: run.sh samples where nvidia-smi exists)"
        )
    fig, (memory, use) = figure(2)
    runs = timeline.groupby(["strategy", "gpus", "job_id"], dropna=False, sort=True)
    for i, ((strategy, gpus, job_id), run) in enumerate(runs):
        for j, (_, samples) in enumerate(run.groupby(["host", "gpu"])):
            label = f"{strategy} {gpus:.0f} GPU(s), job {job_id}" if j == 0 else None
            for ax, column in ((memory, "mem_mib"), (use, "util_pct")):
                ax.plot(samples["seconds"], samples[column], color=color(i), lw=1, label=label)
    memory.set_ylabel("memory used (MiB, nvidia-smi)")
    use.set_ylabel("utilisation (%, nvidia-smi)")
    use.set_ylim(0, 105)
    for ax in (memory, use):
        ax.set_xlabel("seconds since the job's first sample")
        ax.grid(True, alpha=0.3)
    use.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def plot_bubble(results: pd.DataFrame) -> Figure:
    """The pipeline's measured bubble against its micro-batches, one line per stage count,
    each beside the textbook's (p - 1) / (m + p - 1)."""
    table = results_summary.bubble_table(results)
    if table.empty:
        raise NotPlottable("no pipeline runs (bubble)")
    fig, (ax,) = figure()
    for i, (stages, points) in enumerate(table.groupby("gpus")):
        m, line = points["microbatches"], dict(color=color(i))
        ax.plot(m, points["bubble"], marker="o", label=f"{stages:.0f} stages, measured", **line)
        textbook = dict(label=f"{stages:.0f} stages, textbook", **line, **IDEAL_STYLE)
        ax.plot(m, points["bubble_ideal"], **textbook)
    log2_axis(ax, "x", table["microbatches"])
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("share of a step a stage waits")
    ax.set_ylim(0, 1)
    ax.set_title("Pipeline bubble vs textbook (p - 1) / (m + p - 1)")
    ax.legend()
    return fig


FIGURES = {
    "epoch_time.png": plot_epoch_time,
    "val_loss_acc.png": plot_quality,
    "peak_memory.png": plot_peak_memory,
    "bytes_per_parameter.png": plot_bytes_per_parameter,
    "largest_model.png": plot_largest_model,
    "speedup_efficiency.png": plot_speedup,
    "throughput.png": plot_throughput,
    "time_breakdown.png": plot_time_breakdown,
    "comm_bandwidth.png": plot_comm_bandwidth,
    "gpu_timeline.png": plot_gpu_timeline,
    "pipeline_bubble.png": plot_bubble,
}
# Figures drawn from a CSV that collect_results.py writes beside the results; the others are
# drawn from the summary.
BESIDE = {"comm_bandwidth.png": COMM_CSV, "gpu_timeline.png": GPU_TIMELINE_CSV}
# Figures drawn from the results' rows: the summary's one row per strategy and GPU count merges
# a pipeline's runs at different micro-batches.
FROM_RESULTS = {"pipeline_bubble.png"}
# Figures drawn for a GPU of --gpu-memory GB (projection.py).
PROJECTED = {"largest_model.png"}


def plot_all(
    results: pd.DataFrame,
    out_dir: Path,
    beside: dict[str, pd.DataFrame | None] | None = None,
    gpu_memory: float | None = None,
) -> list[Path]:
    """Every figure there is data for; `beside` holds the CSVs found beside the results, and
    gpu_memory the GB of the GPU the projection is for (None: projection.gpu_memory's)."""
    beside = beside or {}
    summary = results_summary.summarize(results, beside.get(COMM_CSV))
    subtitle = results_summary.context(results)
    written = []
    for name, draw in FIGURES.items():
        try:
            if name in BESIDE:
                fig = draw(beside.get(BESIDE[name]))
            elif name in PROJECTED:
                fig = draw(summary, gpu_memory)
            else:
                fig = draw(results if name in FROM_RESULTS else summary)
        except NotPlottable as e:
            plt.close("all")
            # A figure of that name from an earlier run would pass for this run's (the report
            # no longer lists it); only the names of FIGURES are removed, never other files.
            (out_dir / name).unlink(missing_ok=True)
            utils.note(f"not written {name}: {e}")
            continue
        save_png(fig, out_dir / name, subtitle)
        written.append(out_dir / name)
    return written


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--csv",
        type=Path,
        default=DEFAULT_RESULTS,
        help="collect_results.py's CSV, or the course's results_*.csv",
    )
    p.add_argument("--out-dir", type=Path, default=Path("plots"), help="folder for the PNGs")
    p.add_argument(
        "--report",
        action="store_true",
        help="also write report.md in the folder: table, figures, largest costs, and the "
        "largest model that fits a GPU",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GB",
        help="the GPU the largest model is projected onto (GiB; default: the runs' own GPU "
        "where their logs say, else 80)",
    )
    return p.parse_args(argv)


def read_beside(results_csv: Path, name: str) -> pd.DataFrame | None:
    """A CSV collect_results.py wrote beside the results (comm.csv, gpu_timeline.csv), or None
    where the jobs gave nothing for it."""
    path = side_path(results_csv, name)
    return read_csv(path) if path.exists() else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.gpu_memory is not None and not args.gpu_memory > 0:
        utils.fail(f"--gpu-memory must be a positive number of GB, got {args.gpu_memory:g}")
    try:
        results = read_results(args.csv)
        beside = {name: read_beside(args.csv, name) for name in set(BESIDE.values())}
        comm = beside[COMM_CSV]
    except utils.UsageError as e:
        utils.fail(str(e))
    try:
        written = plot_all(results, args.out_dir, beside, args.gpu_memory)
        if args.report and written:
            report = results_summary.write_report(
                results, comm, written, args.out_dir, args.gpu_memory
            )
            utils.note(f"wrote {report}")
    except OSError as e:
        utils.fail(f"cannot write into {args.out_dir}: {e.strerror or e}")
    if not written:
        utils.fail(f"nothing to plot in {args.csv}")
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
