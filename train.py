"""Train and evaluate one data-parallel replica; every number reported is a global one.

`Trainer.fit` is the whole loop: epochs of training and validation, one `[METRIC]` line each,
a checkpoint after each, and an early stop (with a checkpoint) when SLURM warns. Each rank runs
the same loop on its own shard. Nothing in the hot loop waits on the device:
losses and counts accumulate as device tensors and are all-reduced (summed) once per epoch, so
loss and accuracy are those of the whole data set, not of rank 0's shard. Epoch time is taken
between two barriers around the training part only (validation is timed on its own), peak memory
is the maximum over ranks, and throughput counts the images of all ranks.
"""

import contextlib
import ctypes
import functools
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from checkpoint import Position
from config import Config
from cuda_graphs import WARMUP_STEPS, GraphedStep
from data import Loaders, validation_weights
from distributed_utils import DistEnv, barrier, say_where
from mfu import UNKNOWN, ModelFlops, implausible
from stopping import STOP_POLL_EVERY, StopRequest
from utils import format_metric, is_rank_zero, log0, metric_order


@dataclass
class Precision:
    """How a step runs in low precision: autocast (DDP), and a loss scaler enabled for fp16."""

    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler
    cache: bool = True  # autocast's cache of cast weights (off in a CUDA graph)

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype, cache_enabled=self.cache)


