"""The SLURM job helpers that the sweep (run_benchmarks.py) and the cluster's acceptance test
(its --verify, verify.py) share: main.py's options read from a command line, the jobs' Python
and an environment without SLURM's variables, main.py --check before anything is submitted, job
scripts that submit run.sh with sbatch, and squeue's view of the jobs until they end.
"""

import argparse
import functools
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import config
from layout import REPO
from utils import fail, last_line

# squeue states after which a job no longer runs (COMPLETED is the only good one).
ENDED = set(
    "COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL OUT_OF_MEMORY PREEMPTED BOOT_FAIL DEADLINE "
    "REVOKED SPECIAL_EXIT".split()
)

# The last line run.sh (and the collection job) writes: the exit status outlives the job, which
# SLURM forgets MinJobAge seconds after it ends (and there may be no sacct to ask).
EXIT_LINE = re.compile(r"exit status (\d+)\s*$", re.MULTILINE)

# The device `main.py --check` found, in its line: device=cpu, device=cuda (no GPU here: ...).
CHECKED_DEVICE = re.compile(r"\bdevice=(\w+)")
SQUEUE_RETRIES = 5  # a busy controller may time out now and then


@dataclass
class Job:
    """A submitted job, and what became of it."""

    name: str
    job_id: str
    log: Path
    state: str = "PENDING"


@functools.cache
def main_options() -> dict[str, argparse.Action]:
    """main.py's option strings (`--batch-size`, `--batch_size`), each with its action."""
    return config.add_options(argparse.ArgumentParser())._option_string_actions


def main_option(token: str) -> str | None:
    """The Config field a main.py option sets (`--batch-size=64`, an alias or an abbreviation
    argparse would accept), or None when the token names no single one."""
    return option_dest(token, main_options())


def option_dest(token: str, actions: dict[str, argparse.Action]) -> str | None:
    """The destination an option of a parser with these actions sets, or None."""
    if not token.startswith("--"):
        return None
    name = token.split("=", 1)[0]
    dests = (
        {actions[name].dest}
        if name in actions
        else {action.dest for option, action in actions.items() if option.startswith(name)}
    )
    return dests.pop() if len(dests) == 1 else None


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our arguments, and main.py's (those after the first `--`)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main_value(extra: list[str], dest: str):
    """The value of a Config field that main.py's arguments choose, or its default (a bad
    value is main.py's check to refuse)."""
    parser = config.add_options(argparse.ArgumentParser(add_help=False, exit_on_error=False))
    try:
        return getattr(parser.parse_known_args(extra)[0], dest)
    except argparse.ArgumentError:
        return getattr(config.Config, dest)


def edf_value(environment: str) -> str:
    """An EDF file as an absolute path (jobs start in the repository); a bare name (found by
    the Container Engine in ~/.edf) unchanged."""
    path = Path(environment)
    return str(path.resolve()) if path.is_file() else environment


def script(comment: str, sbatch_options: list[str], target: list[str], env: dict) -> str:
    """A job script: from the repository, sbatch with these options (and the caller's, "$@")."""
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    options = " \\\n    ".join(shlex.quote(o) for o in sbatch_options)
    return (
        "#!/bin/bash\n"
        f"{comment}"
        'cd "$(dirname "$0")/../.." || exit  # from jobs/<sweep>/ to the repository\n'
        f"{exports}"
        f"exec sbatch \\\n    {options} \\\n"
        f'    "$@" \\\n'
        f"    {shlex.join(target)}\n"
    )


def slurm_options(args) -> list[str]:
    options = []
    for flag, value in (("--partition", args.partition), ("--account", args.account)):
        if value:
            options.append(f"{flag}={value}")
    return options


def job_size(nodes: int, tasks_per_node: int, args) -> list[str]:
    """sbatch's options for one task per GPU on `nodes` nodes, and the CPUs of each."""
    options = [
        f"--nodes={nodes}",
        f"--ntasks-per-node={tasks_per_node}",
        f"--gpus-per-node={tasks_per_node}",
    ]
    if args.cpus_per_task:
        options.append(f"--cpus-per-task={args.cpus_per_task}")
    if args.exclusive:
        options.append("--exclusive")
    return options


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


class SubmitError(Exception):
    """sbatch refused a job."""


def submit(job_script: Path, *sbatch_options: str) -> str:
    """Submits through the job script; returns the job id, or ends with sbatch's complaint."""
    done = subprocess.run(
        ["bash", str(job_script), *sbatch_options], cwd=REPO, capture_output=True, text=True
    )
    job_id = done.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    if done.returncode != 0 or not job_id.isdigit():
        raise SubmitError(
            f"sbatch refused {job_script.relative_to(REPO)}: "
            f"{last_line(done.stderr or done.stdout)}"
        )
    return job_id


