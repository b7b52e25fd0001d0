"""Logging on rank 0 and the one `[METRIC]` line format, written and parsed here only (so the
training program, the collector and the tests cannot drift apart); main.py's exit statuses; a
command-line tool's one-line error, notes and atomic writes; torchvision, loaded where a run
needs it, or a one-line error where it cannot load.

The line starts with the course's five fields, in the course's order and units, so the
course's published regex keeps matching; more `key=value` fields follow:

    [METRIC] epoch=3 time=2.20 val_loss=1.0809 acc=61.43 peak_mem=91MB strategy=ddp world_size=4 ...
"""

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import NoReturn, SupportsFloat

# main.py's exit statuses, 0 to 5, by name, and what each means (main.py --help lists them). run.sh,
# verify.py and docs/troubleshooting.md follow them; tests/test_docs.py checks run.sh and the doc.
EXIT_MEANING = {
    "finished": "finished",
    "peer_failed": "another rank died or hung",  # its own log says why
    "usage": "bad input",  # one `error:` line
    "stopped": "stopped by a signal (USR1, USR2, TERM, INT) after saving a checkpoint (resume it)",
    "diverged": "diverged (the training loss became NaN or infinite)",  # last good one stays
    # One `error:` line says which, why, and what is intact (docs/reliability.md).
    "checkpoint": "a checkpoint could not be saved or read",
}
EXIT_STATUS = {name: code for code, name in enumerate(EXIT_MEANING)}  # in the order of codes

# The course's regex, kept verbatim: the project's lines must always match it.
COURSE_METRIC_RE = re.compile(
    r"\[METRIC\] epoch=(\d+) time=([\d\.]+) val_loss=([\d\.]+) acc=([\d\.]+) peak_mem=(\d+)MB"
)


@dataclass(frozen=True)
class MetricField:
    """A field of the `[METRIC]` line: its unit, its label where figures name it otherwise, and
    whether a run may not know it (`na`: an empty cell in the collector's CSV)."""

    name: str
    unit: str = ""
    label: str = ""
    may_be_na: bool = False
    fmt: str = ""  # the course's five fields' fixed format (peak_mem in MB with its suffix)


# Every field of a `[METRIC]` line, in the line's order (format_metric's; others follow as given):
# the course's five, the labels naming the run, first measurements, the setting, then what came
# since: measurements, then labels. New fields go at the end of those two, so positions stay put.
METRIC = (
    MetricField("epoch", fmt="{:d}"),  # the course's, in the course's order and units
    MetricField("time", "s", fmt="{:.2f}"),
    MetricField("val_loss", fmt="{:.4f}"),
    MetricField("acc", "%", fmt="{:.2f}"),
    MetricField("peak_mem", "MB", fmt="{:d}MB"),
    *map(MetricField, ("strategy", "world_size", "nodes")),
    MetricField("global_batch", "images"),
    MetricField("local_batch", "images"),
    MetricField("train_loss"),  # first measurements
    MetricField("val_time", "s"),
    MetricField("throughput", "images/s"),
    MetricField("data_wait", "s"),
    MetricField("state_mem", "bytes"),  # exact: FSDP's shard is half of DDP's
    *map(MetricField, ("precision", "device", "dataset", "seed", "job_id")),  # the setting
    MetricField("data_mem", "MB"),  # measured since
    MetricField("reserved_mem", "MB"),
    MetricField("t_compute", "s", "compute", may_be_na=True),
    MetricField("t_data", "s", "data"),
    MetricField("t_comm", "s", "communication", may_be_na=True),
    MetricField("t_wait", "s", "waiting"),
    MetricField("tflops", "TFLOP/s", may_be_na=True),
    MetricField("mfu", "%", may_be_na=True),
    MetricField("slowest_rank"),
    MetricField("rank_time_spread", "s"),
    MetricField("bubble", "share", may_be_na=True),
    MetricField("bubble_ideal", "share", may_be_na=True),
    MetricField("breakdown"),
    MetricField("gpu_busy", "share", "GPU busy", may_be_na=True),
    MetricField("t_other", "s", "unexplained", may_be_na=True),
    MetricField("compute_spread", "s"),
    MetricField("state_pred", "bytes"),  # cost_model's state_mem, beside the measured one
    MetricField("act_per_image", "bytes"),
    MetricField("sharding"),  # labels added since (e.g. the sharding FSDP really used)
    MetricField("train_images", "images"),
    MetricField("microbatches", may_be_na=True),
)
COURSE_FIELDS = METRIC[:5]
METRIC_FIELDS = tuple(f.name for f in METRIC)
MAY_BE_NA = tuple(f.name for f in METRIC if f.may_be_na)
LABEL = {f.name: f.label for f in METRIC if f.label}
# Where an epoch's time went (measure.time_breakdown): the `t_` fields, which add up to `time`.
TIME_PARTS = tuple(name for name in METRIC_FIELDS if name.startswith("t_"))

