"""What several test files share that is not a fixture: logs and CSVs as the training program
and the collector write them, a model for cost_model's predictions, a CIFAR-10 folder, and
two ranks of which one dies or hangs. (conftest.py runs commands; dist_harness.py runs functions
on real ranks.) No test file imports another: what two of them need lives here."""

import os
import pickle
import signal
import struct
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from conftest import LONG_RUN, REPO, TINY, popen, start_ranks
from utils import format_metric

COURSE_LOGS = REPO / "tests" / "fixtures" / "alps-course-logs"  # the course's real outputs


# ----------------------------------------------------------------------------- logs and CSVs


CNN_PARAMETERS = 553_514  # the course CNN's, on CIFAR-10 (model.count_parameters)


def metric_fields(epoch: int, strategy: str = "ddp", world_size: int = 1, **changes) -> dict:
    """The fields main.py logs, with values the line's formats keep exactly."""
    fields = {
        "epoch": epoch,
        "time": 2.5,
        "val_loss": 1.5 - epoch / 8,
        "acc": 40.0 + epoch,
        "peak_mem": 800,
        "strategy": strategy,
        "world_size": world_size,
        "nodes": 1,
        "global_batch": 256,
        "local_batch": 256 // world_size,
        "train_loss": 2.25,
        "val_time": 0.125,
        "throughput": 1000.0 * world_size,
        "data_wait": 0.0625,
        "state_mem": 8856264,
        "precision": "fp32",
        "device": "cpu",
        "dataset": "synthetic",
        "seed": 42,
        "job_id": "1234",
    }
    return {**fields, **changes}


def log_text(metrics: list[dict], expected_epochs: int | None = None, **config) -> str:
    """A log as main.py writes it: a [CONFIG] line (its epochs=, the CNN's model= and
    parameters=, and the fields given), progress chatter, and one line per metric from
    utils.format_metric."""
    config = {"model": "cnn", "parameters": CNN_PARAMETERS, "optimizer": "adam", **config}
    lines = [
        " ".join(
            [
                f"[CONFIG] strategy=ddp epochs={expected_epochs or len(metrics)} seed=42",
                *(f"{k}={v}" for k, v in config.items()),
            ]
        )
    ]
    for fields in metrics:
        lines += [f"epoch {fields['epoch']} step 2/2 loss 2.3 500.0 ms/step", format_metric(fields)]
    return "\n".join(lines) + "\n"


def write_log(
    path: Path, metrics: list[dict], expected_epochs: int | None = None, tail: str = ""
) -> Path:
    path.write_text(log_text(metrics, expected_epochs) + tail)
    return path


def run_log(folder: Path, name: str, epochs: int = 3, **changes) -> Path:
    return write_log(folder / name, [metric_fields(e, **changes) for e in range(1, epochs + 1)])


# nvidia-smi's CSV as run.sh's GPU sampler writes it (samples.py reads it): two GPUs, sampled
# twice 5.5 s apart.
GPU_CSV_HEADER = (
    "timestamp, index, utilization.gpu [%], memory.used [MiB], memory.total [MiB], power.draw [W]"
)
GPU_CSV = f"""{GPU_CSV_HEADER}
2026/11/22 10:00:00.000, 0, 90, 1500, 81559, 300.0
2026/11/22 10:00:00.000, 1, 80, 1400, 81559, 290.0
2026/11/22 10:00:05.500, 0, 70, 1500, 81559, 310.0
2026/11/22 10:00:05.500, 1, 60, 1600, 81559, 280.0
"""


def runs_frame(times_by_run: dict[tuple[str, int], list[float]]) -> pd.DataFrame:
    rows = [
        {
            "log": f"{s}_{g}gpu.log",
            "strategy": s,
            "gpus": g,
            "nodes": 1,
            "job_id": "1",
            "epoch": e,
            "time": t,
            "val_loss": 1.0 / e,
            "acc": 50.0 + e,
            "peak_mem": 100 * g,
            "throughput": 1000.0 * g / t,
        }
        for (s, g), times in times_by_run.items()
        for e, t in enumerate(times, 1)
    ]
    return pd.DataFrame(rows)


def meta_model(name: str = "cnn", build=None):
    """The model `name` (or what `build()` makes) on the meta device: its shapes, all that
    cost_model's predictions read, without memory or random numbers."""
    import torch

    from model import build_model

    with torch.device("meta"):
        return build() if build else build_model(name)


# ----------------------------------------------------------------------------- data


def python2_pickle(batch: dict) -> bytes:
    """A CIFAR-10 batch pickled as the real files are: protocol 2 by python 2 and numpy 1, so
    its strings are python 2's (SHORT_BINSTRING/BINSTRING) and its array names numpy.core.
    Python 3 cannot write this: its bytes pickle as _codecs.encode calls."""

    def string(b: bytes) -> bytes:
        return (b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<I", len(b))) + b

    def integer(i: int) -> bytes:
        return b"K" + bytes([i]) if i < 256 else b"J" + struct.pack("<i", i)

    def array(a: np.ndarray) -> bytes:  # numpy 1's ndarray.__reduce__, as python 2 wrote it
        assert a.dtype == np.uint8 and a.ndim == 2
        dtype = b"cnumpy\ndtype\n" + string(b"u1") + b"K\x00K\x01\x87R"
        dtype += b"(K\x03" + string(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
        shape = integer(a.shape[0]) + integer(a.shape[1]) + b"\x86"
        return (
            b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
            + b"K\x00\x85"
            + string(b"b")
            + b"\x87R(K\x01"
            + shape
            + dtype
            + b"\x89"
            + string(a.tobytes())
            + b"tb"
        )

    def value(v) -> bytes:
        if isinstance(v, bytes):
            return string(v)
        if isinstance(v, np.ndarray):
            return array(v)
        return b"](" + b"".join(integer(i) for i in v) + b"e"  # a list of labels

    items = b"".join(string(k) + value(v) for k, v in batch.items())
    return b"\x80\x02}(" + items + b"u."


def write_cifar_dir(root, n_train_per_file=20, n_test=30, seed=0):
    """A small data set in CIFAR-10's own python format: the first file pickled as the real
    ones are (python 2), the others by this python (as a set converted by hand would be)."""
    import dataset_files  # loads torch: only the tests that write CIFAR-10 files pay for it

    rng = np.random.default_rng(seed)
    folder = root / dataset_files.CIFAR10_FOLDER
    folder.mkdir(parents=True)
    for name, n in [(f, n_train_per_file) for f in dataset_files.CIFAR10_TRAIN_FILES] + [
        (dataset_files.CIFAR10_TEST_FILE, n_test)
    ]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, n).tolist(),
            b"batch_label": name.encode(),
        }
        if name == dataset_files.CIFAR10_TRAIN_FILES[0]:
            (folder / name).write_bytes(python2_pickle(batch))
        else:
            with open(folder / name, "wb") as f:
                pickle.dump(batch, f)
    return folder


