"""Run a function on N real gloo ranks (spawned processes) and collect what each returns; and
the functions several test files run on them (a run's weights and metrics, a signal mid-run).
Also `python main.py` itself in such a process (ForkedMain), without its seconds of imports.

The ranks find each other the way torchrun's do: RANK/LOCAL_RANK/WORLD_SIZE and
MASTER_ADDR/MASTER_PORT in the environment, read by distributed_utils.setup().
"""

import io
import multiprocessing as mp
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace
from multiprocessing.reduction import DupFd
from queue import Empty

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import distributed_utils
import stopping
from session import run

# Where the tests' ranks meet: below the loopback cluster's job ports, and so below the range
# from which the kernel hands out the local ports of outgoing connections (gloo opens many). A
# port the kernel picked from that range, released, could be handed to a connection before
# rank 0 listens on it (EADDRINUSE: seen in a full run).
TEST_PORTS = range(10000, distributed_utils.JOB_PORTS.start)


def free_port() -> int:
    """A port of TEST_PORTS that nothing listens on now, drawn from the system's randomness (a
    test seeding `random` must not make the two workers draw the same)."""
    for port in random.SystemRandom().sample(TEST_PORTS, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


def launcher_variables(rank: int, world_size: int, port: int) -> dict:
    """What torchrun sets for one rank of a one-node world: who it is, where rank 0 listens."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _to_bytes(value) -> bytes:
    # Tensors sent through a queue as-is travel as shared memory that dies with this process.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _outcome(fn, *args) -> tuple[str, object]:
    """('ok', fn's result as bytes) or ('error', what it raised, with its traceback): every
    failure, including a UsageError, for the test to report."""
    try:
        return "ok", _to_bytes(fn(*args))
    except BaseException as e:
        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _plain_group() -> distributed_utils.DistEnv:
    """A CPU rank's group from the variables _worker sets, without distributed_utils.setup: for
    the exercise checks (tests/exercise_checks.py) of the parts that must pass while a student's
    setup() is still a stub. Made by a device mesh, which starts the default group from those
    variables itself (gloo for CPU tensors): this file is in the student's copy, and a call
    that starts the group would show exercise 2.1's answer. It waits as long as torch's default
    (not pg_timeout_s): spawn's own timeout ends a hang first."""
    init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return distributed_utils.DistEnv(rank, rank, world_size, torch.device("cpu"), "gloo")


def _in_process_group(fn, env_args: tuple, pg_timeout_s: float, plain: bool = False):
    env = _plain_group() if plain else distributed_utils.setup(timeout_s=pg_timeout_s)
    try:
        return fn(env, *env_args)
    finally:
        distributed_utils.cleanup()


# How _context's processes start: "forkserver" (the server below), or "fork" for a caller that
# is itself a fresh process holding the modules they need (tests/test_exercise.py's checks_here).
START_METHOD = "forkserver"


def _context():
    """New processes forked from a server that has imported torch and the project once: each
    rank is a fresh process, as with "spawn", without paying the imports (seconds on two
    cores) again; the pipeline's too, which the project imports only for a pipeline. The
    server has run nothing, so no thread, CUDA context or process group is forked with it."""
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload(["dist_harness", "pipeline_utils"])
    return ctx


def _worker(fn, rank, world_size, port, queue, args, pg_timeout_s, share_gpu=False, plain=False):
    distributed_utils.SHARE_ONE_GPU = share_gpu
    os.environ.update(launcher_variables(rank, world_size, port))
    torch.set_num_threads(1)  # as torchrun does: N ranks share 2 cores
    queue.put((rank, *_outcome(_in_process_group, fn, args, pg_timeout_s, plain)))


def spawn(fn, world_size: int, *args, **options) -> list:
    """fn(env, *args) on every rank; returns the results by rank. Raises if any rank fails.
    options: spawn_outcomes's."""
    outcomes = spawn_outcomes(fn, world_size, *args, **options)
    errors = [f"rank {r}: {value}" for r, (status, value) in enumerate(outcomes) if status != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value in outcomes]


def spawn_outcomes(
    fn,
    world_size: int,
    *args,
    timeout: float = 180,
    pg_timeout_s: float = 60,
    share_gpu: bool = False,
    plain: bool = False,
) -> list[tuple[str, object]]:
    """(status, value) for every rank: ('ok', result) or ('error', message). share_gpu: every
    rank on GPU 0, gloo carrying its CUDA tensors (distributed_utils' SHARE_ONE_GPU), for GPU
    tests of more ranks than the machine has GPUs. plain: a gloo group on the CPU made without
    distributed_utils.setup (_plain_group)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, queue, args, pg_timeout_s, share_gpu, plain),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=1)
            except Empty:  # a rank that died says nothing: stop waiting once none is left
                if all(not p.is_alive() for r, p in enumerate(procs) if r not in results):
                    break
                continue
            if status == "ok":
                value = torch.load(io.BytesIO(value), weights_only=False)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # ("died", its exit status) for a rank that ended without a word; None: still running
    return [results.get(r, ("died", procs[r].exitcode)) for r in range(world_size)]


def _alone(fn, queue, args):
    queue.put(_outcome(fn, *args))


def in_fresh_process(fn, *args, timeout: float = 180):
    """fn(*args) in a new process of its own (no process group made for it: fn makes what it
    needs, e.g. torch's fake one, which a process can make only once); returns its result."""
    ctx = _context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_alone, args=(fn, queue, args))
    proc.start()
    try:
        status, value = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise AssertionError(value)
    return torch.load(io.BytesIO(value), weights_only=False)


# ----------------------------------------------------------------------------- main.py, forked


def _as_main_py(argv: list, cwd: str, env: dict, stdout: DupFd, stderr: DupFd) -> None:
    """This new process becomes `python main.py *argv` started in cwd with env: main.py's
    `__main__` block, its exit status this process's, its output on the given pipes."""
    os.dup2(stdout.detach(), 1)
    os.dup2(stderr.detach(), 2)
    # As Python sets them up for a pipe: buffered, unless PYTHONUNBUFFERED asks otherwise.
    buffering = 1 if env.get("PYTHONUNBUFFERED") else -1
    sys.stdout = open(1, "w", buffering=buffering, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(cwd)
    os.environ.clear()  # in place: modules hold os.environ itself (e.g. read_ranks' default)
    os.environ.update(env)
    sys.argv = ["main.py", *argv]
    runpy.run_path("main.py", run_name="__main__")  # ends in sys.exit(status)


class ForkedMain:
    """`python main.py args` as subprocess.Popen runs it (pid, text pipes stdout and stderr,
    returncode, wait, communicate, kill, send_signal), in a process forked from the server of
    _context(), which has imported torch and the project: the run starts at once instead of
    after seconds of imports. Only for the repository's own main.py and variables it reads
    after start-up: a fresh interpreter reads PYTHONPATH, TORCH_LOGS and the like, this one
    has read the server's."""

    def __init__(self, args: list, cwd, env: dict):
        self.args = ["main.py", *map(str, args)]
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        self._process = _context().Process(
            target=_as_main_py,
            args=(self.args[1:], str(cwd), env, DupFd(out_w), DupFd(err_w)),
        )
        self._process.start()
        os.close(out_w)  # the child holds the write ends now: EOF once it (and its own) end
        os.close(err_w)
        self.pid = self._process.pid
        self.stdout = open(out_r, errors="replace")
        self.stderr = open(err_r, errors="replace")
        self._read = {}

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # -N when signal N ended it, as Popen's

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """The rest of stdout and stderr, read together (neither pipe may fill), and the exit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in ("stdout", "stderr"):
            if name not in self._read:
                stream, text = getattr(self, name), []
                reader = threading.Thread(target=lambda s=stream, t=text: t.append(s.read()))
                reader.start()
                self._read[name] = (reader, text)
        for reader, _ in self._read.values():
            reader.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        return tuple("".join(text) for _, text in self._read.values())


# ----------------------------------------------------------------------------- rank functions

# 240 images = 10 global batches of 24, divisible by world sizes 1, 2 and 3. fp32, no
# augmentation (synthetic), so every world size sees exactly the same global batches.
# SGD, not Adam: Adam's step g / (sqrt(v) + eps) turns the last-bit differences of near-zero
# gradients summed in another order into steps of up to +-lr (seen here: 4e-3 after 20 steps).
EQUAL_CFG = dict(
    dataset="synthetic",
    train_samples=240,
    val_samples=60,
    batch_size=24,
    epochs=2,
    print_every=1000,
    seed=7,
    optimizer="sgd",
    lr=0.05,
    checkpoint=False,
)


def steps_cfg(batch: int, steps: int, **fields):
    """A Config of synthetic data, `steps` training batches of `batch` images and one of
    validation, one epoch (unless `fields` say otherwise), no checkpoint, no progress lines."""
    from config import Config

    every = dict(dataset="synthetic", epochs=1, checkpoint=False, print_every=10**9)
    shape = dict(batch_size=batch, train_samples=batch * steps, val_samples=batch)
    return Config(**{**every, **shape, **fields})


def full_state(env, model) -> dict | None:
    """The whole model's parameters, gathered from every rank's shard, on rank 0 (else None).
    Moved to the CPU only from a GPU: FSDP1's gather with cpu_offload of tensors already on the
    CPU kills rank 0 with SIGSEGV (torch 2.9 and 2.10)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=env.device.type == "cuda")
    state = get_model_state_dict(model, options=options)  # every rank must take part
    return {k: v.clone() for k, v in state.items()} if env.rank == 0 else None


def max_diff(a: dict, b: dict) -> float:
    """The largest difference between two state dicts' tensors of the same names (in float64:
    exact for every dtype the runs hold)."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train_and_gather(env, cfg):
    outcome = run(cfg, env)
    return full_state(env, outcome.trainer.model), outcome.history


# The ranks of signal_rank_then_train agree on stops every this many steps (a shorter interval
# than the default, to stop mid-epoch).
TEST_POLL_EVERY = 4


def mid_epoch_stop(steps_per_epoch: int, epoch: int = 2) -> tuple[int, str]:
    """Where to signal so that the ranks stop inside `epoch`, and the checkpoint they then save.

    StopRequest counts one poll per step across epochs, starts an agreement at polls 1,
    1 + every, ... and reads it at the next of them; an epoch's end reads the one in flight. A
    signal at the epoch's first poll joins the first agreement that starts in the epoch, and
    the ranks stop at the step of the agreement after it, if that still falls inside the epoch.
    """
    first = (epoch - 1) * steps_per_epoch + 1
    start = first + (-(first - 1)) % TEST_POLL_EVERY
    read = start + TEST_POLL_EVERY
    assert read < first + steps_per_epoch, f"{steps_per_epoch} steps: no agreement ends inside"
    return first, f"ckpt_e{epoch:04d}_s{read - first:06d}"


def stop_mid_epoch_then_resume(folder, cfg, **spawn_options) -> tuple[str, float]:
    """DDP on two ranks, SIGUSR1 to rank 1 alone at mid_epoch_stop's poll: the checkpoint the
    ranks saved, and the largest difference between the resumed run's parameters and an
    uninterrupted run's."""
    import checkpoint

    straight, _ = spawn(train_and_gather, 2, cfg, **spawn_options)[0]
    saved = replace(cfg, checkpoint=True, checkpoint_dir=str(folder))
    steps = cfg.train_samples // cfg.batch_size
    at_poll, _ = mid_epoch_stop(steps)
    spawn(signal_rank_then_train, 2, saved, at_poll, **spawn_options)
    reached = checkpoint.latest(folder).name
    resumed, _ = spawn(train_and_gather, 2, replace(saved, resume="auto"), **spawn_options)[0]
    return reached, max_diff(straight, resumed)


def signal_rank_then_train(
    env, cfg, at_poll, rank=1, train=train_and_gather, signum=signal.SIGUSR1, every=TEST_POLL_EVERY
):
    """`signum` (SLURM's warning signal) reaches `rank` alone, at its `at_poll`-th training step
    (0: never), while train(env, cfg) runs. The ranks agree on stops every `every` steps."""
    stopping.STOP_POLL_EVERY = every
    if env.rank == rank and at_poll:
        poll, calls = stopping.StopRequest.poll, []

        def poll_and_signal(self):
            calls.append(1)
            if len(calls) == at_poll:
                os.kill(os.getpid(), signum)
            return poll(self)

        stopping.StopRequest.poll = poll_and_signal
    with stopping.catch_stop_signals():  # as main() does
        return train(env, cfg)


def calibration_learner(calibration):
    """The train.Learner whose step a calibration times (inside a GraphedStep where graphed)."""
    step = calibration.step
    return getattr(step, "step", step).__self__


def calibration_of(env, cfg, stand_in_compile=False):
    """The calibration a run of cfg makes (session.calibrate_compute, which build_trainer calls;
    --cuda-graphs is refused on a CPU before it), and the steps its step took once made and
    in one timed round. torch.compile stood in for where asked: the mechanism, not the compiler,
    is what is tested."""
    import data
    import session
    from cuda_graphs import GraphedStep

    if stand_in_compile:
        torch.compile = lambda model: setattr(model, "compiled_here", True) or model
    spec = data.DATASETS[cfg.dataset]
    calibration = session.calibrate_compute(cfg, env, spec, torch.contiguous_format)
    graphed = calibration.step if isinstance(calibration.step, GraphedStep) else None
    made = graphed.eager_steps if graphed else None
    calibration.timed_round()
    learner = calibration_learner(calibration)
    return {
        "graphed": graphed is not None,
        "captured": graphed is not None and graphed.graph is not None,
        "made": made,
        "timed": graphed.eager_steps - made if graphed else None,
        "compiled": getattr(learner.model, "compiled_here", False),
        "autocast_cache": learner.precision.cache,
        "capturable": learner.optimizer.defaults.get("capturable"),
    }