METRIC_TAG = "[METRIC]"
MB = 2**20  # the [METRIC] line's MB (peak_mem, data_mem, reserved_mem) are MiB

CONFIG_TAG = "[CONFIG]"  # one line per run, first: the whole resolved configuration
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SRUN_PREFIX_RE = re.compile(r"^\s*\d+:\s?")  # `srun -l` writes "0: " before each line
_FIELD_RE = re.compile(r"(\w+)=(\S+)")


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr, exit code 2, no traceback."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be written or read (checkpoint.py): one line, and main.py's exit
    status `checkpoint`. The same on every rank."""


def env_int(env, name: str) -> int:
    """An integer environment variable; a UsageError, naming it, where it is not one."""
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"environment variable {name}={env[name]!r} is not an integer") from None


def read_ranks(env=os.environ) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's variables, else SLURM's, else (0, 0, 1):
    the one reading of the launchers' variables, without torch (logging asks it before torch
    loads). SLURM's only inside a job step (`srun`): the batch script also carries
    SLURM_PROCID=0 and the job's SLURM_NTASKS, and would wait for peers that never come.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
    else:
        return 0, 0, 1
    rank, local_rank, world_size = (env_int(env, n) if n in env else 0 for n in names)
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is outside world size {world_size} ({', '.join(names)})")
    return rank, local_rank, world_size


def is_rank_zero(env=os.environ) -> bool:
    """Whether this process is rank 0, as read_ranks() says; where the launcher's variables make
    no sense, every process is, so that the error about them is seen."""
    try:
        return read_ranks(env)[0] == 0
    except UsageError:
        return True


def log0(*args, **kwargs) -> None:
    """print() on rank 0 only, flushed so that interleaved srun output stays ordered."""
    if is_rank_zero():
        print(*args, **kwargs, flush=True)


class Progress:
    """Rank 0's progress: a redrawn bar on a terminal, a line every `every` steps in a log."""

    def __init__(self, epoch: int, steps: int, every: int, enabled: bool, first_step: int = 0):
        self.epoch, self.steps, self.every, self.enabled = epoch, steps, every, enabled
        self.first_step = first_step  # a resumed epoch starts part-way
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, mean_loss_sum: SupportsFloat) -> None:
        """After `step`; mean_loss_sum (a device tensor) adds up the steps' mean losses since
        first_step."""
        done = step + 1
        if not self.enabled or (done % self.every and done != self.steps):
            return
        ms = 1000 * (time.perf_counter() - self.start) / (done - self.first_step)
        # Reading the sum waits for the device: paid once every `every` steps, not every step.
        loss = float(mean_loss_sum) / (done - self.first_step)
        text = f"epoch {self.epoch} step {done:>5}/{self.steps} loss {loss:.4f} {ms:.1f} ms/step"
        if self.tty:
            bar = "#" * (30 * done // self.steps)
            print(f"\r[{bar:<30}] {text}", end="\n" if done == self.steps else "", flush=True)
        else:
            print(text, flush=True)


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace(" ", "_")


def metric_order(fields: dict) -> dict:
    """The fields of a `[METRIC]` line in its order: METRIC_FIELDS', then any others as given."""
    known = {name: fields[name] for name in METRIC_FIELDS if name in fields}
    return {**known, **{k: v for k, v in fields.items() if k not in known}}


def format_metric(fields: dict) -> str:
    """The `[METRIC]` line: course fields first (fixed formats), then the rest in the order of
    METRIC_FIELDS."""
    head = [f.name + "=" + f.fmt.format(fields[f.name]) for f in COURSE_FIELDS]
    course_names = {f.name for f in COURSE_FIELDS}
    tail = [
        f"{k}={format_value(v)}" for k, v in metric_order(fields).items() if k not in course_names
    ]
    return " ".join([METRIC_TAG, *head, *tail])


def _convert(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _bare(line: str) -> str:
    """A log line without its `srun -l` rank prefix and ANSI colour codes."""
    return _SRUN_PREFIX_RE.sub("", _ANSI_RE.sub("", line)).strip()


def _tagged_fields(bare: str, tag: str) -> dict | None:
    """The key=value fields, as numbers or strings, of a bare log line (_bare) that begins with
    `tag`, or None if it does not."""
    if not bare.startswith(tag):
        return None
    return {k: _convert(v) for k, v in _FIELD_RE.findall(bare[len(tag) :])}


def parse_metric(line: str) -> dict | None:
    """Fields of a `[METRIC]` line (the project's or the course's), or None if the line is not
    one. A line whose course fields are missing or cut off is not a metric line."""
    line = _bare(line)
    if not COURSE_METRIC_RE.match(line):
        return None
    fields = _tagged_fields(line, METRIC_TAG)
    fields["peak_mem"] = int(str(fields["peak_mem"]).removesuffix("MB"))
    return fields


def format_config(fields: dict) -> str:
    return " ".join([CONFIG_TAG, *(f"{k}={format_value(v)}" for k, v in fields.items())])


def parse_config(line: str) -> dict | None:
    """Fields of a `[CONFIG]` line, or None if the line is not one."""
    return _tagged_fields(_bare(line), CONFIG_TAG)


def release(version: str) -> tuple[int, int]:
    """A torch version's release, (major, minor): "2.10.0a0+b4e4ee81d3" is (2, 10)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return major, minor


def require_torchvision(needed_for: str) -> None:
    """Load torchvision (only some runs need it), or end with one line saying why it cannot: one
    built for another torch fails at import ("operator torchvision::nms does not exist")."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "torchvision":
            raise UsageError(f"{needed_for} needs torchvision: run 'make install'") from None
        installed = ", ".join(f"{name} {version(name)}" for name in ("torch", "torchvision"))
        raise UsageError(
            f"{needed_for} needs torchvision, which fails to load ({e}; {installed}): install "
            "torch and torchvision from the same package index, e.g. 'make install' in a new .venv"
        ) from None


def fail(message: str, code: int = 2) -> NoReturn:
    """End a command-line program with a one-line error."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # stderr: a tool's stdout stays its table or paths


def rank_unit(devices: set[str]) -> tuple[str, str]:
    """What a count of ranks counts, singular and plural, by the devices they trained on: GPUs on
    CUDA (and where no device is known: the course's runs), CPU ranks on the CPU, plain ranks
    for a mix. The one owner of the word, for the sweep's lines, the tables and the figures."""
    devices = devices - {""}
    if devices <= {"cuda"}:
        return "GPU", "GPUs"
    if devices == {"cpu"}:
        return "CPU rank", "CPU ranks"
    return "rank", "ranks"


def count(n: int, noun: str) -> str:
    """n and the noun, plural unless n is 1: 1 node, 2 GPUs, 2 processes."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def last_line(text: str) -> str:
    """The last line of a program's output that is not blank: where its error is."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(temp) beside path, then rename: a reader never sees half a file, a failure no file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


# `[COMM] op=all_reduce label=grad bytes=2214056 world_size=4 time_us=... algbw_gbps=...
# busbw_gbps=...`: one collective measured by comm_bench.py; these fields first, then others.
COMM_TAG = "[COMM]"
COMM_FIELDS = ("op", "label", "bytes", "world_size", "time_us", "algbw_gbps", "busbw_gbps")

# The FSDP unit of the parameters no unit of their own holds (model.unit_parameters; its
# messages are labelled unit_root): kept from forward to backward (fsdp_utils), so full
# sharding gathers it once a step, every other unit twice (results_summary.comm_model_time).
FSDP_ROOT_UNIT = "root"


def format_comm(fields: dict) -> str:
    ordered = [*COMM_FIELDS, *(k for k in fields if k not in COMM_FIELDS)]
    return " ".join([COMM_TAG, *(f"{k}={format_value(fields[k])}" for k in ordered)])


def parse_comm(line: str) -> dict | None:
    """Fields of a `[COMM]` line, or None if the line is not one or lacks one of COMM_FIELDS."""
    fields = _tagged_fields(_bare(line), COMM_TAG)
    return fields if fields is not None and all(k in fields for k in COMM_FIELDS) else None