def set_fp32_math(precision: str) -> str:
    """GPUs compute fp32 convolutions in TF32 unless told otherwise (cuDNN's default): make
    fp32 mean IEEE fp32, and tf32 ask for TF32 in convolutions and matrix products alike.
    Returns what fp32 operations run as. (No effect on a CPU.)"""
    math = "tf32" if precision == "tf32" else "ieee"
    # The legacy switches first, to the same answer: code that still reads them (torch.compile's
    # in some versions) raises where only the per-operation settings below were made.
    torch.set_float32_matmul_precision("high" if math == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = math == "tf32"
    torch.backends.cuda.matmul.fp32_precision = math
    torch.backends.cudnn.conv.fp32_precision = math
    torch.backends.cudnn.rnn.fp32_precision = math
    return math


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels only (an error names any op that has none); cuBLAS needs its
    workspace fixed before CUDA starts for that."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # cuDNN tries its algorithms on the first batch of each shape and keeps the fastest: the
    # fastest may not be deterministic.
    torch.backends.cudnn.benchmark = not enabled
    torch.use_deterministic_algorithms(enabled)


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """--optimizer: Adam, or SGD with momentum 0.9. Fused (one kernel for every parameter) where
    torch has it for the parameters, else foreach (one per operation over all of them): torch's
    default on a CPU is a loop of about ten operations per parameter and step. FSDP2's DTensor
    parameters have sharding rules for fused Adam (since torch 2.4), not for fused SGD."""
    optimizer, options = (
        (torch.optim.SGD, {"momentum": 0.9}) if cfg.optimizer == "sgd" else (torch.optim.Adam, {})
    )
    params = list(model.parameters())
    lr = cfg.lr
    if cfg.cuda_graphs:
        if optimizer is torch.optim.Adam:
            options["capturable"] = True  # its step count on the device, advanced by the graph
        if cfg.lr_schedule != "none" or cfg.warmup_epochs:
            # A tensor the graph reads, which the scheduler fills between replays (a float
            # would be baked into the graph at its capture).
            lr = torch.tensor(cfg.lr, device=params[0].device)
    if optimizer is torch.optim.Adam or not any(isinstance(p, DTensor) for p in params):
        try:
            return optimizer(params, lr=lr, fused=True, **options)
        except RuntimeError:  # parameters on a device without fused kernels
            pass
    return optimizer(params, lr=lr, foreach=True, **options)


def make_scheduler(
    cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The learning rate per optimizer step: linear warm-up, then constant, step or cosine."""
    if cfg.lr_schedule == "none" and not cfg.warmup_epochs:
        return None
    warmup, total = cfg.warmup_epochs * steps_per_epoch, cfg.epochs * steps_per_epoch
    milestones = [int(total * 0.5), int(total * 0.75)]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "step":
            return 0.1 ** sum(step >= m for m in milestones)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def loss_input(logits: torch.Tensor) -> torch.Tensor:
    """Logits computed in bf16 or fp16, in fp32 for the loss; fp32's and fp64's as they are."""
    return logits.float() if logits.dtype.itemsize < 4 else logits


def synchronize_device(device: torch.device) -> None:
    """Wait until this rank's queued device work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronize(device: torch.device) -> None:
    """Wait until this rank's queued device work is done, then for every other rank."""
    synchronize_device(device)
    barrier()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        # Blocks the allocator kept from the calibration and validation would otherwise start
        # the epoch's reserved peak.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        # Linux: writing 5 to clear_refs resets the process's peak resident set (VmHWM).
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _process_memory_bytes(field: str) -> int | None:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, from /proc."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        if match:
            return int(match.group(1)) * 1024
    return None


def current_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _process_memory_bytes("VmRSS") or 0


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak since reset_peak_memory: CUDA allocator peak, or peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = _process_memory_bytes("VmHWM")
    if peak is None:
        import resource  # no /proc: lifetime peak instead of per-epoch

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def reserved_peak_bytes(device: torch.device) -> int:
    """What the process really took at its peak: the CUDA caching allocator's reserved peak
    (allocations plus its cache), or on CPU the peak resident set, libraries included."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    return peak_memory_bytes(device)


def release_free_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim). Memory freed
    before the baseline (e.g. the temporaries of decoding or generating the data set) would
    otherwise stay resident, inflate the baseline, and be reused by training unseen: the
    training peak would then vary by tens of MB from run to run."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class MemoryMeter:
    """Training memory: the peak above a baseline taken once the data set is resident on the
    device and before the model exists. It counts the model, its gradients, optimizer state,
    activations and batches, not the data set (reported on its own) nor, on CPU, torch's own
    libraries: so it compares with a run that keeps its data on the host, as the course's does,
    and it means the same on a GPU and on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            release_free_heap()
        self.baseline = current_memory_bytes(device)

    def reset(self) -> None:
        reset_peak_memory(self.device)

    def training_peak(self, at_least: int = 0) -> int:
        """Since reset(), above the baseline; at_least: a peak the allocator did not see."""
        return max(0, max(peak_memory_bytes(self.device), at_least) - self.baseline)


class StageTimer:
    """Seconds spent in one stage of every step (fetching the next batch), over an epoch.

    On CUDA a call returns once the stage's kernels are queued, so the wall clock would see only
    their launch: events recorded on the stream around the stage measure the device's time
    (including any wait for the host), and are read once, when the epoch has synchronized. On
    the CPU the work is done when the call returns: the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs = []  # CUDA events, made once and recorded again every epoch
        self.reset()

    def reset(self) -> None:
        """A new epoch."""
        self.seconds, self.used = 0.0, 0

    @contextlib.contextmanager
    def measure(self):
        if self.cuda:
            if self.used == len(self.pairs):
                self.pairs.append(tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)))
            start, end = self.pairs[self.used]
            self.used += 1
            start.record()
            yield
            end.record()
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0

    def total(self) -> float:
        """Call after the device has synchronized."""
        return self.seconds + sum(s.elapsed_time(e) for s, e in self.pairs[: self.used]) / 1000


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Exact bytes of parameters, gradients and optimizer state held by this rank.

    Under FSDP, model.parameters() are this rank's shards (FSDP1: views of its flat shard;
    FSDP2: DTensors, whose local part is counted), so this shrinks with sharding.
    """
    tensors = list(model.parameters())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def all_reduce(
    values: list[float | torch.Tensor], device: torch.device, op=dist.ReduceOp.SUM
) -> list[float]:
    """Reduce several scalars over ranks in one collective; returns Python floats."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


class Progress:
    """Rank 0's progress: a redrawn bar on a terminal, a line every `every` steps in a log."""

    def __init__(self, epoch: int, steps: int, every: int, enabled: bool, first_step: int = 0):
        self.epoch, self.steps, self.every, self.enabled = epoch, steps, every, enabled
        self.first_step = first_step  # a resumed epoch starts part-way
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, mean_loss_sum: torch.Tensor) -> None:
        """After `step`; mean_loss_sum adds up the steps' mean losses since first_step."""
        done = step + 1
        if not self.enabled or (done % self.every and done != self.steps):
            return
        ms = 1000 * (time.perf_counter() - self.start) / (done - self.first_step)
        # .item() waits for the device: paid once every `every` steps, not every step.
        loss = mean_loss_sum.item() / (done - self.first_step)
        text = f"epoch {self.epoch} step {done:>5}/{self.steps} loss {loss:.4f} {ms:.1f} ms/step"
        if self.tty:
            bar = "#" * (30 * done // self.steps)
            print(f"\r[{bar:<30}] {text}", end="\n" if done == self.steps else "", flush=True)
        else:
            print(text, flush=True)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Reduce gradients over the ranks in this backward, or only accumulate them locally (all
    micro-batches but the last): DDP's and FSDP1's `no_sync`, FSDP2's own switch."""
    root = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(root, FSDPModule):
        root.set_requires_gradient_sync(enabled)
        yield
    elif not enabled and hasattr(root, "no_sync"):
        with root.no_sync():
            yield
    else:
        yield


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their norm over all ranks and shards is at most max_norm.
    FSDP1's flat shards need its own method; DDP's gradients are whole and equal on every
    rank, and FSDP2's are DTensors whose norm torch's function already takes over all shards."""
    root = getattr(model, "_orig_mod", model)
    if isinstance(root, FSDP):
        return root.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


@dataclass
class Segment:
    """What this rank did in the part of an epoch this process trained (the whole epoch unless
    it resumed mid-way): the part's wall time (its slowest rank's), this rank's own time
    fetching batches, and its steps."""

    elapsed: float
    data: float
    steps: int


def every_rank(value: float, device: torch.device) -> list[float]:
    """Each rank's value, in rank order, on every rank (one all-reduce of a vector)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return all_reduce([value if r == rank else 0.0 for r in range(world)], device)


def time_breakdown(segment: Segment, step_seconds: float, device: torch.device) -> dict:
    """Where the epoch's time went, in seconds, each the mean over ranks, none negative; they add
    up to the segment's time by construction:

    t_compute  the steps' forward, backward and optimizer work as one process does it on this
               rank's local batch (ComputeCalibration: step_seconds x steps)
    t_data     fetching batches (the data_wait of this rank)
    t_wait     waiting for the slowest rank: the busiest rank's compute + data, minus this
               rank's own
    t_comm     the rest: the epoch's time beyond its busiest rank's compute and data, that is
               communication and the wrapper's work not hidden behind compute (the same on
               every rank: every rank takes the slowest one's time)

    Where the rest comes out below zero, the calibration took the steps for longer than the
    epoch did: how the epoch split between compute and communication is then unknown, and
    both are `na`, with breakdown=unreliable (never a negative time, nor one clamped to 0).
    Also the straggler: which rank was the busiest (slowest_rank), and by how many seconds the
    busiest and the least busy differ (rank_time_spread).
    """
    compute, data = step_seconds * segment.steps, segment.data
    busy = every_rank(compute + data, device)
    slowest = max(busy)
    rest = segment.elapsed - slowest
    means = [v / len(busy) for v in all_reduce([compute, data, slowest - (compute + data)], device)]
    reliable = rest >= 0
    return {
        "t_compute": means[0] if reliable else UNKNOWN,
        "t_data": means[1],
        "t_comm": rest if reliable else UNKNOWN,
        "t_wait": means[2],
        "breakdown": "ok" if reliable else "unreliable",
        "slowest_rank": busy.index(slowest),
        "rank_time_spread": slowest - min(busy),
    }


class Diverged(Exception):
    """The training loss became NaN or infinite: every further step is wasted."""


# --profile traces these steps of the first epoch trained: the first is skipped (it carries
# one-off work), the next warm the profiler up, the last are recorded. A graphed run's eager
# warm-up steps and its capture are skipped too, so that the trace holds the graph's replays.
PROFILE_SCHEDULE = {"wait": 1, "warmup": 2, "active": 3}
# kineto's level that keeps its own lines off stderr (5 would still print its USDT markers).
KINETO_QUIET = "6"


class StepProfiler:
    """--profile: torch.profiler over a few training steps of this rank, saved as a Chrome
    trace (open it in https://ui.perfetto.dev): operator by operator and, on a GPU, kernel by
    kernel, with the collectives and whether they overlap compute."""

    def __init__(self, path: Path, device: torch.device, graphed: bool = False):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:
            # Without a GPU kineto reports at every trace that it found none ("ERROR: ...
            # gpuGetDeviceCount failed"), and its start and stop: noise, not the user's error.
            os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
        self.path, self.saved, self.graphed = path, False, graphed
        self.schedule = {
            **PROFILE_SCHEDULE,
            "wait": PROFILE_SCHEDULE["wait"] + (WARMUP_STEPS + 1 if graphed else 0),
        }
        self.profiler = torch.profiler.profile(
            activities=activities,
            on_trace_ready=self.save,
            schedule=torch.profiler.schedule(**self.schedule, repeat=1),
        )

    @property
    def traced_steps(self) -> range:
        """The steps of the first epoch trained that the trace holds (1 = the first)."""
        last = sum(self.schedule.values())
        return range(last - self.schedule["active"] + 1, last + 1)

    def save(self, profiler: torch.profiler.profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        self.saved = True


@dataclass(kw_only=True)
class Trainer:
    """One rank's part of a training run, and the loop that trains it. Built with keywords; a
    bare trainer (ComputeCalibration's) has only what `step` needs: no loaders, labels, meter."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    env: DistEnv
    loaders: Loaders | None = None
    labels: dict = field(default_factory=dict)  # the [METRIC] line's fields that are not measured
    print_every: int = 50
    memory: MemoryMeter | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    grad_accum: int = 1
    clip_grad: float | None = None
    calibration: "ComputeCalibration | None" = None  # for t_compute (see time_breakdown)
    profiler: StepProfiler | None = None
    flops: ModelFlops | None = None  # for tflops and mfu
    cuda_graphs: bool = False  # train_step as one CUDA graph (cuda_graphs.py)
    step_collectives: str = "the step's collectives"  # strategies.STEP_COLLECTIVES, for say_where
    # Whether this rank's images and losses count in the global sums: a pipeline's stages all
    # take the same batch, and only its last stage computes the loss.
    reports_sums: bool = True

    @property
    def shows_progress(self) -> bool:
        """Whether this rank prints the progress lines: one that knows the loss."""
        return is_rank_zero()

    @property
    def data_ranks(self) -> tuple[int, int]:
        """(rank, world size) of the data's shards: one per rank, in data parallelism."""
        return self.env.rank, self.env.world_size

    @functools.cached_property
    def loss_sum(self) -> torch.Tensor:
        """Where the steps add their mean losses: one tensor for the whole run (zeroed every
        epoch), so that a CUDA graph of the step adds to the same memory every time."""
        return torch.zeros((), device=self.env.device)

    @functools.cached_property
    def train_step(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """What trains one batch: `step`, or `step` captured as a CUDA graph."""
        if not self.cuda_graphs:
            return self.step
        # A graph records GPU kernels: elsewhere (a CPU test) the static-buffer step alone.
        return GraphedStep(self.step, self.env.device, capture=self.env.device.type == "cuda")

    @functools.cached_property
    def data_timer(self) -> StageTimer:
        """data_wait's timer: one per trainer, its CUDA events made once."""
        return StageTimer(self.env.device)

    def fit(
        self, start: Position, epochs: int, stop: StopRequest, save: Callable[[Position], None]
    ) -> tuple[list[dict], Position | None]:
        """Epochs from `start` to `epochs`, each saved when done. Returns the `[METRIC]` fields
        of the epochs finished and, if a stop was agreed, the position saved (else None).
        Raises Diverged, saving nothing, after an epoch whose training loss is not finite."""
        with self.profiler.profiler if self.profiler else contextlib.nullcontext():
            return self._fit(start, epochs, stop, save)

    def _fit(
        self, start: Position, epochs: int, stop: StopRequest, save: Callable[[Position], None]
    ) -> tuple[list[dict], Position | None]:
        history, position = [], start
        while position.epoch <= epochs:
            reached, measured = self.run_epoch(position, stop)
            stopping = stop.drain()  # the same answer on every rank
            if measured is None:  # a stop came mid-epoch: keep what this epoch has done
                save(reached)
                return history, reached
            if not math.isfinite(measured["train_loss"]):  # the same on every rank: all-reduced
                raise Diverged(
                    f"epoch {reached.epoch}: the training loss is {measured['train_loss']}"
                )
            history.append(metric_order({**measured, **self.labels}))
            log0(format_metric(history[-1]))
            if warning := implausible(history[-1]):
                log0(warning)
            position = Position(epoch=position.epoch + 1)
            save(position)
            if stopping and position.epoch <= epochs:
                return history, position
        return history, None

    def run_epoch(
        self, start: Position, stop: StopRequest | None = None
    ) -> tuple[Position, dict | None]:
        """Train (from `start`) and validate one epoch: the measurements of its `[METRIC]` line.

        Returns the position reached and the measurements, or None for them if a stop came
        mid-epoch.
        """
        device = self.env.device
        self.memory.reset()
        replay_peak = self.replay_peak()
        reached, complete, segment = self.train_epoch(start, stop)
        if not complete:
            return reached, None
        # Read before the calibration and validation run: their memory is not training's (the
        # calibration's unsharded model would otherwise hide FSDP's saving).
        own_peak, own_reserved = self.memory.training_peak(replay_peak), reserved_peak_bytes(device)
        breakdown = time_breakdown(segment, self.compute_seconds_per_step(segment.elapsed), device)
        val = self.evaluate()
        peak, state, reserved = all_reduce(
            [own_peak, state_bytes(self.model, self.optimizer), own_reserved],
            device,
            dist.ReduceOp.MAX,
        )
        train_loss = reached.loss_sum / max(reached.seen, 1)
        throughput = reached.seen / reached.time
        return reached, {
            "epoch": reached.epoch,
            "time": reached.time,
            "val_loss": val["val_loss"],
            "acc": val["acc"],
            "peak_mem": round(peak / 2**20),
            "train_loss": train_loss,
            "val_time": val["val_time"],
            "throughput": throughput,
            "data_wait": reached.data_wait,
            "state_mem": int(state),
            "data_mem": round(self.loaders.device_bytes() / 2**20),
            "reserved_mem": round(reserved / 2**20),
            **breakdown,
            **(self.flops.fields(throughput) if self.flops else {}),
            **self.strategy_fields(),
        }

    def replay_peak(self) -> int:
        """The least peak of an epoch whose every step replays a captured graph: the capture's,
        which each replay holds again where the allocator no longer sees it (an epoch that
        captures sees it while capturing). So peak_mem means the same graphed as eager."""
        step = self.train_step
        return step.replay_peak if isinstance(step, GraphedStep) and step.graph else 0

    def compute_seconds_per_step(self, epoch_seconds: float) -> float:
        """One step's compute on this rank, for t_compute (time_breakdown)."""
        return self.calibration.seconds_per_step(epoch_seconds) if self.calibration else 0.0

    def strategy_fields(self) -> dict:
        """The pipeline's measurements (pipeline_utils.PipelineTrainer): no bubble here."""
        return {"bubble": UNKNOWN, "bubble_ideal": UNKNOWN}

    def train_epoch(
        self, start: Position, stop: StopRequest | None = None
    ) -> tuple[Position, bool, Segment]:
        """Train from `start` until the epoch ends or a stop is agreed.

        Returns the position reached, its sums global (all ranks) and including `start`'s,
        whether the epoch is complete, and this rank's own timing of what it trained.
        """
        # exercise 6.1 begin
        self.model.train()
        # exercise 6.1 end
        device = self.env.device
        mean_loss_sum = self.loss_sum.zero_()  # of the steps' mean losses
        seen = 0  # images: known on the host, no device work per step
        self.loaders.set_position(start.epoch, start.step)
        total = len(self.loaders.train)
        progress = Progress(start.epoch, total, self.print_every, self.shows_progress, start.step)
        data_wait = self.data_timer
        data_wait.reset()

        synchronize(device)
        t_start = time.perf_counter()
        batches = iter(self.loaders.train)
        step = start.step
        while step < total and not (stop and stop.poll()):
            if step % STOP_POLL_EVERY == 0:
                say_where(f"at epoch {start.epoch} step {step} in {self.step_collectives}")
            with data_wait.measure():
                images, labels = next(batches)

            self.train_step(images, labels, mean_loss_sum)
            if self.scheduler is not None:  # on the host, outside a captured step
                self.scheduler.step()
            if self.profiler:
                self.profiler.profiler.step()
            seen += len(labels)
            progress.update(step, mean_loss_sum)
            step += 1
        synchronize(device)
        elapsed = time.perf_counter() - t_start

        own_data = data_wait.total()
        say_where(f"at the end of epoch {start.epoch}'s training, in its all-reduces")
        # Every step takes a full local batch: the images' loss sum, once per epoch.
        loss_sum, seen = all_reduce(
            [mean_loss_sum * self.loaders.train.batch_size, seen if self.reports_sums else 0],
            device,
        )
        # The epoch lasts until its slowest rank is done: every rank takes that time, so that
        # `time` does not depend on which rank reports it and the t_* parts add up to it.
        most_data, elapsed = all_reduce([own_data, elapsed], device, dist.ReduceOp.MAX)
        segment = Segment(elapsed, own_data, step - start.step)
        reached = Position(
            start.epoch,
            step,
            start.loss_sum + loss_sum,
            start.seen + int(seen),
            start.data_wait + most_data,
            start.time + elapsed,
        )
        return reached, step == total, segment

    def step(self, images: torch.Tensor, labels: torch.Tensor, mean_loss_sum: torch.Tensor) -> None:
        """One optimizer step on this rank's share of the global batch, in `grad_accum`
        micro-batches whose gradients are reduced over the ranks once, after the last. Adds the
        share's mean loss to `mean_loss_sum` (on the device: no host synchronisation)."""
        model, scaler = self.model, self.precision.scaler
        # exercise 6.1 begin
        self.optimizer.zero_grad(set_to_none=True)
        # exercise 6.1 end
        micro = (
            ((images, labels),)
            if self.grad_accum == 1
            else tuple(zip(images.chunk(self.grad_accum), labels.chunk(self.grad_accum)))
        )
        for i, (x, y) in enumerate(micro):
            with gradient_sync(model, enabled=i == len(micro) - 1):
                with self.precision.autocast(x.device):
                    logits = model(x)
                loss = F.cross_entropy(loss_input(logits), y)
                # Weighted by its share of the rank's batch, a micro-batch's mean loss gives
                # gradients that add up to those of the share's mean (one micro-batch: weight 1,
                # no operation). Without fp16 the scaler passes everything through.
                weight = len(y) / len(labels)
                weighted = loss if weight == 1 else loss * weight
                # exercise 6.1 begin
                scaler.scale(weighted).backward()
                # exercise 6.1 end
            with torch.no_grad():  # no graph, and so no detach
                mean_loss_sum += weighted
        if self.clip_grad is not None:
            scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            clip_gradients(model, self.clip_grad)
        # exercise 6.1 begin
        scaler.step(self.optimizer)
        scaler.update()
        # exercise 6.1 end

    def predict(self, images: torch.Tensor) -> torch.Tensor | None:
        """The logits of a validation batch."""
        with self.precision.autocast(images.device):
            return self.model(images)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and accuracy over the whole validation set, each image counted exactly once."""
        # exercise 6.1 begin
        self.model.eval()
        # exercise 6.1 end
        loaders, device = self.loaders, self.env.device
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        count = torch.zeros((), device=device)
        offset = 0
        say_where("in validation")
        synchronize(device)
        start = time.perf_counter()
        for images, labels in loaders.val:
            weights = validation_weights(
                offset, len(labels), *self.data_ranks, loaders.val_size, device
            )
            offset += len(labels)
            logits = self.predict(images)
            if logits is None:  # this rank computes no logits: its sums stay zero
                continue
            losses = F.cross_entropy(loss_input(logits), labels, reduction="none")
            loss_sum += (losses * weights).sum()
            correct += ((logits.argmax(dim=1) == labels).float() * weights).sum()
            count += weights.sum()
        synchronize(device)
        elapsed = time.perf_counter() - start
        # exercise 6.1 begin
        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)
        # exercise 6.1 end
        assert int(count) == loaders.val_size, (count, loaders.val_size)
        return {
            "val_loss": loss_sum / count,
            "acc": 100.0 * correct / count,
            "val_correct": int(correct),
            "val_time": elapsed,
        }


class ComputeCalibration:
    """One optimizer step's compute as one process does it on this rank's local batch: an
    unwrapped model of its own (built by the caller), stepped as the run steps (micro-batches,
    precision, clipping; compiled, or captured as one CUDA graph, where the run's step is) on
    fixed random data. Timed after every epoch's training, on every rank at once, so that it
    sees the machine as the epoch just did; it touches neither the trained model nor any
    random stream.

    Steps are timed in rounds of consecutive steps, the device synchronised around each round
    only, as the training loop runs them: on a GPU the host queues a step's kernels while the
    last step's run, and a step timed alone would add the launch latency the loop hides. A
    step's compute is the fastest round's mean: a shared machine's other work only ever slows
    a round down, so the fastest is the nearest to the step's own cost."""

    # Rounds timed: as many as fit in a tenth of the epoch's training, at most BUDGET_S (a
    # short epoch, a tiny run's or a test's, would otherwise spend as long calibrating as
    # training); never fewer than LEAST, nor more than MOST.
    EPOCH_SHARE, BUDGET_S, LEAST, MOST = 0.1, 0.25, 3, 10
    # Steps a round: a CPU computes as it is called, one step is a round; a GPU's queue holds
    # the next steps' launches while the device works, as in the training loop.
    QUEUED_STEPS = 8

    def __init__(
        self,
        bare: Trainer,
        local_batch: int,
        image_shape: tuple,
        num_classes: int,
        memory_format: torch.memory_format,
    ):
        device = bare.env.device
        self.bare = bare
        self.step = bare.train_step  # a GraphedStep where the run's step is one
        self.round_steps = 1 if device.type == "cpu" else self.QUEUED_STEPS
        # In the loaders' memory format: a layout conversion is not the step's compute.
        self.images = torch.randn(local_batch, *image_shape, device=device).contiguous(
            memory_format=memory_format
        )
        self.labels = torch.randint(0, num_classes, (local_batch,), device=device)
        self.losses = bare.loss_sum  # where the steps add their loss, unread
        # Allocations, kernel choices, compiling; a graph's eager warm-up and capture.
        graphed = isinstance(self.step, GraphedStep)
        for _ in range(self.step.warmup + 1 if graphed else 1):
            self.step(self.images, self.labels, self.losses)

    def seconds_per_step(self, epoch_seconds: float) -> float:
        """The fastest round's step, of the rounds timed after an epoch of epoch_seconds'
        training."""
        budget_s = min(self.BUDGET_S, self.EPOCH_SHARE * epoch_seconds)
        device, rounds = self.bare.env.device, []
        start = time.perf_counter()
        while len(rounds) < self.MOST and (
            len(rounds) < self.LEAST or time.perf_counter() - start < budget_s
        ):
            synchronize_device(device)
            t0 = time.perf_counter()
            for _ in range(self.round_steps):
                self.step(self.images, self.labels, self.losses)
            synchronize_device(device)
            rounds.append((time.perf_counter() - t0) / self.round_steps)
        return min(rounds)
