"""The verify job from both sides: what run_benchmarks.py --verify submits (one job script) and
reads back after it (report.md's rows), and what verify.py keeps to inside it (the main.py
options it chooses in every run, refused after `--`; the report it writes).
"""

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import layout
import slurm_jobs
from config import LAUNCHER_OPTION
from utils import count, fail

# main.py's options that verify sets in every run: given after `--`, they would change what is
# compared (a batch that does not split, augmentation seeded per rank, Adam's eps amplifying
# last-bit differences) or where the checkpoints go.
VERIFY_SETS = set(
    "strategy epochs batch_size train_samples val_samples optimizer lr lr_schedule precision seed "
    "augment grad_accum print_every checkpoint checkpoint_dir resume comm_benchmark".split()
)

DEFAULTS = ["--dataset", "synthetic", "--model", "cnn"]  # the user's options after `--` win


def refuse_verify_options(extra: list[str]) -> None:
    """One error line for an option after `--` that verify chooses in every run."""
    for token in extra:
        name = token.split("=", 1)[0]
        if LAUNCHER_OPTION.match(name):
            fail(
                f"{name} after -- is no option of main.py: the job's size is run_benchmarks.py's "
                "--gpus and --gpus-per-node"
            )
        if slurm_jobs.main_option(token) in VERIFY_SETS:
            fail(f"{name} after -- is chosen by verify in every run (docs/verify.md); leave it out")


def verify_gpus(args) -> list[int]:
    """The verify job's GPU count, as a list like the sweep's: --gpus N, or 2 nodes' worth."""
    if args.gpus and len(args.gpus) > 1:
        fail(f"--verify runs one job: give one --gpus count, not {' '.join(map(str, args.gpus))}")
    if args.gpus == [1]:  # nothing to compare one process with, no peer to kill
        fail("--verify needs at least 2 GPUs: its checks are between ranks")
    return args.gpus or [2 * args.gpus_per_node]


