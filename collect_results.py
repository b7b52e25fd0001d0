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
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

import layout
import results_summary
import samples
import utils

# Where each identity column is found in a project metric line (one rank per GPU).
LINE_FIELD = {"strategy": "strategy", "gpus": "world_size", "nodes": "nodes", "job_id": "job_id"}

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
STOPPED_RE = re.compile(rf"srun: error: .*Exited with exit code {utils.EXIT_STATUS['stopped']}$")
EXCEPTION_RE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): ")

# What to do when there is nothing to read (a fresh clone; `make run` prints its lines to the
# terminal only): the README's small sweep on this machine, which tests/test_docs.py holds it to.
SMALL_LOCAL_SWEEP = (
    "python run_benchmarks.py --local --gpus 1 2 --epochs 3 -- --dataset synthetic "
    "--train-samples 2048 --val-samples 512 --no-checkpoint"
)
HOW_TO_GET_LOGS = (
    f": nothing to plot yet; run a sweep first, on this machine: {SMALL_LOCAL_SWEEP} "
    "(README.md, From the quickstart to a study); on SLURM: python run_benchmarks.py, or "
    "sbatch run.sh"
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
        """The threads of one node's ranks per CPU core of the node (nan where [CONFIG] does not
        say): above 1, the run's times measure how the ranks shared the cores."""
        try:
            ranks = self.config["world_size"] / self.config["nodes"]
            return ranks * self.config["threads"] / self.config["cpus"]
        except (KeyError, TypeError, ZeroDivisionError):
            return math.nan

    @property
    def step(self) -> str | None:
        """How the run's step ran: `graph` (one CUDA graph) or `eager`; None where unsaid."""
        graphed = self.config.get("cuda_graphs")
        return {"True": "graph", "False": "eager"}.get(str(graphed))

    @property
    def trained(self) -> dict:
        """What the run trained: its model (results_summary.DEFAULT_MODEL where [CONFIG] does
        not say), the model's parameters, its GPU's memory in bytes and its optimizer."""
        return {
            "model": self.config.get("model", results_summary.DEFAULT_MODEL),
            **{c: self.config.get(c, math.nan) for c in ("parameters", "gpu_memory")},
            "optimizer": self.config.get("optimizer"),
        }

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
    scan: Scan  # the rest of what the log says: [CONFIG], [COMM]


def scan_log(text: str) -> Scan:
    scan = Scan()
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        fields = utils.parse_metric(line)
        if fields is not None:
            scan.metrics.append(fields)
            scan.crash_lines = []  # the run went on: a requeued job starts again after a crash
        elif (comm := utils.parse_comm(line)) is not None:
            scan.comm.append(comm)
        elif utils.METRIC_TAG in line:
            scan.bad_metric_line = scan.bad_metric_line or number
        elif (config := utils.parse_config(line)) is not None:
            scan.config = config
        elif STOPPED_RE.search(line.strip()):
            continue
        elif any(marker in line for marker in CRASH_MARKERS) or (
            scan.crash_lines and EXCEPTION_RE.search(line)
        ):
            scan.crash_lines.append(line.strip()[:160])
    # A last line without its newline was cut off mid-write: even if its course fields parse,
    # the fields after them (strategy, world size...) may be cut short.
    if lines and not text.endswith("\n") and utils.METRIC_TAG in lines[-1]:
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


def run_identity(metrics: list[dict], log_name: str) -> tuple[dict, list[str]]:
    """Strategy, GPUs, nodes, job id: the metric lines' fields first, else the file name's."""
    named, identity, notes = layout.name_identity(log_name), {}, []
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
    if "model" not in scan.config:
        notes.append(f"no model in a [CONFIG] line: taken as {results_summary.DEFAULT_MODEL}")
    return LoggedRun(
        sweep_name(path.parent), path.name, identity, epochs, notes + identity_notes, scan
    )


def sweep_name(folder: Path) -> str:
    """A sweep's name in the CSV: its folder's, without the prefix (20261122-141500)."""
    return folder.name.removeprefix(layout.SWEEP_PREFIX)


def log_files(folder: Path) -> list[Path]:
    """The files of a folder that may be run logs: not run.sh's sampler CSVs (samples.py's)
    nor the collect job's outcome."""
    if not folder.is_dir():
        raise utils.UsageError(f"no logs folder {folder}{HOW_TO_GET_LOGS}")
    sampled = {path for *_, path in samples.sample_files(folder)}
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p not in sampled
        and p.name != layout.SWEEP_OUTCOME
    )
    if not files:
        raise utils.UsageError(f"no log files in {folder}{HOW_TO_GET_LOGS}")
    return files


