"""Collect the `[METRIC]` lines of every training log into one CSV, and print a summary.

    python collect_results.py                          # newest sweep in logs/ -> results.csv
    python collect_results.py --all-sweeps             # every sweep in logs/, merged
    python collect_results.py --logs DIR [--logs DIR2] --out FILE

Each sweep of run_benchmarks.py keeps its logs in a folder of its own, logs/sweep-<date-time>/;
a folder of such sweeps is read as its newest sweep, unless --all-sweeps merges them (and says
so). Any other folder is read as it is (e.g. the course's logs). The CSV names each run's sweep,
and a configuration whose runs come from different sweeps is pointed out: its median mixes them.

Reads the project's logs and the course's (`srun -l` rank prefixes, ANSI colours), through
utils.parse_metric. Each log file is one run. Its identity (strategy, GPUs, nodes, job id)
comes from the metric lines' own fields, else from the file name (`ddp_4gpu_1234.log`,
`ddp_4gpu_15epochs.train.log`). A log that gives no trustworthy data (no metric lines, a line
cut off, a run that died before its last epoch, binary data) is named with the reason and
skipped. `X.err` beside `X.log` is that run's stderr: read for crashes, not for metrics.

The summary table (markdown) goes to stdout; notes on skipped files go to stderr.
"""

import argparse
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

import samples
from utils import (
    COMM_FIELDS,
    COURSE_FIELDS,
    FSDP_ROOT_UNIT,
    METRIC_TAG,
    SWEEP_OUTCOME,
    SWEEP_PREFIX,
    UsageError,
    fail,
    parse_comm,
    parse_config,
    parse_metric,
    sweep_folders,
)

# The columns that name a run, first in the CSV; a run's rows are those of one log file.
IDENTITY = ("strategy", "gpus", "nodes", "job_id")
RUN_COLUMNS = ("sweep", "log", *IDENTITY)
COURSE_COLUMNS = tuple(name for name, _ in COURSE_FIELDS)  # epoch, time, val_loss, acc, peak_mem

# Where each identity column is found in a project metric line (one rank per GPU).
LINE_FIELD = {"strategy": "strategy", "gpus": "world_size", "nodes": "nodes", "job_id": "job_id"}

# The sweep's names, `{strategy}_{gpus}gpu[_{nodes}node][_{jobid}].log`, and the course's,
# `ddp_4gpu_15epochs.train.log` (where `_15epochs` is no job id).
LOG_NAME_RE = re.compile(
    r"^(?P<strategy>[A-Za-z][A-Za-z0-9-]*)_(?P<gpus>\d+)gpus?"
    r"(?:_(?P<nodes>\d+)nodes?)?(?:_(?P<job_id>\d+))?(?=[._]|$)"
)


# Lines that mean the program or its job died; after one, a Python exception line
# (`RuntimeError: NCCL timeout`) says best why.
CRASH_MARKERS = (
    "Traceback (most recent call last)",
    "srun: error:",
    "slurmstepd: error:",
    "CANCELLED AT",
    "DUE TO TIME LIMIT",
)
# srun's report of tasks that stopped on a signal after saving (main.py's exit status 3): the
# job requeues itself and goes on in the same log, so it is no crash.
STOPPED_RE = re.compile(r"srun: error: .*Exited with exit code 3$")
EXCEPTION_RE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): ")
STDERR_SUFFIX = ".err"
COMM_CSV = "comm.csv"  # the [COMM] lines, beside the results CSV
DEFAULT_OUT = Path("results.csv")  # whose side CSVs keep their plain names (side_path)


# What to do when there is nothing to read: `make run` prints its lines to the terminal only.
HOW_TO_GET_LOGS = (
    ": logs come from a sweep (python run_benchmarks.py, or with --local on this "
    "machine) or from sbatch run.sh"
)


class Skip(Exception):
    """Why a log gives no data: the file is reported with this reason and left out."""


