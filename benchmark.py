"""Where does the time go? One run on the machine at hand prints a table of:

1. the input pipeline alone: images/s of the tensor path vs the classic DataLoader path;
2. the training loop at world size 1 vs a bare loop (same model, batch, optimizer, threads,
   preloaded tensors, no wrapper, no metrics);
3. the share of step time spent waiting for data (tensor path);
4. the scaling study's floor: one rank's step at the local batch each rank gets in the
   default strong-scaling sweep (global batch / N), eager and, on a GPU, as one CUDA graph, the
   operations torch dispatches per step, and the epoch time that implies: the best each sweep
   point can do before any communication;
5. each strategy of the study on one rank: operations per step, and its step at local batch
   256 and 32, eager and, where it can be captured (feasibility.graph_refusal), as one CUDA graph;
6. DDP and FSDP at world sizes 1, 2 and 4 (1 and 2 on a CPU), launched by torchrun as users
   do: images/s and scaling efficiency.

Every number comes from the project's own code paths (data.py, train.py, session.py), so a
regression in them shows here. Warm-up (first batches, first epoch) is never timed.

    python benchmark.py            # a few minutes on a 2-core CPU
    python benchmark.py --quick    # smaller, for a smoke run
    torchrun --nproc_per_node=2 benchmark.py --comm   # only the collectives ([COMM] lines)
"""

import argparse
import collections
import contextlib
import dataclasses
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import data
import distributed_utils
import feasibility
from checkpoint_files import Position
from comm_bench import run_comm_benchmark
from config import SWEEP_GPUS, Config
from layout import REPO
from measure import synchronize
from model import build_model
from optim import make_optimizer
from session import build_trainer
from utils import last_line, parse_metric

SPEC = data.DATASETS["cifar10"]  # CIFAR-10's statistics and its default augmentation


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"CPU {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; "
        f"GPU {gpu}; torch {torch.__version__}; {datetime.date.today()}"
    )


@contextlib.contextmanager
def process_group():
    """This process's distributed environment (a world of one, unless launched), ended after."""
    env = distributed_utils.setup()
    try:
        yield env
    finally:
        distributed_utils.cleanup()


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def input_pipeline(
    kind: str, batch: int, steps: int, workers: int, device: torch.device, rounds: int = 5
) -> float:
    """Images/s of one rank's training batches, augmented and on the device, nothing else: the
    median over `rounds` epochs (one lasts under a second; a shared machine's speed drifts)."""
    train, val = data.make_synthetic(batch * steps, batch, seed=0)
    loaders = data.build_loaders(
        train,
        val,
        SPEC,
        kind=kind,
        rank=0,
        world_size=1,
        global_batch=batch,
        seed=0,
        augment=True,
        device=device,
        num_workers=workers,
    )
    for _ in loaders.train:  # warm-up epoch: worker start-up, first allocations
        pass

    def one_epoch():
        for _ in loaders.train:  # each batch dropped at once, as a training step would
            pass

    rates = []
    for epoch in range(1, rounds + 1):
        loaders.set_position(epoch)
        rates.append(batch * steps / timed(one_epoch, device))
    return statistics.median(rates)


class OperationCounter(TorchDispatchMode):
    """Counts the operations torch dispatches while it is active, by name (aten.mul), or
    by_overload (aten.mul.out apart from aten.mul.Tensor)."""

    def __init__(self, by_overload: bool = False):
        super().__init__()
        self.by_overload = by_overload
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func if self.by_overload else func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def counted_epoch(trainer, position: Position) -> collections.Counter:
    """The operations of one training epoch (from `position`), by name."""
    with OperationCounter() as counter:
        trainer.train_epoch(position)
    return counter.counts


def operations_per_step(trainer, epoch: int = 2, steps: int = 10) -> collections.Counter:
    """The operations one more training step costs: a whole epoch less one trained from `steps`
    before its end, per step, so that what an epoch does once cancels out."""
    total = len(trainer.loaders.train)
    assert total > steps, (total, steps)
    counted = [counted_epoch(trainer, Position(epoch, first)) for first in (total - steps, 0)]
    more = counted[1] - counted[0]  # only the positive differences: every op is per step
    return collections.Counter({op: n / (total - steps) for op, n in more.items()})


def operations_per_epoch_step(trainer, epoch: int = 2) -> float:
    """A whole epoch's operations over its steps: the step's and, shared out, the epoch's own
    (what issue 35 counted to compare the strategies, whose per-epoch work differs)."""
    return sum(counted_epoch(trainer, Position(epoch)).values()) / len(trainer.loaders.train)


