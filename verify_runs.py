"""How verify.py runs main.py and reaches its ranks: through run.sh as users launch it (srun
inside the job, torchrun without), each run in its own process group with a time bound; one
process alone, outside any launcher's world; a rank's process found in /proc, killed, or its
step signalled as SLURM's time-limit warning would.
"""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from layout import REPO
from slurm_jobs import job_python, without_slurm

RUN_TIMEOUT_S = 900  # one run of main.py; a hung one is a FAIL, not a job at its time limit
# A step of one task beside the ranks' inside the job (as run.sh's samplers).
SIDE_STEP = ["srun", "--overlap", "--nodes=1", "--ntasks=1"]

# What makes a process one rank of a launcher's world (main.py reads them).
LAUNCHER_VARIABLES = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT".split()

# Rank 0's progress line (train.py's Trainer writes it: "epoch 1 step    10/100 loss ...").
PROGRESS = re.compile(r"^epoch \d+ step +\d+/", re.MULTILINE)


@dataclass
class Context:
    """Where the checks run: the report's folder, the world size, the user's options."""

    out: Path
    world_size: int
    nodes: list[str]
    extra: list[str]
    in_slurm: bool
    warnings: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)  # torch's, and the GPUs it sees
    device: str = "cpu"  # where main.py trains: "cuda" where torch sees a GPU, unless told

    def log(self, name: str) -> Path:
        return self.out / f"{name}.log"


def run_env(ctx: Context, **extra) -> dict:
    """run.sh's environment: SLURM's inside the job (run.sh then uses srun), none here; a tag
    that finds this run's ranks in /proc (task_pid)."""
    env = dict(os.environ) if ctx.in_slurm else {**without_slurm(), "NPROC": str(ctx.world_size)}
    return {**env, "SAMPLES_DIR": str(ctx.out / "samples"), **extra}


def tag(ctx: Context, name: str) -> str:
    """What marks the ranks of one run (VERIFY_RUN in their environment), to find them."""
    return f"{ctx.out.name}-{name}"


def launch(ctx: Context, args: list[str], log: Path, **env) -> subprocess.Popen:
    """main.py through run.sh, as users launch it; output (both streams) into `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", "run.sh", *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=run_env(ctx, VERIFY_RUN=tag(ctx, log.stem), **env),
            start_new_session=True,  # its own process group: ended whole on a timeout
        )


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> int | None:
    """The run's exit status; None where it outlived `timeout` (it is killed)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def run(ctx: Context, args: list[str], name: str, **env) -> int | None:
    return finish(launch(ctx, args, ctx.log(name), **env))


def wait_for_progress(log: Path, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> bool:
    """Whether rank 0 printed a progress line (training runs) before the run ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if PROGRESS.search(log.read_text(errors="replace")):
            return True
        time.sleep(0.2)
    return False


def task_pid(tag: str, rank: int) -> int | None:
    """The process of rank `rank` of the run tagged VERIFY_RUN=tag (or of job SLURM_JOB_ID=tag)
    on this node: a Python running main.py (not its --check, not torchrun's agent) whose
    environment gives that rank (torchrun's RANK, or SLURM_PROCID in an srun step)."""
    tags = {f"VERIFY_RUN={tag}".encode(), f"SLURM_JOB_ID={tag}".encode()}
    ranks = {f"RANK={rank}".encode(), f"SLURM_PROCID={rank}".encode()}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if (
            Path(argv[0].decode(errors="replace")).name.startswith("python")
            and b"main.py" in argv
            and b"--check" not in argv
            and b"torch.distributed.run" not in argv
            and tags & environ
            and ranks & environ
        ):
            return int(proc.name)
    return None


def kill_task(tag: str, rank: int) -> bool:
    """SIGKILL one rank on this node; False if it does not run here."""
    pid = task_pid(tag, rank)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    return pid is not None


def kill_rank(ctx: Context, tag: str, rank: int) -> bool:
    """SIGKILL one rank: here, or inside the job on the node that runs it (srun's block
    distribution: rank r on node r * nodes // world size), through a SIDE_STEP there that runs
    `verify.py --kill-task`."""
    if not ctx.in_slurm:
        return kill_task(tag, rank)
    node = ctx.nodes[rank * len(ctx.nodes) // ctx.world_size]
    step = [*SIDE_STEP, f"--nodelist={node}", sys.executable, "verify.py"]
    kill = [*step, "--kill-task", tag, str(rank)]
    return subprocess.run(kill, cwd=REPO, capture_output=True, timeout=60).returncode == 0


def stop_all(ctx: Context, proc: subprocess.Popen, tag: str) -> bool:
    """SIGUSR1 to every rank, as SLURM's warning reaches them: inside the job, to the step of
    the ranks (scancel --signal, which signals the tasks and not the batch shell: run.sh would
    requeue the job); here, to run.sh, which passes it to each rank."""
    if not ctx.in_slurm:
        proc.send_signal(signal.SIGUSR1)
        return True
    pid = task_pid(tag, 0)  # rank 0 runs on this, the batch node
    if pid is None:
        return False
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    step_id = dict(e.split("=", 1) for e in environ if "=" in e)["SLURM_STEP_ID"]
    step = f"{os.environ['SLURM_JOB_ID']}.{step_id}"
    return subprocess.run(["scancel", "--signal=USR1", step], timeout=60).returncode == 0


def alone(ctx: Context, args: list[str], timeout: float = RUN_TIMEOUT_S):
    """The jobs' Python alone, outside any launcher's world: the reference run and the reading
    of checkpoints. In a container (EDF) that Python is reachable only through srun, whose own
    step is a world of one; elsewhere it runs here, without the launchers' variables."""
    if ctx.in_slurm and os.environ.get("EDF"):
        python = [*SIDE_STEP, f"--environment={os.environ['EDF']}", job_python(True)]
        env = dict(os.environ)
    else:
        python = [job_python(False)]
        env = {k: v for k, v in without_slurm().items() if k not in LAUNCHER_VARIABLES}
    command = [*python, *map(str, args)]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout
    )
