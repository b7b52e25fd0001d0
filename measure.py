"""What an epoch measures, and how: memory (the training peak above a baseline, the state's
exact bytes), the time of a stage of every step (StageTimer), where the epoch's time went
(time_breakdown, with the compute calibration behind t_compute), the share of it the GPU ran
kernels (gpu_busy, from a kernel trace of the calibration's step, at one rank only), and the
`[METRIC]` fields they make, each reduced over the ranks (all_reduce: every number reported is
a global one).
docs/metrics.md says what each field means.
"""

import contextlib
import ctypes
import math
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import DeviceType

from checkpoint import Position
from cuda_graphs import GraphedStep
from distributed_utils import barrier
from mfu import UNKNOWN
from profiling import quiet_kineto


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
    if peak is None:  # no /proc: the lifetime peak instead of the epoch's
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


@dataclass
class Segment:
    """What this rank did in the part of an epoch this process trained (the whole epoch unless
    it resumed mid-way): the part's wall time (its slowest rank's), this rank's own time
    fetching batches, and its steps."""

    elapsed: float
    data: float
    steps: int


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def every_rank(value: float, device: torch.device) -> list[float]:
    """Each rank's value, in rank order, on every rank (one all-reduce of a vector)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return all_reduce([value if r == rank else 0.0 for r in range(world_size())], device)


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


def busy_seconds(events) -> float:
    """Seconds in which the GPU ran at least one of a kernel trace's device events (the torch
    profiler's FunctionEvents: kernels, memory copies and sets, timed by the device from their
    start to their end, in microseconds): the union of their intervals, so that kernels that
    overlap on two streams count once. Left out as torch's own device totals leave them out:
    the host's events (operators, launches), and user annotations mirrored onto the device's
    timeline, which span the gaps between kernels."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    )
    busy, reached = 0.0, -math.inf
    for start, end in spans:
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return busy / 1e6


def traced_busy_seconds(work: Callable[[], None], device: torch.device) -> float:
    """busy_seconds of what work() runs on the GPU, from a trace of the device's activity only:
    CUPTI records each kernel's start and end on the device, so whatever the trace costs the
    host lengthens no kernel (it may widen the gaps between them, which are not counted)."""
    quiet_kineto()  # its markers at start and stop would otherwise reach every run's stderr
    # acc_events: torch 2.10 warns on stderr at every trace that does not keep its events.
    cuda = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=cuda, acc_events=True) as trace:
        work()
        synchronize_device(device)  # every kernel done before the trace stops
    return busy_seconds(trace.events())


def gpu_busy(segment: Segment, kernel_seconds: float | None) -> dict:
    """gpu_busy: the share of the segment's training time the GPU spent running the steps'
    kernels, kernel_seconds a step (train.Trainer.kernel_seconds_per_step) x the steps / the
    segment's time; UNKNOWN where no kernel time is known (a CPU, more than one rank, a trace
    that saw no kernel). Not clamped: above 1 the trace and the clock disagree."""
    if not kernel_seconds:
        return {"gpu_busy": UNKNOWN}
    return {"gpu_busy": kernel_seconds * segment.steps / segment.elapsed}


def epoch_fields(
    reached: Position, val: dict, memory: list[int], data_bytes: int, device: torch.device
) -> dict:
    """The `[METRIC]` fields of an epoch's training (its sums global) and validation, and of
    memory: this rank's [peak, state, reserved] bytes, the maximum over ranks, in MB (state_mem
    in bytes); data_mem, the data set on the device, the same on every rank."""
    peak, state, reserved = all_reduce(memory, device, dist.ReduceOp.MAX)
    return {
        "epoch": reached.epoch,
        "time": reached.time,
        "val_loss": val["val_loss"],
        "acc": val["acc"],
        "peak_mem": round(peak / 2**20),
        "train_loss": reached.loss_sum / max(reached.seen, 1),
        "val_time": val["val_time"],
        "throughput": reached.seen / reached.time,
        "data_wait": reached.data_wait,
        "state_mem": int(state),
        "data_mem": round(data_bytes / 2**20),
        "reserved_mem": round(reserved / 2**20),
    }


class ComputeCalibration:
    """One optimizer step's compute as one process does it on this rank's local batch: an
    unwrapped model of its own, stepped as the run steps (micro-batches, precision, clipping;
    compiled, or captured as one CUDA graph, where the run's step is: session.calibrate_compute
    builds it) on fixed random data. Timed after every epoch's training, on every rank at
    once, so that it sees the machine as the epoch just did; it touches neither the trained
    model nor any random stream.

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
        step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        batch: tuple[torch.Tensor, torch.Tensor],
        losses: torch.Tensor,
    ):
        """step: as train.Learner.train_step (a GraphedStep where the run's step is one);
        batch: random images and labels; losses: where the steps add their loss, unread."""
        self.step, (self.images, self.labels), self.losses = step, batch, losses
        self.device = self.images.device
        self.round_steps = 1 if self.device.type == "cpu" else self.QUEUED_STEPS
        # Allocations, kernel choices, compiling; a graph's eager warm-up and capture.
        graphed = isinstance(self.step, GraphedStep)
        for _ in range(self.step.warmup + 1 if graphed else 1):
            self.step(self.images, self.labels, self.losses)
        # A CPU runs no kernels: nothing to trace, the profiler never starts.
        self.traced, self.kernel_seconds = self.device.type != "cuda", None

    def run_round(self) -> None:
        for _ in range(self.round_steps):
            self.step(self.images, self.labels, self.losses)

    def seconds_per_step(self, epoch_seconds: float) -> float:
        """The fastest round's step, of the rounds timed after an epoch of epoch_seconds'
        training."""
        budget_s = min(self.BUDGET_S, self.EPOCH_SHARE * epoch_seconds)
        device, rounds = self.device, []
        start = time.perf_counter()
        while len(rounds) < self.MOST and (
            len(rounds) < self.LEAST or time.perf_counter() - start < budget_s
        ):
            synchronize_device(device)
            t0 = time.perf_counter()
            self.run_round()
            synchronize_device(device)
            rounds.append((time.perf_counter() - t0) / self.round_steps)
        return min(rounds)

    def kernel_seconds_per_step(self) -> float | None:
        """The GPU's time running one step's kernels (for gpu_busy): one more round, after the
        timed ones and never timed itself, under a kernel trace (traced_busy_seconds). Traced at
        the first call only: a step runs the same kernels every epoch. None on a CPU, or where
        the trace saw no kernel."""
        if not self.traced:
            self.traced = True
            busy = traced_busy_seconds(self.run_round, self.device)
            self.kernel_seconds = busy / self.round_steps if busy else None
        return self.kernel_seconds
