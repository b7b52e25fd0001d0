"""Nothing lost under faults: damaged checkpoints, failed saves and loads on any rank, every
stop signal (SIGUSR1, SIGUSR2, SIGTERM) through main.py and run.sh, and the fault-injection
runs whose figures docs/performance.md quotes (marked slow)."""

import errno
import hashlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import checkpoint
import stopping
from checkpoint_files import read_model
from config import Config
from conftest import (
    LONG_RUN,
    REPO,
    TINY,
    TORCHRUN,
    assert_one_line_error,
    main_on_ranks,
    metrics_in,
    popen,
    run_main,
    start_ranks,
)
from dist_harness import full_state, signal_rank_then_train, spawn
from helpers import assert_stopped_mid_epoch_1, start_batch_script, wait_for, wait_for_training

STATUS_CHECKPOINT = 5  # utils.EXIT_STATUS["checkpoint"]
STATUS_STOPPED = 3

# Tiny runs: 4 steps of 64 images an epoch, one checkpoint each.
ARGS = [*TINY, "--batch-size", "64", "--device", "cpu", "--pg-timeout", "30"]


def snapshot(folder: Path) -> dict:
    """Every file under folder and a hash of its bytes: what `nothing written` compares."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def train_epochs(
    folder: Path, epochs: int, strategy: str = "ddp", *extra, nproc: int | None = None
) -> None:
    world_size = nproc or (2 if strategy != "ddp" else 1)
    done, _ = main_on_ranks(
        [*ARGS, "--strategy", strategy, "--checkpoint-dir", folder, "--epochs", epochs, *extra],
        world_size,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def damage(path: Path, strategy: str) -> Path:
    """Cut a checkpoint's model file short, as a full disk or a crash of the file system does:
    DDP's one file, or one of FSDP's shards. Returns the file."""
    victim = path / checkpoint.DDP_FILE if strategy == "ddp" else sorted(path.glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[:100])
    return victim


# ----------------------------------------------------------------------------- damaged checkpoints


def test_resume_auto_without_any_checkpoint_still_starts_fresh(tmp_path):
    (tmp_path / "ckpt_e0002_s000000.damaged").mkdir()  # set aside: not a checkpoint any more
    done = run_main([*ARGS, "--checkpoint-dir", tmp_path, "--epochs", 1, "--resume", "auto"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"--resume auto: no checkpoint in {tmp_path}; starting fresh" in done.stdout


def test_an_unreadable_checkpoint_is_set_aside_never_overwritten_or_pruned(tmp_path):
    train_epochs(tmp_path, 2, "ddp", "--keep-last", 2)
    older, newest = tmp_path / "ckpt_e0002_s000000", tmp_path / "ckpt_e0003_s000000"
    damage(newest, "ddp")
    evidence = snapshot(newest)
    done, _ = main_on_ranks(
        [*ARGS, "--checkpoint-dir", tmp_path, "--epochs", 4, "--resume", "auto", "--keep-last", 1],
        2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    aside = tmp_path / "ckpt_e0003_s000000.damaged"
    assert f"set {newest} aside as {aside}" in done.stdout
    assert f"resumed from {older}" in done.stdout
    # Epoch 2 trained again saved a new ckpt_e0003 beside it; --keep-last 1 pruned that one,
    # never the damaged one, nor the one resumed from.
    assert snapshot(aside) == evidence
    assert [p.name for p in checkpoint.finished(tmp_path)] == [
        "ckpt_e0002_s000000",
        "ckpt_e0005_s000000",
    ]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_save_over_a_checkpoint_without_its_meta_file_sets_it_aside(tmp_path):
    final, tmp = tmp_path / "ckpt_e0002_s000000", tmp_path / "ckpt_e0002_s000000.tmp"
    final.mkdir()
    (final / checkpoint.DDP_FILE).write_bytes(b"evidence")
    tmp.mkdir()
    (tmp / checkpoint.META_FILE).write_bytes(b"new")
    checkpoint._move_into_place(tmp, final)
    assert (final / checkpoint.META_FILE).read_bytes() == b"new"
    assert (
        tmp_path / "ckpt_e0002_s000000.damaged" / checkpoint.DDP_FILE
    ).read_bytes() == b"evidence"
    assert checkpoint.candidates(tmp_path) == [final]


def test_what_killed_runs_left_unfinished_goes_the_damaged_stays(tmp_path):
    """A .tmp folder (a save cut short) or .deleting one (a prune cut short) is removed after
    the next save; a .damaged one is kept."""
    for name in (
        "ckpt_e0003_s000000.tmp",
        "ckpt_e0001_s000000.deleting",
        "ckpt_e0002_s000000.damaged",
        "ckpt_e0004_s000000",
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / checkpoint.META_FILE).write_bytes(b"")
    checkpoint._remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt_e0002_s000000.damaged",
        "ckpt_e0004_s000000",
    ]


# ----------------------------------------------------------------------------- failed saves, loads

# main.py with a fault injected on one rank: FAULT="<rank>:<kind>:<path fragment>". The fault
# strikes where that rank's file operation of that kind touches a path containing the fragment.
FAULTY_MAIN = """
import errno, os, sys
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import checkpoint, main