def pair_stderr(files: list[Path]) -> tuple[list[Path], dict[Path, Path]]:
    """The logs to read, and for each the `X.err` beside it: its run's stderr, not a run."""
    by_stem = {p.stem: p for p in files if p.suffix != layout.ERR_SUFFIX}
    logs, stderr_of = [], {}
    for p in files:
        if p.suffix == layout.ERR_SUFFIX and p.stem in by_stem:
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
        sweeps = layout.sweep_folders(folder)
        if not sweeps:
            chosen.append(folder)
        elif all_sweeps:
            chosen += sweeps
        else:
            chosen.append(sweeps[-1])
            newest = f", the newest of {len(sweeps)} (--all-sweeps merges them)"
            report(f"reading {sweeps[-1]}{newest if len(sweeps) > 1 else ''}")
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
            for oddity in run.notes:
                report(f"note {path}: {oddity}")
            runs.append(run)
    if not runs:
        raise utils.UsageError(
            f"no usable [METRIC] lines in any of the {read} files in {', '.join(map(str, folders))}"
        )
    return runs


def mixed_sweeps(runs: list[LoggedRun]) -> list[str]:
    """A warning for each configuration whose runs come from more than one sweep."""
    sweeps_of = {}
    for run in runs:
        key = (run.scan.trained["model"], run.identity["strategy"], run.identity["gpus"])
        sweeps_of.setdefault(key, set()).add(run.sweep)
    return [
        f"warning: {model} {strategy} on {gpus} GPU(s) has runs from {len(sweeps)} sweeps "
        f"({', '.join(sorted(sweeps))}): the summary takes the median over them all"
        for (model, strategy, gpus), sweeps in sweeps_of.items()
        if len(sweeps) > 1
    ]


def line_row(run: LoggedRun, fields: dict) -> dict:
    """A row of one of the run's lines: the run's columns (results_summary.RUN_COLUMNS), then
    the line's fields; strategy, nodes, job_id are run columns already, world_size stays."""
    other = {k: v for k, v in fields.items() if k not in results_summary.IDENTITY}
    return {
        "sweep": run.sweep,
        "log": run.log,
        "model": run.scan.trained["model"],
        **run.identity,
        **other,
    }


def results_frame(runs: list[LoggedRun]) -> pd.DataFrame:
    """One row per run and epoch: the run's identity, the course's fields, then the others."""
    rows = [
        {
            **line_row(run, fields),
            "threads_per_core": run.scan.threads_per_core,
            "step": run.scan.step,
            **run.scan.trained,
        }
        for run in runs
        for fields in run.epochs
    ]
    frame = pd.DataFrame(rows)  # columns in order of first appearance
    for column in utils.MAY_BE_NA:  # `na` becomes an empty cell
        if column in frame:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    leading = [*results_summary.RUN_COLUMNS, *results_summary.COURSE_COLUMNS]
    return frame[leading + [c for c in frame.columns if c not in leading]]


def comm_frame(runs: list[LoggedRun]) -> pd.DataFrame:
    """One row per [COMM] line: its run's columns, then the line's fields (comm.csv)."""
    rows = [line_row(run, fields) for run in runs for fields in run.scan.comm]
    return pd.DataFrame(
        rows, columns=None if rows else [*results_summary.RUN_COLUMNS, *utils.COMM_FIELDS]
    )


