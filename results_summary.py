"""The summary of a results table (collect_results.py's CSV, or the course's): one row per
strategy and GPU count, medians over repeated runs, speedup and efficiency against one GPU, and
the time the runs' messages would take at the bandwidth they measured. collect_results.py prints
it and plot_results.py draws it, so table and figures agree; the words around it (what ran,
the warnings, report.md with each point's largest cost) are written here too.
"""

import math
from pathlib import Path

import pandas as pd

import config
import projection
import utils
from utils import COURSE_FIELDS, FSDP_ROOT_UNIT, TIME_PARTS

# The columns that name a run, first in the CSV, then the course's; a run's rows are those of
# one log file.
IDENTITY = ("strategy", "gpus", "nodes", "job_id")
RUN_COLUMNS = ("sweep", "log", "model", *IDENTITY)
COURSE_COLUMNS = tuple(f.name for f in COURSE_FIELDS)  # epoch, time, val_loss, acc, peak_mem
# A run's model, from its [CONFIG] line; the course's logs and CSVs, and logs older than the
# model axis, trained main.py's default, the course CNN.
DEFAULT_MODEL = config.Config.model
# What a point is: a model's strategy on a number of GPUs.
POINT = ["model", "strategy", "gpus"]


def rank_unit(table: pd.DataFrame) -> tuple[str, str]:
    """What the `gpus` column counts, singular and plural (utils.rank_unit): the course's CSV
    names no device; its runs had a GPU each."""
    return utils.rank_unit(set(table["device"].dropna()) if "device" in table else set())


def cores_outnumbered(results: pd.DataFrame) -> str | None:
    """A warning naming the points whose ranks had more threads than their node had cores."""
    if "threads_per_core" not in results:
        return None
    shared = results[pd.to_numeric(results["threads_per_core"], errors="coerce") > 1]
    if shared.empty:
        return None
    points = sorted(set(zip(shared["strategy"], shared["gpus"])))
    names = ", ".join(f"{strategy} on {gpus:.0f}" for strategy, gpus in points)
    return (
        f"warning: the ranks outnumbered the CPU cores of their node in {names} "
        f"{rank_unit(shared)[1]}: their times measure how the ranks shared the cores, not the "
        "strategy"
    )


def mixed_steps(results: pd.DataFrame) -> list[str]:
    """A warning for each strategy whose points mix graphed and eager steps (two clocks)."""
    if "step" not in results:
        return []
    found = []
    for strategy, rows in results.dropna(subset=["step"]).groupby("strategy"):
        kinds = {k: sorted(set(r["gpus"])) for k, r in rows.groupby("step")}
        if len(kinds) > 1:
            where = "; ".join(
                f"{k} at {', '.join(f'{g:.0f}' for g in v)}" for k, v in kinds.items()
            )
            found.append(
                f"warning: {strategy}'s points mix graphed and eager steps ({where} "
                f"{rank_unit(rows)[1]}): its curve compares two clocks, not only rank counts"
            )
    return found


def warnings(results: pd.DataFrame) -> list[str]:
    """How the runs ran that makes their times measure something other than the strategy."""
    shared = cores_outnumbered(results)
    return ([shared] if shared else []) + mixed_steps(results)


def with_run_columns(results: pd.DataFrame) -> pd.DataFrame:
    """The run columns a CSV lacks (the course's) as unknown; the model as DEFAULT_MODEL."""
    missing = {c: pd.NA for c in RUN_COLUMNS if c not in results}
    results = results.assign(**missing)
    return results.assign(model=results["model"].fillna(DEFAULT_MODEL))


def median_after_first(run: pd.DataFrame, column: str) -> float:
    """Median over the epochs after the first, which carries the warm-up (one epoch: itself)."""
    if column not in run:
        return math.nan
    steady = run[column].iloc[1:] if len(run) > 1 else run[column]
    return steady.median()


# Time parts a log written before them lacks, and what its line held in their place: t_comm
# held the whole rest, at one rank too.
LATER_PARTS = {"t_other": 0.0}