@dataclass
class Scan:
    """What one log says, line by line."""

    metrics: list[dict] = field(default_factory=list)  # parsed [METRIC] lines, in order
    config: dict = field(default_factory=dict)  # the last [CONFIG] line's fields
    bad_metric_line: int | None = None  # number of a [METRIC] line that is cut off or malformed
    crash_lines: list[str] = field(default_factory=list)  # signs of a crash after the last metric
    comm: list[dict] = field(default_factory=list)  # parsed [COMM] lines (--comm-benchmark)

    @property
    def expected_epochs(self) -> int | None:
        """How many epochs a complete run has, as main.py's [CONFIG] line says."""
        epochs = self.config.get("epochs")
        return epochs if isinstance(epochs, int) else None

    @property
    def threads_per_core(self) -> float:
        """The threads of one node's ranks per CPU core of the node, from the [CONFIG] line (nan
        where it does not say): above 1 the ranks took turns on the cores, and the run's times
        measure that sharing rather than the strategy."""
        try:
            ranks = self.config["world_size"] / self.config["nodes"]
            return ranks * self.config["threads"] / self.config["cpus"]
        except (KeyError, TypeError, ZeroDivisionError):
            return math.nan

    @property
    def step(self) -> str | None:
        """How the run's step ran, from the [CONFIG] line: `graph` (one CUDA graph per step) or
        `eager`; None where the line does not say (the course's logs, older runs)."""
        graphed = self.config.get("cuda_graphs")
        return {"True": "graph", "False": "eager"}.get(str(graphed))

    @property
    def crash(self) -> str | None:
        """The line that says best why the run died, or None."""
        exceptions = [line for line in self.crash_lines if EXCEPTION_RE.search(line)]
        return (exceptions or self.crash_lines or [None])[0]


@dataclass
class LoggedRun:
    """What one log file holds: a run of a sweep, one metric line per epoch."""

    sweep: str
    log: str
    identity: dict
    epochs: list[dict]  # one metric line per epoch, in epoch order
    notes: list[str]
    comm: list[dict] = field(default_factory=list)  # the job's [COMM] lines
    threads_per_core: float = math.nan  # Scan.threads_per_core
    step: str | None = None  # Scan.step


def scan_log(text: str) -> Scan:
    scan = Scan()
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        fields = parse_metric(line)
        if fields is not None:
            scan.metrics.append(fields)
            scan.crash_lines = []  # the run went on: a requeued job starts again after a crash
        elif (comm := parse_comm(line)) is not None:
            scan.comm.append(comm)
        elif METRIC_TAG in line:
            scan.bad_metric_line = scan.bad_metric_line or number
        elif (config := parse_config(line)) is not None:
            scan.config = config
        elif STOPPED_RE.search(line.strip()):
            continue
        elif any(marker in line for marker in CRASH_MARKERS) or (
            scan.crash_lines and EXCEPTION_RE.search(line)
        ):
            scan.crash_lines.append(line.strip()[:160])
    # A last line without its newline was cut off mid-write: even if its course fields parse,
    # the fields after them (strategy, world size...) may be cut short.
    if lines and not text.endswith("\n") and METRIC_TAG in lines[-1]:
        scan.bad_metric_line = scan.bad_metric_line or len(lines)
    return scan


def read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Skip(f"unreadable ({e.strerror})") from None
    if not data:
        raise Skip("empty file")
    if b"\0" in data:
        raise Skip("binary data, not a text log")
    return data.decode("utf-8", errors="replace")  # a stray bad byte must not lose the log


def last_per_epoch(metrics: list[dict]) -> tuple[list[dict], list[int]]:
    """One line per epoch, the last one logged (a requeued job re-runs epochs), and the repeats."""
    by_epoch = {m["epoch"]: m for m in metrics}  # later lines replace earlier ones
    repeated = sorted(e for e, n in Counter(m["epoch"] for m in metrics).items() if n > 1)
    return [by_epoch[e] for e in sorted(by_epoch)], repeated


