"""A rank that dies or hangs ends the run within the process-group timeout, naming that rank."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def start_two_ranks(pg_timeout: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "main.py", "--dataset", "synthetic", "--train-samples", "40000", "--val-samples",
           "256", "--batch-size", "32", "--epochs", "1", "--print-every", "20",
           "--no-checkpoint", "--pg-timeout", str(pg_timeout)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pid_of_rank(launcher: subprocess.Popen, rank: int) -> int:
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no process of rank {rank}")


def wait_for_training(launcher: subprocess.Popen) -> None:
    for line in launcher.stdout:  # rank 0's progress lines: training is under way
        if line.startswith("epoch 1 step"):
            return
    raise AssertionError("training never started: " + launcher.stderr.read()[-2000:])


def first_error_line(launcher: subprocess.Popen) -> str:
    for line in launcher.stderr:
        if line.startswith("error:"):
            return line
    return ""


@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_other_ranks_exit_naming_the_failed_rank(failure):
    pg_timeout = 10
    limit = 15 if failure == "dies" else pg_timeout + 15  # detection, then the check-in grace
    launcher = start_two_ranks(pg_timeout)
    victim = None
    # Whatever happens, nothing outlives the test.
    watchdog = threading.Timer(limit + 60, launcher.kill)
    watchdog.start()
    try:
        wait_for_training(launcher)
        victim = pid_of_rank(launcher, 1)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL if failure == "dies" else signal.SIGSTOP)
        error = first_error_line(launcher)
        elapsed = time.monotonic() - t0
    finally:
        if victim is not None and failure == "hangs":  # spare torchrun its 30 s of waiting
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        launcher.wait(timeout=limit + 60)
        watchdog.cancel()
    print(f"rank 1 {failure}: rank 0 reported it after {elapsed:.1f} s")
    assert error.startswith("error: rank 0: rank(s) 1 died or hung"), error
    assert elapsed < limit
    assert launcher.returncode != 0