rank, kind, fragment = os.environ["FAULT"].split(":")
if os.environ.get("RANK", "0") == rank:
    def strikes(path):
        return fragment in str(path)
    if kind == "save":  # torch's serialization: a full disk
        real_save = torch.save
        def save(obj, f, *args, **kwargs):
            if strikes(f):
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            return real_save(obj, f, *args, **kwargs)
        torch.save = save
    elif kind == "load":  # a file the disk cannot read back
        real_load = torch.load
        def load(f, *args, **kwargs):
            if strikes(f):
                raise OSError(errno.EIO, "Input/output error", str(f))
            return real_load(f, *args, **kwargs)
        torch.load = load
    elif kind == "dcp":  # one of FSDP's shards
        real_write = dcp_fs.FileSystemWriter.write_data
        def write_data(self, plan, planner):
            if strikes(self.path):
                raise OSError(errno.EDQUOT, "Disk quota exceeded", str(self.path))
            return real_write(self, plan, planner)
        dcp_fs.FileSystemWriter.write_data = write_data
    elif kind == "rename":  # the last step: the finished folder renamed to its name
        real_replace = os.replace
        def replace(src, dst, *args, **kwargs):
            if strikes(src) and str(src).endswith(".tmp"):
                raise OSError(errno.EROFS, "Read-only file system", str(src))
            return real_replace(src, dst, *args, **kwargs)
        checkpoint.os.replace = replace
sys.exit(main.main(sys.argv[1:]))
"""


def assert_every_rank_ends_with_one_line(
    args: list, fault: str, tmp_path: Path, *fragments: str, timeout: float = 150
) -> None:
    """Two ranks of FAULTY_MAIN both end with status 5, within 10 s of each other (neither
    waits for a timeout), rank 0 with one error: line holding every fragment, rank 1 with no
    traceback."""
    program = tmp_path / "faulty_main.py"
    program.write_text(FAULTY_MAIN)
    ranks = start_ranks(args, 2, program=program, FAULT=fault, PYTHONPATH=str(REPO))
    try:
        ended = {}
        deadline = time.monotonic() + timeout
        while len(ended) < 2 and time.monotonic() < deadline:
            for r, rank in enumerate(ranks):
                if r not in ended and rank.poll() is not None:
                    ended[r] = time.monotonic()
            time.sleep(0.05)
        outputs = [rank.communicate(timeout=5) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    statuses = [rank.returncode for rank in ranks]
    assert statuses == [STATUS_CHECKPOINT] * 2, outputs
    done = subprocess.CompletedProcess([], statuses[0], *outputs[0])
    assert_one_line_error(done, *fragments, status=STATUS_CHECKPOINT)
    assert "Traceback" not in outputs[1][0] + outputs[1][1]
    assert max(ended.values()) - min(ended.values()) < 10, ended


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy,fault,cause",
    [
        (
            "ddp",
            "1:save:ckpt_e0003_s000000.tmp/rng_rank1.pt",
            "rank 1: OSError: [Errno 28] No space left on device",
        ),
        (
            "ddp",
            "0:save:ckpt_e0003_s000000.tmp/state.pt",
            "rank 0: OSError: [Errno 28] No space left on device",
        ),
        ("ddp", "0:rename:ckpt_e0003", "rank 0: OSError: [Errno 30] Read-only file system"),
        ("fsdp", "1:dcp:ckpt_e0003", "rank 1: OSError: [Errno 122] Disk quota exceeded"),
    ],
)
def test_a_failed_save_on_any_rank_ends_every_rank_with_one_line(tmp_path, strategy, fault, cause):
    """Epoch 1's checkpoint (ckpt_e0002) is saved; epoch 2's fails on one rank. Both ranks
    end at once with status 5 and one line naming the checkpoint, the cause and the intact
    one; no half-written folder stays, and the intact one reads whole (resuming from it:
    test_an_unreadable_checkpoint_is_set_aside_never_overwritten_or_pruned)."""
    args = [*ARGS, "--strategy", strategy, "--checkpoint-dir", tmp_path / "ck", "--epochs", 3]
    failed = tmp_path / "ck" / "ckpt_e0003_s000000"
    intact = tmp_path / "ck" / "ckpt_e0002_s000000"
    assert_every_rank_ends_with_one_line(
        args,
        fault,
        tmp_path,
        f"cannot save checkpoint {failed}: {cause}",
        f"the newest checkpoint, {intact}, is intact",
    )
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [intact.name]
    assert unreadable(intact) is None


def test_a_failed_save_whose_folder_cannot_be_removed_says_so(tmp_path, monkeypatch):
    """A read-only file system refuses the clean-up too: the line must not claim that nothing
    was left behind, but name what was."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", read_only)
    at, fits = checkpoint.Position(epoch=2), checkpoint.Identity("ddp", "cnn", 6, 16)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.save(tmp_path, at, fits, checkpoint.Resumable(model, optimizer))
    line = str(raised.value)
    assert line.startswith(f"cannot save checkpoint {tmp_path / at.name}: OSError: [Errno 28]")
    assert f"{at.name}.tmp could not be removed (OSError: [Errno 30] Read-only" in line
    assert "nothing of it was kept" not in line and f"{tmp_path} holds no earlier" in line
    assert (tmp_path / f"{at.name}.tmp").is_dir()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,file", [("ddp", "rng_rank1.pt"), ("fsdp", checkpoint.META_FILE)])