def check_complete(scan: Scan, epochs: list[int]) -> list[str]:
    """Raises Skip when the run's data cannot be trusted; returns notes on what is odd but kept."""
    if scan.bad_metric_line:
        raise Skip(f"truncated: [METRIC] line {scan.bad_metric_line} is cut off or malformed")
    last, crash = epochs[-1], f" ({scan.crash})" if scan.crash else ""
    if scan.expected_epochs and last < scan.expected_epochs:
        raise Skip(f"incomplete: stopped after epoch {last} of {scan.expected_epochs}{crash}")
    if scan.crash and not scan.expected_epochs:
        raise Skip(f"crashed after epoch {last}{crash}")
    notes = []
    if scan.crash:
        notes.append(f"all {last} epochs done, then it failed{crash}")
    missing = sorted(set(range(epochs[0], last + 1)) - set(epochs))
    if missing:
        notes.append(f"no metric line for epoch(s) {', '.join(map(str, missing))}")
    return notes


def name_identity(log_name: str) -> dict:
    match = LOG_NAME_RE.match(log_name)
    if not match:
        return {}
    found = {k: v for k, v in match.groupdict().items() if v is not None}
    for key in ("gpus", "nodes"):
        if key in found:
            found[key] = int(found[key])
    return found


def run_identity(metrics: list[dict], log_name: str) -> tuple[dict, list[str]]:
    """Strategy, GPUs, nodes, job id: the metric lines' fields first, else the file name's."""
    named, identity, notes = name_identity(log_name), {}, []
    for key, line_field in LINE_FIELD.items():
        values = {m[line_field] for m in metrics if line_field in m}
        if len(values) > 1:
            raise Skip(
                f"metric lines of more than one run ({line_field}: "
                f"{', '.join(sorted(map(str, values)))})"
            )
        if values:
            identity[key] = values.pop()
            if key in named and str(named[key]) != str(identity[key]):
                notes.append(
                    f"file name says {key} {named[key]}, metric lines say "
                    f"{identity[key]}: using the metric lines"
                )
        else:
            identity[key] = named.get(key)
    if identity["strategy"] is None or identity["gpus"] is None:
        raise Skip(
            "unknown run: no strategy or world_size in its metric lines, and its name "
            "is not like {strategy}_{N}gpu_{jobid}.log"
        )
    if identity["job_id"] is not None:
        identity["job_id"] = str(identity["job_id"])  # "1234" and "local" in one column
    return identity, notes


def read_run(path: Path, stderr: Path | None = None) -> LoggedRun:
    """The run one log holds, or Skip with the reason it cannot be used."""
    scan = scan_log(read_text(path))
    if stderr is not None:
        try:
            scan.crash_lines += scan_log(read_text(stderr)).crash_lines
        except Skip:
            pass  # an empty or unreadable stderr says nothing about a crash
    if not scan.metrics:
        crash = f" ({scan.crash})" if scan.crash else ""
        raise Skip(f"no [METRIC] lines{crash}")
    epochs, repeated = last_per_epoch(scan.metrics)
    notes = check_complete(scan, [m["epoch"] for m in epochs])
    if repeated:
        notes.append(
            f"epoch(s) {', '.join(map(str, repeated))} logged more than once "
            "(requeued?): kept the last"
        )
    identity, identity_notes = run_identity(epochs, path.name)
    return LoggedRun(
        sweep_name(path.parent),
        path.name,
        identity,
        epochs,
        notes + identity_notes,
        scan.comm,
        scan.threads_per_core,
        scan.step,
    )


def sweep_name(folder: Path) -> str:
    """A sweep's name in the CSV: its folder's, without the prefix (20261122-141500)."""
    return folder.name.removeprefix(SWEEP_PREFIX)


def log_files(folder: Path) -> list[Path]:
    """The files of a folder that may be run logs: run.sh's sampler CSVs beside them are read
    by samples.py, not here, and the collect job's outcome is none, so they are not reported as
    logs without metrics."""
    if not folder.is_dir():
        raise UsageError(f"no logs folder {folder}{HOW_TO_GET_LOGS}")
    sampled = {path for *_, path in samples.sample_files(folder)}
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p not in sampled
        and p.name != SWEEP_OUTCOME
    )
    if not files:
        raise UsageError(f"no log files in {folder}{HOW_TO_GET_LOGS}")
    return files