def one_rank_config(batch: int, steps: int) -> Config:
    """The training one rank of this benchmark times: `steps` steps of `batch` synthetic images
    with crop and flip, no checkpoints, no progress lines."""
    return Config(
        dataset="synthetic",
        train_samples=batch * steps,
        val_samples=batch,
        batch_size=batch,
        epochs=1,
        checkpoint=False,
        augment=True,
        print_every=10**9,
        cuda_graphs=False,  # eager: graphed_seconds asks for the graph by name
    )


def bare_loop(model, optimizer, batches) -> None:
    # exercise 6.1 twin begin
    for images, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    # exercise 6.1 twin end


def loop_vs_bare(batch: int, steps: int, device: torch.device, rounds: int = 7) -> dict:
    """The project's epoch (DDP wrapper, loader, metrics) against the same work done bare, the
    two alternating: the median of the rounds' ratios (a shared machine's speed drifts)."""
    cfg = one_rank_config(batch, steps)
    with process_group() as env:
        trainer, _ = build_trainer(cfg, env)
        torch.manual_seed(0)
        bare = build_model(cfg.model).to(device)
        bare_opt = make_optimizer(cfg, bare)
        preloaded = list(trainer.loaders.train)
        ours, theirs, wait = [], [], []
        for epoch in range(1, rounds + 2):  # the first round is warm-up
            result, _, _ = trainer.train_epoch(Position(epoch))
            t_bare = timed(lambda: bare_loop(bare, bare_opt, preloaded), device)
            if epoch > 1:
                ours.append(result.time)
                wait.append(result.data_wait / result.time)
                theirs.append(t_bare)
    images = batch * steps
    return {
        "loop": images / statistics.median(ours),
        "bare": images / statistics.median(theirs),
        "ratio": statistics.median(b / o for o, b in zip(ours, theirs)),
        "data_wait_share": statistics.median(wait),
    }