def sample_tables(folders: list[Path], results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """run.sh's samples by the CSV they go to: per GPU, per rank and over time, each row with its
    run's strategy, GPU count and peak_mem (nvidia-smi's view next to PyTorch's)."""
    gpus, processes = samples.summarize(folders)
    runs = results_summary.run_summaries(results)[["job_id", "strategy", "gpus", "peak_mem"]]
    runs = runs.astype({"job_id": str}).drop_duplicates("job_id")

    def with_run(table: pd.DataFrame) -> pd.DataFrame:
        return runs.merge(table.astype({"job_id": str}), on="job_id", how="right")

    return {
        "gpu_samples.csv": with_run(gpus),
        "cpu_samples.csv": with_run(processes),
        layout.GPU_TIMELINE_CSV: with_run(samples.gpu_timeline(folders)),
    }


def sample_report(gpus: pd.DataFrame) -> str:
    """A markdown table of the GPU samples, one row per GPU of each job."""
    headers = {  # column: header
        "strategy": "strategy",
        "gpus": "GPUs",
        "job_id": "job",
        "host": "node",
        "gpu": "GPU",
        "peak_mem": "peak_mem MB (PyTorch)",
        "peak_mem_mib": "nvidia-smi peak MiB",
        "mean_mem_mib": "mean MiB",
        "mode_mem_mib": "most frequent MiB",
        "mean_util_pct": "mean util %",
    }
    return results_summary.markdown(gpus, [(c, header, "{}") for c, header in headers.items()])


def write_beside(out: Path, name: str, table: pd.DataFrame, rows: str) -> None:
    """A CSV beside the results; where these runs give it no rows, an older one of that name
    is removed (it would belong to other runs)."""
    path = layout.side_path(out, name)
    if table.empty:
        path.unlink(missing_ok=True)
        return
    utils.write_atomically(path, lambda temp: table.to_csv(temp, index=False))
    utils.note(f"wrote {path}: {len(table)} {rows}")


def write_sample_tables(out: Path, folders: list[Path], results: pd.DataFrame) -> None:
    """gpu_samples.csv, cpu_samples.csv and gpu_timeline.csv beside the results, and the table of
    the GPUs where run.sh sampled any."""
    tables = sample_tables(folders, results)
    for name, table in tables.items():
        write_beside(out, name, table, "rows")
    if not (gpus := tables["gpu_samples.csv"]).empty:
        print(f"\nGPU memory and use (nvidia-smi, sampled by run.sh):\n\n{sample_report(gpus)}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--logs",
        type=Path,
        action="append",
        help="a folder of training logs, or of sweeps (its newest is read); give it "
        "again to merge folders (default: the repository's logs/)",
    )
    p.add_argument(
        "--all-sweeps",
        action="store_true",
        help="read every sweep of a folder of sweeps, not only the newest",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=layout.DEFAULT_RESULTS,
        help="CSV to write; its side CSVs (comm.csv, ...) go beside it, named "
        "after it unless it is results.csv (old.csv: old_comm.csv, ...)",
    )
    args = p.parse_args(argv)
    args.logs = args.logs or [layout.LOGS_DIR]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        folders = choose_folders(args.logs, args.all_sweeps, utils.note)
        runs = collect(folders, utils.note)
    except utils.UsageError as e:
        utils.fail(str(e))
    for warning in mixed_sweeps(runs):
        utils.note(warning)
    results, comm = results_frame(runs), comm_frame(runs)
    try:
        utils.write_atomically(args.out, lambda temp: results.to_csv(temp, index=False))
        utils.note(f"wrote {args.out}: {len(results)} rows from {len(runs)} run(s)")
        write_beside(args.out, layout.COMM_CSV, comm, "[COMM] rows")
    except OSError as e:
        utils.fail(f"cannot write {args.out}: {e.strerror or e}")
    print(results_summary.markdown_table(results_summary.summarize(results, comm)))
    if not (bubbles := results_summary.bubble_table(results)).empty:
        print("\n" + results_summary.bubble_markdown(bubbles))
    if study := results_summary.scaling(results):
        utils.note(study)
    for warning in results_summary.warnings(results):
        utils.note(warning)
    try:
        write_sample_tables(args.out, folders, results)
    except OSError as e:
        utils.fail(f"cannot write beside {args.out}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