def pair_stderr(files: list[Path]) -> tuple[list[Path], dict[Path, Path]]:
    """The logs to read, and for each the `X.err` beside it: its run's stderr, not a run."""
    by_stem = {p.stem: p for p in files if p.suffix != STDERR_SUFFIX}
    logs, stderr_of = [], {}
    for p in files:
        if p.suffix == STDERR_SUFFIX and p.stem in by_stem:
            stderr_of[by_stem[p.stem]] = p
        else:
            logs.append(p)
    return logs, stderr_of


def choose_folders(
    given: list[Path], all_sweeps: bool, report: Callable[[str], None]
) -> list[Path]:
    """The folders to read: each given folder as it is, or, where it holds sweeps, its newest
    sweep (all of them with all_sweeps). Says which, when there was a choice."""
    chosen = []
    for folder in given:
        sweeps = sweep_folders(folder)
        if not sweeps:
            chosen.append(folder)
        elif all_sweeps:
            chosen += sweeps
        else:
            chosen.append(sweeps[-1])
            others = (
                f", the newest of {len(sweeps)} (--all-sweeps merges them)"
                if len(sweeps) > 1
                else ""
            )
            report(f"reading {sweeps[-1]}{others}")
    if len(chosen) > 1:
        report(f"merging {len(chosen)} folders: {', '.join(map(str, chosen))}")
    return chosen


def collect(folders: list[Path], report: Callable[[str], None]) -> list[LoggedRun]:
    """Every usable run in the folders; each skipped file and each oddity goes to report()."""
    runs, read = [], 0
    for folder in folders:
        logs, stderr_of = pair_stderr(log_files(folder))
        read += len(logs)
        for path in logs:
            try:
                run = read_run(path, stderr_of.get(path))
            except Skip as e:
                report(f"skipped {path}: {e}")
                continue
            for note in run.notes:
                report(f"note {path}: {note}")
            runs.append(run)
    if not runs:
        raise UsageError(
            f"no usable [METRIC] lines in any of the {read} files in {', '.join(map(str, folders))}"
        )
    return runs


def rank_unit(table: pd.DataFrame) -> tuple[str, str]:
    """What the `gpus` column counts, singular and plural, for the figures and tables: a rank
    per GPU where the runs trained on CUDA, processes on CPU cores where they trained on the
    CPU. The course's CSV names no device; its runs had a GPU each."""
    devices = set(table["device"].dropna()) - {""} if "device" in table else set()
    if devices <= {"cuda"}:
        return "GPU", "GPUs"
    if devices == {"cpu"}:
        return "CPU rank", "CPU ranks"
    return "rank", "ranks"  # a mix of devices


def cores_outnumbered(results: pd.DataFrame) -> str | None:
    """A warning naming the configurations whose ranks had more threads than their node had
    CPU cores (several ranks on a laptop's cores), or None: their times measure the sharing."""
    if "threads_per_core" not in results:
        return None
    shared = results[pd.to_numeric(results["threads_per_core"], errors="coerce") > 1]
    if shared.empty:
        return None
    names = [
        f"{strategy} on {gpus:.0f}"
        for strategy, gpus in sorted(set(zip(shared["strategy"], shared["gpus"])))
    ]
    return (
        f"warning: the ranks outnumbered the CPU cores of their node in {', '.join(names)} "
        f"{rank_unit(shared)[1]}: their times measure how the ranks shared the cores, not the "
        "strategy"
    )


def mixed_steps(results: pd.DataFrame) -> list[str]:
    """A warning for each strategy whose points mix graphed and eager steps: its curve then
    compares two clocks (a graph's step against an eager one's launches), not GPU counts."""
    if "step" not in results:
        return []
    warnings = []
    for strategy, rows in results.dropna(subset=["step"]).groupby("strategy"):
        kinds = {k: sorted(set(r["gpus"])) for k, r in rows.groupby("step")}
        if len(kinds) > 1:
            where = "; ".join(
                f"{k} at {', '.join(f'{g:.0f}' for g in v)}" for k, v in kinds.items()
            )
            warnings.append(
                f"warning: {strategy}'s points mix graphed and eager steps ({where} "
                f"{rank_unit(rows)[1]}): its curve compares two clocks, not only rank counts"
            )
    return warnings