def test_checkpoints_that_cannot_be_read_end_every_rank_and_write_nothing(tmp_path, strategy, file):
    """One epoch's checkpoint, at the world size that resumes it. --resume PATH of a file rank 1
    alone cannot read: not rank 1 failing while rank 0 goes on (to train and wait for it, or to
    DCP's collective load, which rank 1 would meet with another collective), but both ending at
    once, status 5, one line. Then --resume auto where every checkpoint is damaged: today's run
    would say `no checkpoint`, train from scratch and save over the evidence; instead one error
    naming each damaged checkpoint and the ways on, status 5, nothing written."""
    folder = tmp_path / "ck"
    train_epochs(folder, 1, strategy, nproc=2)
    first = folder / "ckpt_e0002_s000000"
    args = [*ARGS, "--strategy", strategy, "--checkpoint-dir", folder]
    assert_every_rank_ends_with_one_line(
        [*args, "--epochs", 2, "--resume", first],
        f"1:load:{file}",
        tmp_path,
        f"cannot read checkpoint {first} (rank 1: OSError: [Errno 5] Input/output error",
        "nothing was written",
        f"--resume auto --checkpoint-dir {folder}",
    )
    assert [p.name for p in folder.iterdir()] == [first.name]

    damage(first, strategy)
    second = folder / "ckpt_e0003_s000000"  # named as a checkpoint, its meta file lost
    second.mkdir()
    (second / checkpoint.DDP_FILE).write_bytes(b"half")
    before = snapshot(folder)
    done, statuses = main_on_ranks([*args, "--epochs", 3, "--resume", "auto"], 2)
    assert set(statuses) == {STATUS_CHECKPOINT}, statuses
    line = assert_one_line_error(
        done,
        f"no checkpoint in {folder} can be read",
        str(first),
        str(second),
        "nothing was written",
        "--checkpoint-dir",
        "move them out of",
        status=STATUS_CHECKPOINT,
    )
    assert "meta.pt" in line.split(str(second), 1)[1]  # why, for each
    assert "starting fresh" not in done.stdout and not metrics_in(done.stdout)
    assert snapshot(folder) == before


# ----------------------------------------------------------------------------- every stop signal