def seconds_per_step(cfg: Config, env, rounds: int = 3) -> tuple[float, dict]:
    """One rank's training step at cfg's batch, alone (world size 1): the median over `rounds`
    epochs after a warm-up epoch (which holds a graph's capture), and, eager only (a graph's
    replay dispatches none), the operations it dispatches: "step" (operations_per_step) and
    "epoch" (operations_per_epoch_step)."""
    trainer, _ = build_trainer(cfg, env)
    steps = len(trainer.loaders.train)
    operations = {"step": math.nan, "epoch": math.nan}
    if not cfg.cuda_graphs:
        operations["step"] = sum(operations_per_step(trainer, steps=steps // 2).values())
        operations["epoch"] = operations_per_epoch_step(trainer)
    trainer.train_epoch(Position(1))
    times = [trainer.train_epoch(Position(epoch))[0].time for epoch in range(2, rounds + 2)]
    return statistics.median(times) / steps, operations


def step_and_epoch(seconds: float | str, epoch_steps: int) -> tuple[str, str]:
    """A step's ms and the seconds of the epoch it implies; or, twice, why it was not timed."""
    epoch = seconds if isinstance(seconds, str) else f"{seconds * epoch_steps:.2f}"
    return in_ms(seconds), epoch


def in_ms(seconds: float | str) -> str:
    """A step's time in ms, or why it was not timed."""
    return seconds if isinstance(seconds, str) else f"{1000 * seconds:.2f}"


def sweep_floor(global_batch: int, steps: int, device: torch.device) -> list[tuple]:
    """Rows of the floor table: per GPU count N of the sweep, the local batch global_batch / N,
    its operations and step time, eager and (on a GPU) graphed, and the CIFAR-10 epoch time
    those steps imply."""
    epoch_steps = SPEC.train_size // global_batch  # strong scaling: the same at every N
    rows = [
        (
            "GPUs",
            "local batch",
            "operations per step",
            "step, eager (ms)",
            "epoch, eager (s)",
            "step, CUDA graph (ms)",
            "epoch, CUDA graph (s)",
        )
    ]
    with process_group() as env:
        for n in SWEEP_GPUS:
            local = global_batch // n
            cfg = one_rank_config(local, steps)
            eager, operations = seconds_per_step(cfg, env)
            graphed = graphed_seconds(cfg, env, device)
            rows.append(
                (
                    n,
                    local,
                    f"{operations['step']:.0f}",
                    *step_and_epoch(eager, epoch_steps),
                    *step_and_epoch(graphed, epoch_steps),
                )
            )
    return rows


# The strategies of the scaling study, each timed alone by strategy_steps.
STEP_STRATEGIES = ("single", "ddp", "fsdp", "fsdp2")
# The most operations per step (operations_per_epoch_step) each FSDP may dispatch, in DDP's:
# issue 35's budgets, which tests/test_step_cost.py holds them to (per-block units: 2.6x, 2.1x).
OPERATIONS_AGAINST_DDP = {"fsdp": 2.0, "fsdp2": 1.5}
SMALL_BATCH = 32  # the local batch of the sweep's 8-GPU point at the default global batch


def strategy_steps(batch: int, steps: int, device: torch.device) -> list[tuple]:
    """Rows of the per-strategy table: one rank's operations per step at `batch`
    (operations_per_epoch_step), and its step at `batch` and SMALL_BATCH, eager and graphed."""
    local_batches = (batch, SMALL_BATCH)
    rows = [
        (
            "strategy",
            "operations per step",
            *(f"step at {n}, eager (ms)" for n in local_batches),
            *(f"step at {n}, CUDA graph (ms)" for n in local_batches),
        )
    ]
    with process_group() as env:
        for strategy in STEP_STRATEGIES:
            eager, graphed = [], []
            for local in local_batches:
                cfg = dataclasses.replace(one_rank_config(local, steps), strategy=strategy)
                seconds, operations = seconds_per_step(cfg, env)
                eager.append(in_ms(seconds))
                graphed.append(in_ms(graphed_seconds(cfg, env, device)))
                if local == batch:
                    counted = f"{operations['epoch']:.0f}"
            rows.append((strategy, counted, *eager, *graphed))
    return rows


def graphed_seconds(cfg: Config, env, device: torch.device) -> float | str:
    """The step of cfg as one CUDA graph, in seconds, or why it is not measured."""
    if device.type != "cuda":
        return "no GPU"
    if feasibility.graph_refusal(cfg, device):
        return "eager only"
    try:
        return seconds_per_step(dataclasses.replace(cfg, cuda_graphs=True), env)[0]
    except RuntimeError as e:  # a first capture (FSDP2's) that torch rejects: the cell says so
        return f"capture failed: {last_line(str(e))[:80]}"


def scaling_run(
    strategy: str, world_size: int, batch: int, samples: int, epochs: int, extra: tuple = ()
) -> dict:
    """main.py under torchrun; the last epoch's [METRIC] line (earlier ones carry warm-up)."""
    options = {
        "strategy": strategy,
        "dataset": "synthetic",
        "train-samples": samples,
        "val-samples": 1024,
        "batch-size": batch,
        "epochs": epochs,
        "print-every": 10**9,
    }
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launch, f"--nproc_per_node={world_size}", str(REPO / "main.py")]
    cmd += [word for option, value in options.items() for word in (f"--{option}", str(value))]
    cmd += ["--no-checkpoint", "--augment", *extra]  # crop and flip, as CIFAR-10 runs do
    # One thread per rank at every world size, so efficiency compares like with like.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    metrics = [m for m in map(parse_metric, result.stdout.splitlines()) if m]
    if result.returncode or not metrics:
        sys.exit(f"error: {strategy} at world size {world_size} failed:\n{result.stderr[-2000:]}")
    return metrics[-1]


def rest_share(metric: dict) -> str:
    """The epoch's share beyond compute and data (t_comm + t_other), or why there is none."""
    if metric.get("breakdown") == "unreliable":
        return "unreliable"
    return f"{100 * (metric['t_comm'] + metric['t_other']) / metric['time']:.1f}%"


def table(rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def comm_only() -> None:
    """--comm: [COMM] lines of main.py's default model (comm_bench.py), the device chosen as a
    training run would."""
    with process_group() as env:
        with torch.device("meta"):  # sizes only: no weights, no random numbers drawn
            model = build_model(Config.model, SPEC.num_classes, SPEC.image_shape)
        run_comm_benchmark(model, env.device, Config.precision, Config.strategy)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and samples")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers, classic path")
    p.add_argument(
        "--comm",
        action="store_true",
        help="only the collective micro-benchmark of the CIFAR-10 CNN's messages, "
        "at the launcher's world size (torchrun --nproc_per_node=N)",
    )
    args = p.parse_args(argv)
    if args.comm:
        return comm_only()
    device = distributed_utils.pick_device(0)[0]
    gpu = device.type == "cuda"
    b = args.batch_size
    steps = 10 if args.quick else 40
    # One GPU per rank (two ranks on one GPU are refused); on the CPU, two ranks share it.
    world_sizes = [n for n in (1, 2, 4) if n <= torch.cuda.device_count()] if gpu else [1, 2]
    samples = 4 * b * max(world_sizes) if args.quick else (50_000 if gpu else 16 * b * 4)

    print(f"# benchmark.py: {machine()}\n", flush=True)
    tensor = input_pipeline("tensor", b, steps * 4, args.workers, device)
    classic = input_pipeline("classic", b, steps, args.workers, device)
    loop = loop_vs_bare(b, steps, device)
    floor = sweep_floor(b, steps // 2, device)  # its first row: world size 1 at batch b
    rows = [
        ("measure", "value", "target"),
        ("input pipeline, tensor path (images/s)", f"{tensor:,.0f}", ""),
        (f"input pipeline, classic path, {args.workers} workers (images/s)", f"{classic:,.0f}", ""),
        ("tensor / classic", f"{tensor / classic:.1f}x", ">= 10x"),
        ("training loop, world size 1 (images/s)", f"{loop['loop']:,.0f}", ""),
        ("bare loop (images/s)", f"{loop['bare']:,.0f}", ""),
        ("training loop / bare loop (median of rounds)", f"{loop['ratio']:.2f}", ">= 0.95"),
        ("data wait, share of step time", f"{100 * loop['data_wait_share']:.1f}%", "<= 5%"),
        ("operations per training step (DDP, world size 1)", floor[1][2], "<= 100"),
    ]
    print(table(rows) + "\n", flush=True)

    print(
        f"The sweep's floor: one rank's step at the local batch of each GPU count N (global "
        f"batch {b}, strong scaling), and the epoch of {SPEC.train_size:,} images "
        f"({SPEC.train_size // b} steps) it implies, before any communication:\n"
    )
    print(table(floor), flush=True)
    smallest, largest = floor[-1], floor[1]
    print(
        f"\nStep at local batch {smallest[1]} / step at {largest[1]}: "
        f"{float(smallest[3]) / float(largest[3]):.2f} eager (target <= 0.5: room for the "
        f"{smallest[0]}-GPU point to scale)\n",
        flush=True,
    )

    per_strategy = strategy_steps(b, steps // 2, device)
    print(
        "Each strategy of the study on one rank (world size 1): the operations torch "
        f"dispatches per step at batch {b} (an epoch's, the epoch's own work shared out), and "
        f"the step at local batch {b} and {SMALL_BATCH}:\n"
    )
    print(table(per_strategy))
    operations = {row[0]: float(row[1]) for row in per_strategy[1:]}
    ratios = ", ".join(
        f"{strategy} {operations[strategy] / operations['ddp']:.2f}x (target <= {most}x)"
        for strategy, most in OPERATIONS_AGAINST_DDP.items()
    )
    print(f"\nOperations per step against DDP's: {ratios}\n", flush=True)

    rows = [
        (
            "strategy",
            "ranks",
            "images/s",
            "epoch time (s)",
            "efficiency",
            "peak mem (MB)",
            "t_comm + t_other, share of the epoch",
        )
    ]
    for strategy in ("ddp", "fsdp"):
        base = None
        for n in world_sizes:
            m = scaling_run(strategy, n, b, samples, epochs=2)
            base = base or m["throughput"]
            rows.append(
                (
                    strategy,
                    n,
                    f"{m['throughput']:,.0f}",
                    f"{m['time']:.2f}",
                    f"{100 * m['throughput'] / (n * base):.0f}%",
                    m["peak_mem"],
                    rest_share(m),
                )
            )
    print(
        f"Scaling: global batch {b}, {samples:,} synthetic images with crop and flip, one "
        f"{'GPU' if gpu else 'CPU thread'} per rank, second epoch"
        f"{' (ddp graphed, the default on a GPU; fsdp eager)' if gpu else ''}:\n"
    )
    print(table(rows))
    print(
        "\nAt 1 rank nothing is sent: t_comm is 0, and the rest is t_other, what the step's "
        "model does not explain (the wrapper's own work, the breakdown's error; target <= 5%)."
    )
    if gpu:
        eager = scaling_run("ddp", 1, b, samples, epochs=2, extra=("--no-cuda-graphs",))
        print(
            f"\nOne epoch of {samples:,} images at global batch {b} on one GPU: "
            f"{eager['time']:.2f} s eager (target < 0.3 s; the course measured about 7 s), "
            f"{rows[1][3]} s with --cuda-graphs, the default (target <= 0.25 s)."
        )
    else:
        print("\nNo GPU here: the one-GPU epoch-time target (< 0.3 s) was not measured.")


if __name__ == "__main__":
    main()