def mixed_sweeps(runs: list[LoggedRun]) -> list[str]:
    """A warning for each configuration whose runs come from more than one sweep."""
    sweeps_of = {}
    for run in runs:
        key = (run.identity["strategy"], run.identity["gpus"])
        sweeps_of.setdefault(key, set()).add(run.sweep)
    return [
        f"warning: {strategy} on {gpus} GPU(s) has runs from {len(sweeps)} sweeps "
        f"({', '.join(sorted(sweeps))}): the summary takes the median over them all"
        for (strategy, gpus), sweeps in sweeps_of.items()
        if len(sweeps) > 1
    ]


def results_frame(runs: list[LoggedRun]) -> pd.DataFrame:
    """One row per run and epoch: the run's identity, the course's fields, then the others."""
    rows = []
    for run in runs:
        for fields in run.epochs:
            # strategy, nodes, job_id are identity columns already; world_size stays as logged
            other = {k: v for k, v in fields.items() if k not in IDENTITY}
            rows.append(
                {
                    "sweep": run.sweep,
                    "log": run.log,
                    **run.identity,
                    **other,
                    "threads_per_core": run.threads_per_core,
                    "step": run.step,
                }
            )
    frame = pd.DataFrame(rows)  # columns in order of first appearance
    for column in MAY_BE_UNKNOWN:  # `na` becomes an empty cell
        if column in frame:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    leading = [*RUN_COLUMNS, *COURSE_COLUMNS]
    return frame[leading + [c for c in frame.columns if c not in leading]]


def comm_frame(runs: list[LoggedRun]) -> pd.DataFrame:
    """One row per [COMM] line: its run's columns, then the line's fields (comm.csv)."""
    rows = [
        {
            "sweep": run.sweep,
            "log": run.log,
            **run.identity,
            **{k: v for k, v in fields.items() if k not in IDENTITY},
        }
        for run in runs
        for fields in run.comm
    ]
    return pd.DataFrame(rows, columns=None if rows else [*RUN_COLUMNS, *COMM_FIELDS])


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(temp) beside path, then rename: a reader never sees half a file, a failure no file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


# ---- summary: one row per strategy and GPU count ----


def with_run_columns(results: pd.DataFrame) -> pd.DataFrame:
    """Adds the run columns a CSV lacks (the course's has only strategy and gpus) as unknown."""
    missing = {c: pd.NA for c in RUN_COLUMNS if c not in results}
    return results.assign(**missing) if missing else results


def median_after_first(run: pd.DataFrame, column: str) -> float:
    """Median over the epochs after the first, which carries the warm-up (one epoch: itself)."""
    if column not in run:
        return math.nan
    steady = run[column].iloc[1:] if len(run) > 1 else run[column]
    return steady.median()


def steady_breakdown(run: pd.DataFrame) -> dict:
    """The time parts' medians over the epochs after the first whose breakdown is reliable (all
    four from the same epochs, so that they still add up), and how many were not
    (breakdown=unreliable: the compute calibration overshot, train.time_breakdown)."""
    steady = run.iloc[1:] if len(run) > 1 else run
    flags = steady["breakdown"] if "breakdown" in steady else pd.Series("ok", index=steady.index)
    unreliable = flags == "unreliable"
    reliable = steady[~unreliable]
    return {
        **{t: reliable[t].median() if t in reliable else math.nan for t in TIME_PARTS},
        "unreliable_epochs": int(unreliable.sum()),
    }


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
                "state_mem": run["state_mem"].max() if "state_mem" in run else math.nan,
                **steady_breakdown(run),
                **{t: median_after_first(run, t) for t in (*UTILISATION, *BUBBLE)},
                "microbatches": final.get("microbatches", math.nan),
                "steps": final.get("train_images", math.nan) / final.get("global_batch", math.nan),
                "sharding": final.get("sharding", pd.NA),
                "threads_per_core": final.get("threads_per_core", math.nan),
                "step": final.get("step", pd.NA),
                "device": final.get("device", pd.NA),
            }
        )
    return pd.DataFrame(rows)