STOP_SIGNALS = [sig.name for sig in stopping.STOP_SIGNALS]  # main.py's, each by name
LONG = [*LONG_RUN, "--device", "cpu"]


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("signal_name, rank", [("SIGUSR1", 1), ("SIGTERM", 0)])
def test_a_stop_signal_stops_two_torchrun_ranks_with_a_checkpoint(tmp_path, signal_name, rank):
    """The signal reaches one rank of two under torchrun (rank 1: rank 0 learns of it when the
    ranks agree on a stop, StopRequest): both stop at one step boundary, save one checkpoint,
    and exit 3 (torchrun's report says so). Every stop signal has main.py's one handler
    (stopping.take_stop_signals); SIGUSR2 reaches torchrun's ranks through run.sh below."""
    torchrun = popen(
        [*TORCHRUN, "--nproc_per_node=2", "main.py", *LONG, "--checkpoint-dir", tmp_path]
    )
    try:
        wait_for_training(torchrun)
        ranks = children(torchrun.pid)
        assert len(ranks) == 2, ranks
        victim = next(
            p for p in ranks if f"RANK={rank}" in Path(f"/proc/{p}/environ").read_text().split("\0")
        )
        os.kill(victim, getattr(signal, signal_name))
        out, err = torchrun.communicate(timeout=150)
    finally:
        torchrun.kill()
    # Rank 0 prints: the signal's name where it got it, else that another rank did.
    heard = signal_name if rank == 0 else "a signal to another rank"
    assert f"[CHECKPOINT] stopped on {heard} at epoch 1 step" in out, err[-3000:]
    # torchrun itself ends in a traceback (ChildFailedError) on a rank's non-zero exit: run.sh
    # turns that into its status 3. The ranks wrote none, and no error.
    assert (out + err).count("Traceback") == err.count("ChildFailedError:"), err[-3000:]
    assert "error:" not in out + err
    assert "exitcode  : 3" in err  # the first rank to end (both do)
    assert_stopped_mid_epoch_1(tmp_path)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("signal_name", STOP_SIGNALS)
def test_every_stop_signal_to_run_sh_reaches_every_rank(repo_copy, signal_name):
    """run.sh without SLURM passes the signal to every rank (not to torchrun, which SIGUSR1 and
    SIGUSR2 would end, orphaning the ranks): a checkpoint, and run.sh's status 3."""
    script = popen(["bash", "run.sh", *LONG, "--checkpoint-dir", "ckpt"], repo_copy, NPROC="2")
    try:
        wait_for_training(script)
        script.send_signal(getattr(signal, signal_name))
        out, err = script.communicate(timeout=150)
    finally:
        script.kill()
    assert script.returncode == STATUS_STOPPED, out[-2000:] + err[-3000:]
    assert f"[CHECKPOINT] stopped on {signal_name} at epoch 1 step" in out
    assert "continue with: main.py" in out
    assert "error:" not in out + err and "Traceback" not in out + err
    assert_stopped_mid_epoch_1(repo_copy / "ckpt")


# What SLURM's binaries would do, for run.sh's batch path: the sampler's srun waits to be
# ended; the tasks' srun "trains" until a stop signal reaches it (from run.sh, or as scancel
# would send it), writes down which, then exits with $TASKS_STATUS; scontrol and scancel write
# down what they were asked. scancel returns once the tasks have ended: run.sh's trap must then
# still take their exit status (tasks that save and exit at once end before the trap returns).
SLURM_STAND_INS = {
    "srun": """if [[ " $* " == *" --overlap "* ]]; then exec sleep 600; fi
stop() { echo "srun got $1" >>"$CALLS"; exit "$TASKS_STATUS"; }
trap 'stop USR1' USR1
trap 'stop USR2' USR2
trap 'stop TERM' TERM
echo $$ >"$CALLS.started"
while true; do sleep 0.1; done""",
    "scontrol": 'echo "scontrol $*" >>"$CALLS"',
    "scancel": """echo "scancel $*" >>"$CALLS"
tasks=$(cat "$CALLS.started")
kill -TERM "$tasks"
while kill -0 "$tasks" 2>/dev/null; do sleep 0.01; done""",
    "python": "true",
}