@dataclass
class Row:
    """One check's outcome: a row of report.md."""

    check: str
    passed: bool
    figure: str
    log: str  # relative to the repository

    @property
    def result(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def markdown(self) -> str:
        cells = [self.check, self.result, self.figure, f"`{self.log}`"]
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    def error_line(self) -> str:
        return f"error: verify: {self.check} failed: {self.figure}; see {self.log}"


def print_outcome(rows: list[Row], report: Path, warnings: list[str]) -> bool:
    """How a verify ends, inside its job and after --wait: how many checks passed and which
    failed, the report's path, then on stderr each warning and each failed check's line.
    Whether every check passed."""
    failed = [row for row in rows if not row.passed]
    print(
        f"verify: {len(rows) - len(failed)} of {count(len(rows), 'check')} passed"
        + (f"; failed: {', '.join(row.check for row in failed)}" if failed else ""),
        flush=True,
    )
    print(f"report: {layout.relative(report)}", flush=True)
    for line in warnings + [row.error_line() for row in failed]:
        print(line, file=sys.stderr, flush=True)
    return bool(rows) and not failed


WARNING = "warning: verify: "

ROW_RE = re.compile(r"^\| (\S+) \| (PASS|FAIL) \| (.*) \| `([^`]*)` \|$", re.MULTILINE)


def read_rows(report: str) -> list[Row]:
    """The check rows of a report.md (run_benchmarks.py --wait reads them back)."""
    return [
        Row(check, result == "PASS", figure.replace("\\|", "|"), log)
        for check, result, figure, log in ROW_RE.findall(report)
    ]


def warning_lines(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith(WARNING)]


def report_text(rows: list[Row], about: dict, warnings: list[str]) -> str:
    lines = [
        "# Cluster acceptance test (verify.py)",
        "",
        "What each check proves and what to do with a FAIL: docs/verify.md.",
        "",
        "| check | result | figure | log |",
        "|---|---|---|---|",
        *(row.markdown() for row in rows),
        "",
        *(f"{w}\n" for w in warnings),
        "## Where",
        "",
        *(f"- {k}: {v}" for k, v in about.items()),
        "",
    ]
    return "\n".join(lines)


VERIFY_TIME = "00:30:00"  # the checks take minutes; a hung one ends at its own bound


def verify_script(folder: str, gpus: int, nodes: int, args, extra: list[str]) -> str:
    command = shlex.join([slurm_jobs.job_python(False), "verify.py", "--", *extra])
    command += '; status=$?; echo "exit status $status"; exit $status'
    options = [
        "--parsable",
        "--job-name=verify",
        "--no-requeue",  # a node's failure must not rerun the checks into the same folder
        f"--time={args.time or VERIFY_TIME}",
        f"--output={layout.jobs_folder(folder)}/verify_%j.log",
        *slurm_jobs.slurm_options(args),
        *slurm_jobs.job_size(nodes, gpus // nodes, args),
    ]
    env = {"EDF": slurm_jobs.edf_value(args.environment)} if args.environment else {}
    comment = (
        f"# The cluster's acceptance test on {count(gpus, 'GPU')} ({count(nodes, 'node')}): "
        "verify.py runs its checks inside the job.\n# Its report: logs/verify-<job id>/"
        f"report.md. Submit again with: bash {layout.jobs_folder(folder)}/verify.sh\n"
    )
    return slurm_jobs.script(comment, options, ["--wrap", command], env)


def verify_report(job: slurm_jobs.Job) -> int:
    """After the job: the report's path, each failed check's line; 0 only if all passed."""
    report = layout.verify_folder(job.job_id) / layout.VERIFY_REPORT
    if not report.is_file():
        print(
            f"error: verify: job {job.job_id} ended {job.state} without a report; see "
            f"{layout.relative(job.log)}",
            file=sys.stderr,
        )
        return 1
    text = report.read_text()
    passed = print_outcome(read_rows(text), report, warning_lines(text))
    return 0 if job.state == "COMPLETED" and passed else 1


def run_verify(args, extra: list[str]) -> int:
    refuse_verify_options(extra)
    gpus = args.gpus[0]
    nodes = slurm_jobs.nodes_for(gpus, args.gpus_per_node)
    if python := slurm_jobs.checking_python(args):
        slurm_jobs.check_main(
            python,
            [*DEFAULTS, *extra, *slurm_jobs.check_device(args, extra), "--check", str(gpus)],
            "(verify)",
        )
    if args.local:  # here, through torchrun: verify.py's own lines are the report
        out = layout.verify_folder(layout.LOCAL_JOB)
        command = [sys.executable, "verify.py", "--out", str(out), "--", *extra]
        return subprocess.run(
            command, cwd=layout.REPO, env={**slurm_jobs.without_slurm(), "NPROC": str(gpus)}
        ).returncode
    folder = layout.time_stamped(layout.JOBS_DIR, layout.VERIFY_PREFIX).name
    text = verify_script(folder, gpus, nodes, args, extra)
    if args.dry_run:
        print(f"# ---- {layout.jobs_folder(folder)}/verify.sh\n{text}", end="")
        return 0
    try:
        job_id = slurm_jobs.submit(slurm_jobs.write(layout.JOBS_DIR / folder / "verify.sh", text))
    except slurm_jobs.SubmitError as e:
        fail(str(e), code=1)
    job = slurm_jobs.Job("verify", job_id, layout.JOBS_DIR / folder / f"verify_{job_id}.log")
    print(
        f"verify: job {job_id} ({count(nodes, 'node')} x {count(gpus // nodes, 'task')}), "
        f"log {layout.relative(job.log)}; report: "
        + layout.relative(layout.verify_folder(job_id) / layout.VERIFY_REPORT),
        flush=True,
    )
    if not args.wait:
        return 0
    try:
        slurm_jobs.wait_for_jobs([job], args.poll_interval)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {job_id} goes on (squeue --me)", file=sys.stderr)
        return 130
    return verify_report(job)