# Where an epoch's time went (train.py's [METRIC] keys): they add up to `time`.
TIME_PARTS = ("t_compute", "t_data", "t_comm", "t_wait")
# How close to the hardware (mfu.py): model TFLOP/s per device, and MFU in percent (empty where
# the run knew no peak for its device).
UTILISATION = ("tflops", "mfu")
# A pipeline's bubble (pipeline_utils.py): measured, and the textbook's (p - 1) / (m + p - 1);
# empty for the other strategies.
BUBBLE = ("bubble", "bubble_ideal")
# The [METRIC] numbers a run may not know (`na`): its CSV cells are then empty.
MAY_BE_UNKNOWN = (*UTILISATION, *BUBBLE, "microbatches", "t_compute", "t_comm")


def message_seconds(comm: pd.DataFrame, op: str, label_prefix: str) -> float:
    """Sum of the measured times of a run's messages of one kind (nan if it measured none)."""
    rows = comm[(comm["op"] == op) & comm["label"].astype(str).str.startswith(label_prefix)]
    return rows["time_us"].sum() / 1e6 if not rows.empty else math.nan


def comm_model_time(strategy: str, steps: float, sharding, comm: pd.DataFrame) -> float:
    """Seconds per epoch this model's messages take at the bandwidth measured in the same job,
    if nothing hid them. DDP: each step all-reduces every gradient bucket. FSDP: each step
    gathers every unit for forward and, when full sharding freed it again, for backward, then
    reduce-scatters its gradients; unsharded (no_shard, FSDP at 1 rank) it all-reduces them."""
    if comm.empty:
        return math.nan
    if strategy == "ddp":
        return steps * message_seconds(comm, "all_reduce", "bucket")
    if strategy in ("fsdp", "fsdp2") and str(sharding) == "no_shard":
        return steps * message_seconds(comm, "all_reduce", "grad")  # FSDP at 1 rank: DDP-like
    if strategy in ("fsdp", "fsdp2"):
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
    """Per strategy and GPU count (medians over runs when it ran more than once, with their
    minimum and maximum), with speedup and efficiency against the same strategy's 1-GPU steady
    epoch time (a pipeline has no 1-GPU run: against DDP's, the model on one GPU); where the
    runs' [COMM] lines are given, the communication time their messages would take at the
    measured bandwidth (comm_model) beside the measured t_comm."""
    runs = with_comm_model(run_summaries(results), comm)
    table = runs.groupby(["strategy", "gpus"], as_index=False).agg(
        nodes=("nodes", lambda n: ",".join(sorted({str(int(v)) for v in n.dropna()}))),
        runs=("epochs", "size"),
        epochs=("epochs", "max"),
        epochs_logged=("epochs_logged", "min"),
        val_loss=("val_loss", "median"),
        acc=("acc", "median"),
        time=("time", "median"),
        throughput=("throughput", "median"),
        # The spread over repeated runs (--repeats): a single run is one point, not a measurement.
        time_min=("time", "min"),
        time_max=("time", "max"),
        throughput_min=("throughput", "min"),
        throughput_max=("throughput", "max"),
        peak_mem=("peak_mem", "max"),
        state_mem=("state_mem", "max"),
        **{t: (t, "median") for t in (*TIME_PARTS, *UTILISATION, *BUBBLE, "comm_model")},
        unreliable_epochs=("unreliable_epochs", "sum"),
        threads_per_core=("threads_per_core", "max"),
        step=("step", lambda s: "/".join(sorted(set(s.dropna()))) or pd.NA),
        device=("device", lambda d: "/".join(sorted(set(d.dropna())))),
    )
    one_gpu = table[table["gpus"] == 1].set_index("strategy")["time"]
    baseline = table["strategy"].map(one_gpu)
    if "ddp" in one_gpu:
        baseline = baseline.where(table["strategy"] != "pipeline", one_gpu["ddp"])
    table["speedup"] = baseline / table["time"]
    table["efficiency"] = 100 * table["speedup"] / table["gpus"]
    return table.sort_values(["strategy", "gpus"], ignore_index=True)


