"""Where the project's files go: the repository's logs/ and jobs/ (wherever a tool is started
from: every tool and the training program ask LOGS_DIR), a sweep's folder and each run's log
name (written by run_benchmarks.py, read back by collect_results.py), a run's checkpoints folder
and its job id in names, verify's report folder, and the results CSV with the CSVs beside it.
Paths a user gives are taken as given.
"""

import os
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
LOGS_DIR = REPO / "logs"
JOBS_DIR = REPO / "jobs"  # the sweep's job scripts, and the collect and verify jobs' own logs
ERR_SUFFIX = ".err"  # X.err beside X.log: that run's stderr
# A run's checkpoints go to checkpoints/<run id>/ unless it is told where: relative, beside
# where the run was started (run.sh starts it in the repository).
CHECKPOINTS_DIR = Path("checkpoints")
# A run without SLURM has no job id: its [CONFIG] and [METRIC] lines say job_id=local, and what
# a job's id names (its log, checkpoints folder, traces, verify's folder) is named
# local-<date-time> instead (local_id).
LOCAL_JOB = "local"

# A sweep's logs live in logs/sweep-<date-time>/, never mixed with another sweep's: the sweep
# tool makes the folder, the collector reads the newest (or, when asked, several).
SWEEP_PREFIX = "sweep-"
# The collect job's outcome in its sweep's folder, one line: where a user of a sweep submitted
# without --wait learns whether it gave results. The collector reads it as no log.
SWEEP_OUTCOME = "collect_outcome.txt"

# A run's log is named `{strategy}_{gpus}gpu[_{model}]_{job id}.log` (configuration_name;
# a run without SLURM has local_id() there, never a model); the course's were
# `ddp_4gpu_15epochs.train.log` (where `_15epochs` is no job id), and some name the nodes:
# `{strategy}_{gpus}gpu[_{nodes}node][_{jobid}].log`.
LOG_NAME_RE = re.compile(
    r"^(?P<strategy>[A-Za-z][A-Za-z0-9-]*)_(?P<gpus>\d+)gpus?(?:_(?P<nodes>\d+)nodes?)?"
    r"(?:_(?!local-)(?P<model>[A-Za-z][A-Za-z0-9-]*))?(?:_(?P<job_id>\d+))?(?=[._]|$)"
)

VERIFY_PREFIX = "verify-"  # logs/verify-<job id>/: a verify job's runs and its report
VERIFY_REPORT = "report.md"

DEFAULT_RESULTS = Path("results.csv")  # whose side CSVs keep their plain names (side_path)
COMM_CSV = "comm.csv"  # the [COMM] lines, beside the results CSV
GPU_TIMELINE_CSV = "gpu_timeline.csv"  # every GPU sample, for plot_results.py


def relative(path: Path) -> str:
    """A path as the tools print it: relative to the repository where it lies inside."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def time_stamp() -> str:
    """The time now as every time-stamped name of the project writes it: 20261122-141500."""
    return time.strftime("%Y%m%d-%H%M%S")


def free_path(folder: Path, stem: str, suffix: str = "") -> Path:
    """folder/<stem>[-n]<suffix>, n = 2, 3, ... where that name is taken (nothing is made)."""
    path, n = folder / f"{stem}{suffix}", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}{suffix}"
    return path


def time_stamped(folder: Path, prefix: str, suffix: str = "") -> Path:
    """folder/<prefix><date-time>[-n]<suffix>: named by the time now (free_path)."""
    return free_path(folder, prefix + time_stamp(), suffix)


def job_id(env=os.environ) -> str:
    """This run's SLURM job id, or LOCAL_JOB."""
    return env.get("SLURM_JOB_ID", LOCAL_JOB)


def local_id() -> str:
    """Where a name holds a job id, a run without SLURM started now: local-<date-time>."""
    return f"{LOCAL_JOB}-{time_stamp()}"


def run_id(env=os.environ) -> str:
    """This run in its own files' names (its checkpoints folder, its traces): the SLURM job id
    (a requeued job keeps it, and so finds its own files), else local_id(). Ask on one rank
    (distributed_utils.on_rank0) so that all use the same."""
    job = job_id(env)
    return job if job != LOCAL_JOB else local_id()


def next_sweep_folder(logs: Path) -> Path:
    """logs/sweep-<date-time>[-n]: the folder a sweep started now would use (not made here)."""
    return time_stamped(logs, SWEEP_PREFIX)


def sweep_folders(logs: Path) -> list[Path]:
    """The sweeps in a logs folder, oldest first (their names sort by time)."""
    if not logs.is_dir():
        return []
    return sorted(p for p in logs.iterdir() if p.is_dir() and p.name.startswith(SWEEP_PREFIX))


def configuration_name(strategy: str, gpus: int, model: str = "") -> str:
    """A sweep's configuration's name, its log's and its job script's: ddp_4gpu, or
    ddp_4gpu_resnet50 where the sweep names the model (all but the default CNN)."""
    return f"{strategy}_{gpus}gpu" + (f"_{model}" if model else "")


def log_stem(name: str, job_id: str) -> str:
    """A run's log without its suffix: ddp_4gpu_1234 (sbatch's %j, or local_id())."""
    return f"{name}_{job_id}"


def name_identity(log_name: str) -> dict:
    """What a log's name says of its run: strategy, gpus, and nodes, model and job_id where
    given."""
    match = LOG_NAME_RE.match(log_name)
    if not match:
        return {}
    found = {k: v for k, v in match.groupdict().items() if v is not None}
    for key in ("gpus", "nodes"):
        if key in found:
            found[key] = int(found[key])
    return found


def logs_folder(name: str) -> str:
    """A folder of logs/ (a sweep's) as job scripts and messages name it: relative to the
    repository, where the scripts run."""
    return relative(LOGS_DIR / name)


def jobs_folder(name: str) -> str:
    """A folder of jobs/ (a sweep's job scripts, verify's), relative to the repository."""
    return relative(JOBS_DIR / name)


def collect_log(sweep: str, job_id: str) -> str:
    """The collect job's log, relative to the repository (beside the sweep's job scripts)."""
    return f"{jobs_folder(sweep)}/collect_{job_id}.log"


def verify_folder(job: str) -> Path:
    """Where a verify job's report and logs go (run_benchmarks.py --wait reads it): by its job
    id, or for LOCAL_JOB a new folder named by local_id()."""
    if job == LOCAL_JOB:
        return free_path(LOGS_DIR, VERIFY_PREFIX + local_id())
    return LOGS_DIR / f"{VERIFY_PREFIX}{job}"


def side_path(results: Path, name: str) -> Path:
    """Where the CSV `name` (comm.csv, gpu_samples.csv, ...) of a results file lies: beside it,
    and named after it unless it is the default results.csv (old.csv: old_comm.csv), so that
    two results files in one folder never share, or replace, each other's side files."""
    if results.name == DEFAULT_RESULTS.name:
        return results.with_name(name)
    return results.with_name(f"{results.stem}_{name}")