def batch_job_signalled(
    repo_copy: Path, tmp_path: Path, signal_name: str, tasks_status: int = STATUS_STOPPED
):
    """run.sh as SLURM's batch script, sent signal_name while its tasks train: (the finished
    script, the calls the stand-ins wrote down)."""
    script, calls = start_batch_script(repo_copy, tmp_path, SLURM_STAND_INS, tasks_status)
    try:
        wait_for(Path(f"{calls}.started"), script)
        time.sleep(0.3)  # the stand-in's traps are set once it wrote its pid
        script.send_signal(getattr(signal, signal_name))
        out, err = script.communicate(timeout=30)
    finally:
        script.kill()
    done = subprocess.CompletedProcess(script.args, script.returncode, out, err)
    return done, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("signal_name", ["USR1", "USR2"])
def test_either_warning_signal_reaches_the_tasks_and_requeues_the_batch_job(
    repo_copy, tmp_path, signal_name
):
    done, calls = batch_job_signalled(repo_copy, tmp_path, f"SIG{signal_name}")
    assert calls == [f"srun got {signal_name}", "scontrol requeue 4242"], done.stdout + done.stderr
    assert done.returncode == STATUS_STOPPED


def test_sigterm_reaches_the_tasks_as_sigterm_and_ends_the_batch_job(repo_copy, tmp_path):
    """scancel or the time limit: the tasks get a SIGTERM of their own (through scancel, not
    through srun, which would SIGKILL them), save, and the job ends without a requeue."""
    done, calls = batch_job_signalled(repo_copy, tmp_path, "SIGTERM")
    assert calls == ["scancel --signal=TERM 4242", "srun got TERM"], done.stdout + done.stderr
    assert done.returncode == STATUS_STOPPED
    assert "run.sh: job 4242 exit status 3" in done.stdout


# ----------------------------------------------------------------------------- fault injection

# The random steps, signals, ranks and kill times come from this seed (printed, and set with
# FAULTS_SEED to repeat a run or try another).
SEED = int(os.environ.get("FAULTS_SEED", "20261123"))
SIGNALS = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM]
# 12 steps of 16 images an epoch, augmentation on (resuming must restore every random stream).
STOP_CFG = dict(
    dataset="synthetic",
    augment=True,
    train_samples=192,
    val_samples=32,
    batch_size=16,
    print_every=10**6,
    seed=11,
    epochs=4,
    pg_timeout=60,
)
STEPS_PER_EPOCH = 12


def model_and_stop(env, cfg):
    """The whole model and where a stop left training."""
    import session

    outcome = session.run(cfg, env)
    return full_state(env, outcome.trainer.model), outcome.stopped_at