def bubble_table(results: pd.DataFrame) -> pd.DataFrame:
    """The pipeline's runs by stages (GPUs) and micro-batches: the measured bubble (the median
    over runs of each run's median after epoch 1) beside the textbook's."""
    runs = run_summaries(results)
    if "bubble" not in runs:
        return pd.DataFrame(columns=["gpus", "microbatches", "runs", *BUBBLE])
    runs = runs.dropna(subset=["bubble"])
    return runs.groupby(["gpus", "microbatches"], as_index=False).agg(
        runs=("bubble", "size"), bubble=("bubble", "median"), bubble_ideal=("bubble_ideal", "max")
    )


def bubble_markdown(table: pd.DataFrame) -> str:
    lines = ["| stages (GPUs) | micro-batches | runs | bubble measured | textbook (p-1)/(m+p-1) |"]
    lines.append("|--:|--:|--:|--:|--:|")
    for _, row in table.iterrows():
        lines.append(
            f"| {row['gpus']:.0f} | {row['microbatches']:.0f} | {row['runs']:.0f} | "
            f"{row['bubble']:.3f} | {row['bubble_ideal']:.3f} |"
        )
    return "\n".join(lines)


def scaling(results: pd.DataFrame) -> str | None:
    """Which study the runs make: strong scaling (one global batch at every GPU count) or weak
    (one batch per GPU); None where the CSV does not say or the runs mix batch sizes."""
    if not {"global_batch", "local_batch"} <= set(results) or results["gpus"].nunique() < 2:
        return None
    global_batch, local_batch = results["global_batch"].dropna(), results["local_batch"].dropna()
    if global_batch.nunique() == 1:
        return f"strong scaling: global batch {global_batch.iloc[0]:.0f} at every GPU count"
    if local_batch.nunique() == 1:
        return f"weak scaling: {local_batch.iloc[0]:.0f} images per GPU per step"
    return None


# (column, header, format) of the printed table; {rank} and {ranks} in a header are what the
# `gpus` column counts (rank_unit).
TABLE_COLUMNS = (
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
    ("bubble", "bubble", "{:.2f}"),  # a pipeline's (pipeline_utils.py)
    # Communication per epoch: not hidden behind compute (measured), and what the model's
    # messages would take at the bandwidth the job measured (--comm-benchmark).
    ("t_comm", "t_comm s", "{:.3f}"),
    ("comm_model", "comm at measured bw s", "{:.3f}"),
)


def cell(value, fmt: str) -> str:
    if pd.isna(value) or value == "":
        return "n/a"
    return fmt.format(int(value) if "d}" in fmt else value)


def time_range(row) -> str:
    """'min-max' of the epoch time over repeated runs; empty for a single run."""
    return f"{row['time_min']:.2f}-{row['time_max']:.2f}" if row["runs"] > 1 else ""


def markdown_table(summary: pd.DataFrame) -> str:
    summary = summary.assign(time_range=summary.apply(time_range, axis=1))
    rank, ranks = rank_unit(summary)
    headers = (header.format(rank=rank, ranks=ranks) for _, header, _ in TABLE_COLUMNS)
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if fmt == "{}" else "--:" for *_, fmt in TABLE_COLUMNS) + "|",
    ]
    for _, row in summary.iterrows():
        lines.append("| " + " | ".join(cell(row[c], fmt) for c, _, fmt in TABLE_COLUMNS) + " |")
    return "\n".join(lines)


GPU_TIMELINE_CSV = "gpu_timeline.csv"  # every GPU sample, for plot_results.py