# ----------------------------------------------------------------------------- stand-ins


def executable(path: Path, body: str) -> Path:
    """A bash script at path that runs body."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return path


def on_path(folder: Path, **bodies: str) -> str:
    """Bash stand-ins for commands (name -> body) in folder: the PATH that finds them first."""
    for name, body in bodies.items():
        executable(folder / name, body)
    return f"{folder}:{os.environ['PATH']}"


# ----------------------------------------------------------------------------- a peer fails

# Long enough that training is still under way when rank 1 is stopped.
ARGS = [*LONG_RUN, *"--train-samples 40000 --val-samples 256 --epochs 1 --no-checkpoint".split()]
PG_TIMEOUT_S = 10
# What the README promises: a dead peer is named within DEAD_S (measured 3.0-3.1 s on the 2-core
# development machine: gloo sees the closed socket at once, then the survivors give the others
# 3 s to check in); a hung one within --pg-timeout, by the watchdog, once its pulse has been
# silent for half of it (5.9-6.9 s measured).
DEAD_S = 6
HUNG_S = PG_TIMEOUT_S


def wait_for_training(rank0) -> None:
    for line in rank0.stdout:  # rank 0's progress lines: training is under way
        if line.startswith("epoch 1 step"):
            return
    raise AssertionError("training never started: " + rank0.stderr.read()[-3000:])


def assert_stopped_mid_epoch_1(folder: Path) -> None:
    """One checkpoint in folder, saved inside epoch 1 (not at its start)."""
    saved = [p.name for p in folder.iterdir()]
    assert (
        len(saved) == 1 and saved[0].startswith("ckpt_e0001_s") and saved[0] != "ckpt_e0001_s000000"
    ), saved


def first_error_line(rank0) -> str:
    """Rank 0's first error: line, or all it wrote to stderr if none (to say what went wrong)."""
    lines = []
    for line in rank0.stderr:
        if line.startswith("error:"):
            return line
        lines.append(line)
    return "no error: line; stderr:\n" + "".join(lines[-40:])


@contextmanager
def training_ranks(args: list, world_size: int):
    """world_size ranks started with args and --pg-timeout PG_TIMEOUT_S, yielded once rank 0
    trains; killed after 150 s (ranks that never react end the test) and at the end."""
    ranks = start_ranks([*args, "--pg-timeout", PG_TIMEOUT_S], world_size)
    watchdog = threading.Timer(150, lambda: [rank.kill() for rank in ranks])
    watchdog.start()
    try:
        wait_for_training(ranks[0])
        yield ranks
    finally:
        watchdog.cancel()
        for rank in ranks:  # SIGKILL also ends a stopped process
            rank.kill()
            rank.communicate()


def end_rank1_during_training(args: list, signal_sent) -> tuple[str, int, float]:
    """Two ranks train; rank 1 gets signal_sent. Rank 0's error line, exit status, and the
    seconds it took to say so."""
    with training_ranks(args, 2) as (rank0, rank1):
        t0 = time.monotonic()
        os.kill(rank1.pid, signal_sent)
        error = first_error_line(rank0)
        elapsed = time.monotonic() - t0
        return error, rank0.wait(timeout=60), elapsed


def kill_during_training(args: list, world_size: int, victim: int) -> list[str]:
    """world_size ranks train; rank `victim` is killed (SIGKILL). Every rank's stderr."""
    with training_ranks(args, world_size) as ranks:
        os.kill(ranks[victim].pid, signal.SIGKILL)
        return [rank.communicate(timeout=60)[1] for rank in ranks]


def start_batch_script(
    repo_copy: Path, tmp_path: Path, stand_ins: dict, tasks_status: int, restarts: int = 0
) -> tuple[subprocess.Popen, Path]:
    """run.sh started as SLURM's batch script of job 4242 (1 node, 2 tasks), with stand-ins for
    SLURM's binaries and the Python (name -> bash body) first on PATH; they write what they were
    asked into the returned file (CALLS) and end the tasks with tasks_status."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    script = popen(
        ["bash", "run.sh", *TINY],
        repo_copy,
        PATH=on_path(bin_dir, **stand_ins),
        CALLS=str(calls),
        TASKS_STATUS=str(tasks_status),
        PYTHON=str(bin_dir / "python"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="node1",
        SLURM_RESTART_COUNT=str(restarts),
    )
    return script, calls


def wait_for(path: Path, script: subprocess.Popen) -> None:
    """Until `path` exists; fails if the script ends first or after 60 s."""
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline and script.poll() is None, script.communicate()
        time.sleep(0.1)