def steady_breakdown(run: pd.DataFrame) -> dict:
    """The time parts of one epoch, so that they add up to its time: the reliable epoch after
    the first of median time (the faster of two in the middle); and how many were unreliable
    (measure.time_breakdown could not tell compute from the rest)."""
    steady = run.iloc[1:] if len(run) > 1 else run
    flags = steady["breakdown"] if "breakdown" in steady else pd.Series("ok", index=steady.index)
    unreliable = flags == "unreliable"
    reliable = steady[~unreliable].sort_values("time")
    epoch = reliable.iloc[(len(reliable) - 1) // 2] if len(reliable) else {}
    parts = {t: epoch.get(t, math.nan) for t in TIME_PARTS}
    if pd.notna(parts["t_compute"]):  # a breakdown, perhaps logged before some of its parts
        parts.update({t: v for t, v in LATER_PARTS.items() if pd.isna(parts[t])})
    return {**parts, "unreliable_epochs": int(unreliable.sum())}


def run_summaries(results: pd.DataFrame) -> pd.DataFrame:
    """One row per run: final-epoch quality, steady epoch time and throughput, peak memory."""
    rows = []
    results = with_run_columns(results)
    for key, run in results.groupby(list(RUN_COLUMNS), dropna=False, sort=False):
        run = run.sort_values("epoch")
        final = run.iloc[-1]
        rows.append(
            {
                **dict(zip(RUN_COLUMNS, key)),
                "epochs": final["epoch"],
                "epochs_logged": len(run),  # the course's CSV keeps only the last
                "val_loss": final["val_loss"],
                "acc": final["acc"],
                "time": median_after_first(run, "time"),
                "throughput": median_after_first(run, "throughput"),
                "peak_mem": run["peak_mem"].max(),
                **{m: run[m].max() if m in run else math.nan for m in MEMORY},
                **steady_breakdown(run),
                **{t: median_after_first(run, t) for t in (*UTILISATION, *BUBBLE)},
                "steps": final.get("train_images", math.nan) / final.get("global_batch", math.nan),
                **{c: final.get(c, math.nan) for c in ("microbatches", "threads_per_core", *SIZES)},
                **{c: final.get(c, pd.NA) for c in ("sharding", "step", "device", *STATE_SETTING)},
            }
        )
    return pd.DataFrame(rows)


# Bytes a rank keeps between steps, measured and predicted (cost_model.py), and the training
# peak above them per image of the rank's batch: the largest of each over a run's epochs.
MEMORY = ("state_mem", "state_pred", "act_per_image")
# What a run's memory scales with: its model's parameters ([CONFIG]), its rank's batch, and
# the memory of its GPU where its log says.
SIZES = ("parameters", "local_batch", "gpu_memory")
# What a parameter's state is made of: the optimizer's tensors, in the precision's dtype.
STATE_SETTING = ("optimizer", "precision")


def joined(values: pd.Series, sep: str = "/", fmt: str = "{}") -> str:
    """The distinct values of a column as one text: `cpu`, or `a/b` where runs differ."""
    return sep.join(fmt.format(v) for v in sorted(values.dropna().unique()))


# How close to the hardware (cost_model.py): model TFLOP/s per device, MFU in percent (empty where
# the run knew no peak for its device), and the share of the epoch the GPU ran the steps'
# kernels (measure.gpu_busy; empty on a CPU).
UTILISATION = ("tflops", "mfu", "gpu_busy")

# Below this gpu_busy a point is host-bound: its GPU idled longer than it ran kernels, so the
# host's Python and launches, not the GPU, set the step's time, and more or faster GPUs cannot
# shorten it (docs/metrics.md).
HOST_BOUND_BELOW = 0.5


def host_bound(gpu_busy: float) -> bool:
    """Whether a point's gpu_busy says the host set its time; False where unknown (nan)."""
    return gpu_busy < HOST_BOUND_BELOW


# A pipeline's bubble (pipeline_utils.py): measured, and the textbook's (p - 1) / (m + p - 1);
# empty for the other strategies.
BUBBLE = ("bubble", "bubble_ideal")


def message_seconds(comm: pd.DataFrame, op: str, label_prefix: str) -> float:
    """Sum of the measured times of a run's messages of one kind (nan if it measured none)."""
    rows = comm[(comm["op"] == op) & comm["label"].astype(str).str.startswith(label_prefix)]
    return rows["time_us"].sum() / 1e6 if not rows.empty else math.nan


def comm_model_time(strategy: str, steps: float, sharding, comm: pd.DataFrame) -> float:
    """Seconds per epoch the model's messages take at the job's measured bandwidth, if nothing
    hid them. DDP all-reduces every bucket a step; FSDP gathers every unit for forward (and
    again for backward unless grad_op kept it) and reduce-scatters its gradients."""
    if comm.empty:
        return math.nan
    if strategy == "ddp":
        return steps * message_seconds(comm, "all_reduce", "bucket")
    if strategy in config.SHARDED and str(sharding) == "no_shard":
        return steps * message_seconds(comm, "all_reduce", "grad")  # FSDP at 1 rank: DDP-like
    if strategy in config.SHARDED:
        # grad_op keeps each unit gathered from forward to backward; full and hybrid (full
        # within a node) gather again, all but the root, kept for backward under every
        # sharding; FSDP's default is full, for logs that do not say.
        gathered = message_seconds(comm, "all_gather", "unit_")
        if str(sharding) != "grad_op":
            root = message_seconds(comm, "all_gather", f"unit_{FSDP_ROOT_UNIT}")
            gathered += gathered - (0.0 if math.isnan(root) else root)
        return steps * (gathered + message_seconds(comm, "reduce_scatter", "unit_"))
    return math.nan  # dp and single send nothing through the process group


def with_comm_model(runs: pd.DataFrame, comm: pd.DataFrame | None) -> pd.DataFrame:
    """runs with comm_model: each run's modelled communication time, from its own [COMM] lines."""
    if comm is None or comm.empty:
        return runs.assign(comm_model=math.nan)
    by_log = dict(list(comm.groupby(["sweep", "log"], dropna=False)))
    empty = comm.iloc[:0]
    return runs.assign(
        comm_model=[
            comm_model_time(
                r["strategy"], r["steps"], r["sharding"], by_log.get((r["sweep"], r["log"]), empty)
            )
            for _, r in runs.iterrows()
        ]
    )


def summarize(results: pd.DataFrame, comm: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per model, strategy and GPU count: medians over runs (with min and max), speedup and
    efficiency against the strategy's 1-GPU epoch time, and where [COMM] lines are given the
    modelled communication (comm_model) beside the measured t_comm."""
    runs = with_comm_model(run_summaries(results), comm)
    table = runs.groupby(POINT, as_index=False).agg(
        nodes=("nodes", lambda n: joined(n, ",", "{:.0f}")),
        runs=("epochs", "size"),
        epochs=("epochs", "max"),
        epochs_logged=("epochs_logged", "min"),
        **{c: (c, "median") for c in ("val_loss", "acc", "time", "throughput")},
        # The spread over repeated runs (--repeats): a single run is one point, not a measurement.
        **{f"{c}_{f}": (c, f) for c in ("time", "throughput") for f in ("min", "max")},
        **{c: (c, "max") for c in ("peak_mem", *MEMORY, *SIZES)},
        **{t: (t, "median") for t in (*TIME_PARTS, *UTILISATION, *BUBBLE, "comm_model")},
        unreliable_epochs=("unreliable_epochs", "sum"),
        threads_per_core=("threads_per_core", "max"),
        step=("step", lambda s: joined(s) or pd.NA),
        **{c: (c, joined) for c in ("device", *STATE_SETTING)},
    )
    one_gpu = table[table["gpus"] == 1].set_index(["model", "strategy"])["time"]
    # A pipeline has no 1-GPU run: against its model's DDP on one GPU.
    against = table["strategy"].where(table["strategy"] != "pipeline", "ddp")
    baseline = pd.Series(list(zip(table["model"], against))).map(one_gpu)
    table["speedup"] = baseline.to_numpy() / table["time"]
    table["efficiency"] = 100 * table["speedup"] / table["gpus"]
    return table.sort_values(POINT, ignore_index=True)


def bubble_table(results: pd.DataFrame) -> pd.DataFrame:
    """The pipeline's median bubble by stages (GPUs) and micro-batches, beside the textbook's."""
    runs = run_summaries(results)
    if "bubble" not in runs:
        return pd.DataFrame(columns=["gpus", "microbatches", "runs", *BUBBLE])
    runs = runs.dropna(subset=["bubble"])
    return runs.groupby(["gpus", "microbatches"], as_index=False).agg(
        runs=("bubble", "size"), bubble=("bubble", "median"), bubble_ideal=("bubble_ideal", "max")
    )


# (column, header, format) of the pipeline's bubble table (markdown).
BUBBLE_COLUMNS = (
    ("gpus", "stages (GPUs)", "{:.0f}"),
    ("microbatches", "micro-batches", "{:.0f}"),
    ("runs", "runs", "{:.0f}"),
    ("bubble", "bubble measured", "{:.3f}"),
    ("bubble_ideal", "textbook (p-1)/(m+p-1)", "{:.3f}"),
)


def bubble_markdown(table: pd.DataFrame) -> str:
    return markdown(table, BUBBLE_COLUMNS)


def scaling(results: pd.DataFrame, brief: bool = False) -> str | None:
    """Which study the runs make, strong (one global batch) or weak (one batch per rank); None
    where the CSV does not say or the runs mix batch sizes."""
    if not {"global_batch", "local_batch"} <= set(results) or results["gpus"].nunique() < 2:
        return None
    global_batch, local_batch = results["global_batch"].dropna(), results["local_batch"].dropna()
    one = rank_unit(results)[0]
    if global_batch.nunique() == 1:
        study = f"strong scaling: global batch {global_batch.iloc[0]:.0f}"
        return study if brief else f"{study} at every {one} count"
    if local_batch.nunique() == 1:
        return f"weak scaling: {local_batch.iloc[0]:.0f} images per {one} per step"
    return None


# (column, header, format) of the printed table; {rank} and {ranks} in a header are what the
# `gpus` column counts (rank_unit).
TABLE_COLUMNS = (
    ("model", "model", "{}"),  # where the runs trained more than one
    ("strategy", "strategy", "{}"),
    ("gpus", "{ranks}", "{:d}"),
    ("nodes", "nodes", "{}"),
    ("runs", "runs", "{:d}"),
    ("step", "step", "{}"),  # one CUDA graph or eager: which clock the row measures
    ("epochs", "epochs", "{:d}"),
    ("val_loss", "final val loss", "{:.4f}"),
    ("acc", "final acc %", "{:.2f}"),
    ("time", "epoch time s", "{:.2f}"),
    ("time_range", "min-max s", "{}"),
    ("throughput", "images/s", "{:.0f}"),
    ("peak_mem", "peak mem MB", "{:.0f}"),
    ("speedup", "speedup", "{:.2f}"),
    ("efficiency", "efficiency", "{:.0f}%"),
    ("tflops", "TFLOP/s per {rank}", "{:.3g}"),
    ("mfu", "MFU %", "{:.1f}"),
    ("gpu_busy", "GPU busy", "{:.2f}"),  # below HOST_BOUND_BELOW: host-bound; GPU runs only
    ("bubble", "bubble", "{:.2f}"),  # a pipeline's (pipeline_utils.py)
    # Communication per epoch: not hidden behind compute (measured), and what the model's
    # messages would take at the bandwidth the job measured (--comm-benchmark).
    ("t_comm", "t_comm s", "{:.3f}"),
    ("comm_model", "comm at measured bw s", "{:.3f}"),
    # The rest of a one-rank epoch, which sends nothing: what the step's model does not explain.
    ("t_other", "unexplained s", "{:.3f}"),
)


def cell(value, fmt: str) -> str:
    if pd.isna(value) or value == "":
        return "n/a"
    return fmt.format(int(value) if "d}" in fmt else value)


def time_range(row) -> str:
    """'min-max' of the epoch time over repeated runs; empty for a single run."""
    return f"{row['time_min']:.2f}-{row['time_max']:.2f}" if row["runs"] > 1 else ""


def markdown(table: pd.DataFrame, columns) -> str:
    """A markdown table of the columns (column, header, format): text ({}) to the left, numbers
    to the right, n/a where empty."""
    lines = [
        "| " + " | ".join(header for _, header, _ in columns) + " |",
        "|" + "|".join("---" if fmt == "{}" else "--:" for *_, fmt in columns) + "|",
    ]
    for _, row in table.iterrows():
        lines.append("| " + " | ".join(cell(row[c], fmt) for c, _, fmt in columns) + " |")
    return "\n".join(lines)


def markdown_table(summary: pd.DataFrame) -> str:
    """TABLE_COLUMNS, less gpu_busy where no row has it and the model where one alone ran."""
    summary = summary.assign(time_range=summary.apply(time_range, axis=1))
    left_out = {"gpu_busy"} if summary["gpu_busy"].isna().all() else set()
    left_out |= {"model"} if summary["model"].nunique() == 1 else set()
    rank, ranks = rank_unit(summary)
    columns = [
        (c, header.format(rank=rank, ranks=ranks), fmt)
        for c, header, fmt in TABLE_COLUMNS
        if c not in left_out
    ]
    return markdown(summary, columns)


# ------------------------------------------------------------------ report.md


def values(results: pd.DataFrame, column: str, fmt: str = "{}") -> str | None:
    """A column's distinct values as text ('a / b' where runs differ), or None if absent."""
    if column not in results or results[column].isna().all():
        return None
    return joined(results[column], " / ", fmt)


def context(results: pd.DataFrame) -> str:
    """What ran, as far as the CSV says: device, data set and size, batch, epochs, sweep."""
    parts = []
    if model := values(results, "model"):
        parts.append(f"model {model}")
    if device := values(results, "device"):
        parts.append(f"device {device}")
    data = values(results, "dataset")
    images = values(results, "train_images", "{:,.0f}")
    if data or images:
        parts.append(" ".join(filter(None, [data, images and f"({images} images/epoch)"])))
    if study := scaling(results, brief=True):
        parts.append(study)
    elif batch := values(results, "global_batch", "{:.0f}"):
        parts.append(f"global batch {batch}")
    epochs = results.groupby(["strategy", "gpus"])["epoch"].max()
    parts.append(f"{joined(epochs, ' / ', '{:.0f}')} epochs")
    if sweep := values(results, "sweep"):
        parts.append(f"sweep {sweep}")
    parts += [warning.removeprefix("warning: ") for warning in warnings(results)]
    return " · ".join(parts)


def gpu_busy_mark(share: float, sep: str = ", ") -> str:
    """A point's gpu_busy in words, host-bound below HOST_BOUND_BELOW."""
    mark = f"GPU busy {100 * share:.0f}%"
    return f"{mark}{sep}host-bound" if host_bound(share) else mark


def point_name(summary: pd.DataFrame, row) -> str:
    """A row of the summary in words: `ddp on 4 GPUs`, with its model where several ran."""
    one, many = rank_unit(summary)
    model = f"{row['model']} " if summary["model"].nunique() > 1 else ""
    return f"{model}{row['strategy']} on {row['gpus']:.0f} {one if row['gpus'] == 1 else many}"


def largest_costs(summary: pd.DataFrame) -> list[str]:
    """One sentence per point: the largest part of an epoch, what the step's model does not
    explain, the modelled communication beside the measured, the unreliable epochs left out,
    and on a GPU its gpu_busy_mark; then what host-bound means."""
    sentences = []
    for _, row in summary.iterrows():
        point = point_name(summary, row)
        unreliable = row.get("unreliable_epochs", 0)
        left_out = (
            f"{unreliable:.0f} epoch(s) left out, whose compute calibration could not tell "
            "compute from the rest (breakdown=unreliable)"
        )
        busy = row.get("gpu_busy", math.nan)
        busy = f"; {gpu_busy_mark(busy)}" if pd.notna(busy) else ""
        if row[list(utils.TIME_PARTS)].isna().any():
            if unreliable > 0:
                sentences.append(f"- {point}: no reliable breakdown; {left_out}{busy}.")
            continue
        part = max(utils.TIME_PARTS, key=lambda p: row[p])
        epoch = sum(row[p] for p in utils.TIME_PARTS)  # the epoch the parts are of
        text = (
            f"{point}: the largest cost is {utils.LABEL[part]}, {row[part]:.3f} s of "
            f"{epoch:.2f} s per epoch ({100 * row[part] / epoch:.0f}%)"
        )
        if row.get("threads_per_core", 0) > 1:
            text += "; but its ranks shared too few cores for this to be a finding"
        if part != "t_other" and row["t_other"] > 0:
            text += (
                f"; {row['t_other']:.3f} s ({100 * row['t_other'] / epoch:.0f}%) the step's "
                "model does not explain"
            )
        if pd.notna(row.get("comm_model")) and (row["comm_model"] > 0 or row["t_comm"] > 0):
            text += (
                f"; its messages would take {row['comm_model']:.3f} s at the measured "
                f"bandwidth, against {row['t_comm']:.3f} s of communication not hidden"
            )
        if unreliable > 0:
            text += f"; {left_out}"
        sentences.append(f"- {text}{busy}.")
    sentences = sentences or [f"- The CSV has no {', '.join(utils.TIME_PARTS)}: no breakdown."]
    if "gpu_busy" in summary and summary["gpu_busy"].notna().any():
        sentences.append(HOST_BOUND_NOTE.format(100 * HOST_BOUND_BELOW))
    return sentences


HOST_BOUND_NOTE = (
    "\nGPU busy: the share of the epoch the GPU ran the step's kernels (gpu_busy). Host-bound: "
    "below {:.0f}%, the GPU idled longer than it worked, so the host (Python, kernel launches), "
    "not the GPU, set the step's time, and more GPUs cannot shorten it (docs/metrics.md)."
)


def pipeline_section(results: pd.DataFrame) -> list[str]:
    """The pipeline's bubble by stages and micro-batches, where the CSV has pipeline runs."""
    table = bubble_table(results)
    if table.empty:
        return []
    return ["## Pipeline bubble", "", bubble_markdown(table), ""]


def report_text(
    results: pd.DataFrame,
    comm: pd.DataFrame | None,
    written: list[Path],
    gpu_memory: float | None = None,
) -> str:
    """report.md: what ran, the table, the largest costs, the pipeline's bubble, the largest
    model that fits a GPU of gpu_memory GB (projection.py), and the figures."""
    summary = summarize(results, comm)
    return "\n".join(
        [
            "# Scaling report",
            "",
            context(results),
            "",
            markdown_table(summary),
            "",
            f"## Largest cost per strategy and {rank_unit(summary)[0]} count",
            "",
            *largest_costs(summary),
            "",
            *pipeline_section(results),
            *projection.projection_section(summary, gpu_memory, rank_unit(summary)[0]),
            "## Figures",
            "",
            *(f"![{p.stem}]({p.name})\n" for p in written),
            "",
        ]
    )


def write_report(
    results: pd.DataFrame,
    comm: pd.DataFrame | None,
    written: list[Path],
    out_dir: Path,
    gpu_memory: float | None = None,
) -> Path:
    path = out_dir / "report.md"
    text = report_text(results, comm, written, gpu_memory)
    utils.write_atomically(path, lambda temp: temp.write_text(text))
    return path