def sample_tables(folders: list[Path], results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """run.sh's samples by the CSV they go to: per GPU and per rank (each row with its run's
    strategy, GPU count and in-process peak_mem, MB, so that nvidia-smi's view stands next to
    PyTorch's), and every GPU sample over time."""
    gpus, processes = samples.summarize(folders)
    runs = run_summaries(results)[["job_id", "strategy", "gpus", "peak_mem"]]
    runs = runs.astype({"job_id": str}).drop_duplicates("job_id")

    def with_run(table: pd.DataFrame) -> pd.DataFrame:
        return runs.merge(table.astype({"job_id": str}), on="job_id", how="right")

    return {
        "gpu_samples.csv": with_run(gpus),
        "cpu_samples.csv": with_run(processes),
        GPU_TIMELINE_CSV: with_run(samples.gpu_timeline(folders)),
    }


def sample_report(gpus: pd.DataFrame) -> str:
    """A markdown table of the GPU samples, one row per GPU of each job."""
    columns = (
        "strategy",
        "gpus",
        "job_id",
        "host",
        "gpu",
        "peak_mem",
        "peak_mem_mib",
        "mean_mem_mib",
        "mode_mem_mib",
        "mean_util_pct",
    )
    headers = (
        "strategy",
        "GPUs",
        "job",
        "node",
        "GPU",
        "peak_mem MB (PyTorch)",
        "nvidia-smi peak MiB",
        "mean MiB",
        "most frequent MiB",
        "mean util %",
    )
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for _, row in gpus.iterrows():
        lines.append(
            "| " + " | ".join("n/a" if pd.isna(row[c]) else str(row[c]) for c in columns) + " |"
        )
    return "\n".join(lines)


def side_path(results: Path, name: str) -> Path:
    """Where the CSV `name` (comm.csv, gpu_samples.csv, ...) of a results file lies: beside it,
    and named after it unless it is the default results.csv (old.csv: old_comm.csv), so that
    two results files in one folder never share, or replace, each other's side files."""
    if results.name == DEFAULT_OUT.name:
        return results.with_name(name)
    return results.with_name(f"{results.stem}_{name}")


def write_beside(out: Path, name: str, table: pd.DataFrame, rows: str) -> None:
    """A CSV beside the results; where these runs give it no rows, an older one of that name
    is removed (it would belong to other runs)."""
    path = side_path(out, name)
    if table.empty:
        path.unlink(missing_ok=True)
        return
    write_atomically(path, lambda temp: table.to_csv(temp, index=False))
    note(f"wrote {path}: {len(table)} {rows}")


def write_sample_tables(out: Path, folders: list[Path], results: pd.DataFrame) -> None:
    """gpu_samples.csv, cpu_samples.csv and gpu_timeline.csv beside the results, and the table of
    the GPUs where run.sh sampled any."""
    tables = sample_tables(folders, results)
    for name, table in tables.items():
        write_beside(out, name, table, "rows")
    if not tables["gpu_samples.csv"].empty:
        print(
            "\nGPU memory and use (nvidia-smi, sampled by run.sh):\n\n"
            + sample_report(tables["gpu_samples.csv"])
        )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--logs",
        type=Path,
        action="append",
        help="a folder of training logs, or of sweeps (its newest is read); give it "
        "again to merge folders (default: logs)",
    )
    p.add_argument(
        "--all-sweeps",
        action="store_true",
        help="read every sweep of a folder of sweeps, not only the newest",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="CSV to write; its side CSVs (comm.csv, ...) go beside it, named "
        "after it unless it is results.csv (old.csv: old_comm.csv, ...)",
    )
    args = p.parse_args(argv)
    args.logs = args.logs or [Path("logs")]
    return args


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # stderr: stdout stays the table alone


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        folders = choose_folders(args.logs, args.all_sweeps, note)
        runs = collect(folders, note)
    except UsageError as e:
        fail(str(e))
    for warning in mixed_sweeps(runs):
        note(warning)
    results, comm = results_frame(runs), comm_frame(runs)
    try:
        write_atomically(args.out, lambda temp: results.to_csv(temp, index=False))
        note(f"wrote {args.out}: {len(results)} rows from {len(runs)} run(s)")
        write_beside(args.out, COMM_CSV, comm, "[COMM] rows")
    except OSError as e:
        fail(f"cannot write {args.out}: {e.strerror or e}")
    print(markdown_table(summarize(results, comm)))
    if not (bubbles := bubble_table(results)).empty:
        print("\n" + bubble_markdown(bubbles))
    if study := scaling(results):
        note(study)
    if warning := cores_outnumbered(results):
        note(warning)
    for warning in mixed_steps(results):
        note(warning)
    try:
        write_sample_tables(args.out, folders, results)
    except OSError as e:
        fail(f"cannot write beside {args.out}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