def train_until_signalled(env, cfg, at_poll, rank, signum):
    """main.py's run on every rank, with `signum` sent to `rank` at its at_poll-th step (0:
    never). The ranks agree on a stop at every step (the next step after the signal), as main()
    catches the signals. Returns model_and_stop's."""
    return signal_rank_then_train(env, cfg, at_poll, rank, model_and_stop, signum, every=1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ten_stops_at_random_steps_then_resumes_end_as_the_uninterrupted_run(tmp_path, strategy):
    """Two ranks, stopped by a random stop signal to a random rank at 10 random steps of 4
    epochs, each stop resumed in new processes: the same parameters as without the stops, to
    the bit."""
    rng = random.Random(f"{SEED}-stops-{strategy}")
    cfg = dict(STOP_CFG, strategy=strategy)
    reference, _ = spawn(train_until_signalled, 2, Config(**cfg, checkpoint=False), 0, 0, 0)[0]
    total = cfg["epochs"] * STEPS_PER_EPOCH
    targets = sorted(rng.sample(range(1, total), 10))
    done, stops = 0, []
    resumed = Config(**cfg, checkpoint_dir=str(tmp_path), resume="auto")
    for target in targets:
        signum, rank = rng.choice(SIGNALS), rng.randrange(2)
        state, at = spawn(train_until_signalled, 2, resumed, target - done, rank, signum)[0]
        assert at is not None, f"no stop at step {target}"
        done = (at.epoch - 1) * STEPS_PER_EPOCH + at.step
        assert done == target, (done, target)
        stops.append(f"{signal.Signals(signum).name}@rank{rank}:e{at.epoch}s{at.step}")
    state, at = spawn(train_until_signalled, 2, resumed, 0, 0, 0)[0]
    assert at is None and state.keys() == reference.keys()
    differing = [k for k in state if not torch.equal(state[k], reference[k])]
    print(
        f"\n[FAULTS] seed={SEED} strategy={strategy} stops survived: {len(stops)} "
        f"({' '.join(stops)}); parameters differing from the uninterrupted run: "
        f"{len(differing)} of {len(state)}"
    )
    assert not differing


KILL_ARGS = [
    *TINY,
    "--train-samples",
    "64",
    "--val-samples",
    "32",
    "--batch-size",
    "16",
    "--device",
    "cpu",
    # A killed rank's sockets close at once, so the survivor needs no timeout to notice; a
    # short one only turned a slow fsync on a loaded machine into a "hung peer" (seen once).
    "--pg-timeout",
    "60",
    "--keep-last",
    "2",
    "--seed",
    "3",
]
KILL_EPOCHS = 40


def unreadable(path: Path) -> str | None:
    """Why the checkpoint at path cannot be read whole, or None: every file of it loaded, as
    resuming would (FSDP's shards through DCP, without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        for f in path.glob("*.pt"):
            torch.load(f, weights_only=False)
        if (path / ".metadata").exists():
            dcp_to_torch_save(path, path.parent / "probe.pt")
            (path.parent / "probe.pt").unlink()
        elif not (path / checkpoint.DDP_FILE).is_file():
            return "no model file"
        return None if (path / checkpoint.META_FILE).is_file() else "no meta file"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def saving(folder: Path) -> set:
    """The .tmp folders of saves under way (or cut short), each as (name, inode, creation)."""
    found = set()
    for path in folder.glob("*.tmp"):
        try:
            stat = path.stat()
            found.add((path.name, stat.st_ino, stat.st_ctime_ns))
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ten_sigkills_of_one_rank_never_leave_an_unreadable_newest_checkpoint(tmp_path, strategy):
    """Two ranks started as srun starts them; a random one is SIGKILLed, 10 times, each run
    resuming the last (--resume auto): at a random moment after start-up, or, half of the
    times, the moment a save has begun (its .tmp folder appears). After every kill the
    checkpoint --resume auto would pick is readable, and the run, finished at last, ends with
    the parameters of an uninterrupted one, to the bit."""
    rng = random.Random(f"{SEED}-kills-{strategy}")
    args = [*KILL_ARGS, "--strategy", strategy, "--epochs", KILL_EPOCHS, "--resume", "auto"]
    reference = tmp_path / "reference"
    done, _ = main_on_ranks([*args, "--checkpoint-dir", reference], 2)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "killed"
    kills, lost, left = [], [], 0
    for _ in range(10):
        before = saving(folder)
        ranks = start_ranks([*args, "--checkpoint-dir", folder], 2)
        try:
            for line in ranks[0].stdout:  # once rank 0 has resumed: training is starting
                if line.startswith("[CONFIG]"):
                    break
            victim, delay = rng.randrange(2), rng.uniform(0, 2.5)
            mid_save = rng.random() < 0.5
            start = time.monotonic()
            if mid_save:  # a new .tmp folder: not one an earlier kill left
                while not saving(folder) - before and time.monotonic() - start < 30:
                    time.sleep(0.001)
            else:
                time.sleep(delay)
            delay = time.monotonic() - start
            ranks[victim].kill()
            errors = [rank.communicate(timeout=60)[1] for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
        statuses = [rank.returncode for rank in ranks]
        # It had not finished, or failed, already.
        assert statuses[victim] == -signal.SIGKILL, (statuses, [e[-2000:] for e in errors])
        left += bool(list(folder.glob("*.tmp")))
        newest = (checkpoint.candidates(folder) or [None])[-1]  # none before epoch 1 ends
        if newest and (why := unreadable(newest)):
            lost.append(f"{newest.name}: {why}")
        how = "(save)" if mid_save else ""
        kills.append(f"rank{victim}@{delay:.2f}s{how}->{newest.name if newest else '-'}")
    done, statuses = main_on_ranks([*args, "--checkpoint-dir", folder], 2)
    assert statuses == [0, 0], done.stderr[-3000:]
    state, expected = (read_model(checkpoint.latest(f)) for f in (folder, reference))
    differing = [k for k in expected if not torch.equal(state[k], expected[k])]
    print(
        f"\n[FAULTS] seed={SEED} strategy={strategy} kills survived: {len(kills)} "
        f"({' '.join(kills)}); kills that left a half-written folder: {left}; "
        f"unreadable newest checkpoints: {len(lost)} {lost}; parameters differing from the "
        f"uninterrupted run: {len(differing)} of {len(expected)}"
    )
    assert not lost and not differing