def require(*commands: str) -> None:
    """Ends with one line, status 2 like other bad input, where a command is not on PATH."""
    for command in commands:
        if shutil.which(command) is None:
            fail(f"{command} not found on PATH: run this on a SLURM login node, or use --local")


def queue_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: state} of the jobs SLURM still knows; finished ones drop out after a while."""
    squeue = ["squeue", "--noheader", "--states=all", "--format=%i %T"]
    squeue.append("--jobs=" + ",".join(job_ids))
    for attempt in range(SQUEUE_RETRIES):
        done = subprocess.run(squeue, capture_output=True, text=True)
        if done.returncode == 0:
            return dict(line.split()[:2] for line in done.stdout.splitlines() if line.strip())
        if "Invalid job id" in done.stderr:  # none of them is known any more
            return {}
        time.sleep(2**attempt)
    fail(f"squeue keeps failing: {last_line(done.stderr)}", code=1)


def state_from_log(log: Path) -> str:
    """The end state of a job SLURM has forgotten, from the exit status its log ends with."""
    try:
        statuses = EXIT_LINE.findall(log.read_text(errors="replace"))
    except OSError:
        statuses = []
    if not statuses:
        return "UNKNOWN"
    return "COMPLETED" if statuses[-1] == "0" else "FAILED"


def wait_for_jobs(jobs: list[Job], poll_interval: float) -> None:
    running = {j.job_id: j for j in jobs}
    print(f"waiting for {len(jobs)} jobs (squeue every {poll_interval:g} s)...", flush=True)
    while running:
        states = queue_states(list(running))
        for job_id, job in list(running.items()):
            if job_id in states:
                job.state = states[job_id]
                if job.state not in ENDED:
                    continue
            else:  # ended and already forgotten between two looks
                job.state = state_from_log(job.log)
            del running[job_id]
            print(f"{job.name}: job {job_id} {job.state}", flush=True)
        if running:
            time.sleep(poll_interval)


def job_python(in_container: bool) -> str:
    """The Python run.sh gives the jobs (pick_python.sh decides, for both): the sweep checks
    them with it, whichever Python runs the sweep itself."""
    pick = ["bash", "-c", 'source "$1/pick_python.sh" && pick_python "$@"', "pick", str(REPO)]
    done = subprocess.run([*pick, "yes" if in_container else "no"], capture_output=True, text=True)
    return done.stdout.strip() or sys.executable


def has_torch(python: str) -> bool:
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    try:
        return subprocess.run([python, "-c", find], capture_output=True).returncode == 0
    except OSError:  # no such interpreter: the jobs will say so
        return False


def checking_python(args) -> str | None:
    """The jobs' Python, to check main.py's options with; None, said once, if it lacks torch."""
    python = job_python(bool(args.environment))
    if has_torch(python):
        return python
    print(
        f"note: no torch in {python}: main.py's options are not checked before submitting",
        file=sys.stderr,
        flush=True,
    )
    return None


def check_device(args, extra: list[str]) -> list[str]:
    """A login node has no GPU: unless the jobs say where they run, check for the GPU nodes'."""
    return [] if args.local or "--device" in extra else ["--device", "cuda"]


def check_main(python: str, argv: list[str], what: str) -> str:
    """main.py --check; its one line, ending this program, where it refuses. Returns the device
    it would train on ("unknown" where its line does not say)."""
    done = subprocess.run(
        [python, "main.py", *argv], cwd=REPO, capture_output=True, text=True, env=without_slurm()
    )
    if done.returncode:  # main.py's one line, or argparse's "main.py: error: ..."
        error = last_line(done.stderr or done.stdout).split("error: ", 1)[-1]
        fail(f"main.py {what}: {error} (nothing submitted)")
    found = CHECKED_DEVICE.search(done.stdout)
    return found.group(1) if found else "unknown"


def without_slurm() -> dict:
    """This environment without SLURM's variables: inside an allocation, run.sh would otherwise
    launch with srun, and main.py would take the allocation's ranks for its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def nodes_for(gpus: int, gpus_per_node: int) -> int:
    """Nodes for one task per GPU; a job that spans nodes must fill every one equally."""
    nodes = math.ceil(gpus / gpus_per_node)
    if gpus % nodes:
        fail(
            f"{gpus} GPUs do not spread evenly over {nodes} nodes of {gpus_per_node} GPUs: "
            f"use a multiple of {nodes}, or another --gpus-per-node"
        )
    return nodes
