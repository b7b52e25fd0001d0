"""What an epoch measures, and how: memory (the training peak above a baseline, the state's
exact bytes), the time of a stage of every step (StageTimer), where the epoch's time went
(time_breakdown, with the compute calibration timed beside the epoch behind t_compute, and
breakdown_warning where it cannot tell), the share of it the GPU ran kernels (gpu_busy, from a
kernel trace of the calibration's step, at one rank only), and the `[METRIC]` fields they make,
each reduced over the ranks (all_reduce: every number reported is a global one). A trainer
holds its meters as one `EpochMeters`. docs/metrics.md says what each field means.
"""

import collections
import contextlib
import ctypes
import functools
import math
import re
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import DeviceType

from checkpoint_files import Position
from cost_model import UNKNOWN, ModelFlops
from cuda_graphs import GraphedStep
from distributed_utils import barrier
from peer_failures import say_where
from profiling import StepProfiler, quiet_kineto
from utils import MB


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


def peak_memory_bytes(device: torch.device) -> tuple[int, int]:
    """This rank's (allocated, reserved) peaks since reset_peak_memory: the CUDA caching
    allocator's (reserved: its cache too, what the process really took), or on CPU the peak
    resident set, libraries included, for both."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    peak = _process_memory_bytes("VmHWM")
    if peak is None:  # no /proc: the lifetime peak instead of the epoch's
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak, peak


class MemoryMeter:
    """Training memory: the peak above a baseline taken once the data set is resident on the
    device and before the model exists: the model, its gradients, optimizer state, activations
    and batches, not the data set (reported on its own), nor on CPU torch's own libraries (so
    it means the same on a GPU and on a CPU, and compares with the course's runs), nor what
    runs set_aside within the epoch (the compute calibration's rounds)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            # Hand the C heap's free memory back (glibc's malloc_trim): what was freed before
            # (decoding the data set) would otherwise stay resident, inflate the baseline, and
            # be reused by training unseen, moving its peak by tens of MB from run to run.
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).malloc_trim(0)
            self.baseline = _process_memory_bytes("VmRSS") or 0
        self.kept = (0, 0)  # the epoch's peaks, allocated and reserved, before work set aside

    def reset(self) -> None:
        reset_peak_memory(self.device)
        self.kept = (0, 0)

    def peaks(self) -> tuple[int, int]:
        """Since reset(), the work set aside left out: (allocated, reserved) peak bytes."""
        now = peak_memory_bytes(self.device)
        return max(now[0], self.kept[0]), max(now[1], self.kept[1])

    @contextlib.contextmanager
    def set_aside(self):
        """Work within the epoch whose memory is not training's: the peaks so far are kept, and
        the device's own peak statistics start again afterwards, from what is held then (on
        CUDA without emptying the allocator's cache, which the epoch's next steps reuse)."""
        self.kept = self.peaks()
        yield
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_memory(self.device)

    def training_peak(self, at_least: int = 0) -> int:
        """Since reset(), above the baseline; at_least: a peak the allocator did not see."""
        return max(0, max(self.peaks()[0], at_least) - self.baseline)

    def reserved_peak(self) -> int:
        """Since reset(): what the process really took (peak_memory_bytes)."""
        return self.peaks()[1]


class StageTimer:
    """Seconds spent in one stage of every step (fetching the next batch), over an epoch. On
    CUDA the wall clock would see only the kernels' launch: events recorded on the stream around
    the stage measure the device's time, read once the epoch has synchronized. On the CPU the
    work is done when the call returns: the wall clock."""

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


def state_bytes_by_device(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[torch.device, int]:
    """Exact bytes of parameters, gradients and optimizer state held by this rank, by the device
    that holds them (--cpu-offload keeps them in host memory). Under FSDP, model.parameters()
    are this rank's shards (FSDP2's DTensors: their local part), so this shrinks with sharding."""
    tensors = list(model.parameters())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    held = collections.Counter()
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        held[local.device] += local.numel() * local.element_size()
    return dict(held)


def state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device | None = None
) -> int:
    """Exact bytes of this rank's state (state_bytes_by_device); with `device`, those on it."""
    held = state_bytes_by_device(model, optimizer)
    return sum(held.values()) if device is None else held.get(device, 0)


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
    """What this rank did in the part of an epoch this process trained (all of it unless it
    resumed mid-way): the part's wall time (its slowest rank's, the compute calibration's rounds
    left out), this rank's own time fetching batches, and its steps."""

    elapsed: float
    data: float
    steps: int


def every_rank(values: list[float], device: torch.device) -> list[list[float]]:
    """Each rank's values, in rank order, on every rank: one all-reduce (a sum) of a vector in
    which each rank fills its own slots, the others' left zero."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = [v if r == rank else 0.0 for r in range(size) for v in values]
    flat = all_reduce(mine, device)
    return [flat[r * len(values) : (r + 1) * len(values)] for r in range(size)]


@dataclass
class StepCompute:
    """One step's compute on this rank, for t_compute: the median, fastest and slowest of the
    compute calibration's rounds; all three alike where it is measured as it trains (a
    pipeline's stages)."""

    median: float
    fastest: float
    slowest: float

    @classmethod
    def measured(cls, seconds: float) -> "StepCompute":
        return cls(seconds, seconds, seconds)


# Above this share of the epoch, compute_spread leaves compute too uncertain: unreliable.
SPREAD_LIMIT = 0.25


def time_breakdown(segment: Segment, step: StepCompute, device: torch.device, sends: bool) -> dict:
    """Where the epoch's time went, in seconds, each the mean over ranks, none negative, adding
    up to the segment's time by construction (docs/metrics.md):

    t_compute  the steps' work as one process does it on this rank's batch (step.median x steps)
    t_data     fetching batches (this rank's data_wait)
    t_wait     waiting for the busiest rank: its compute + data, minus this rank's own
    t_comm     the rest, where the run sends (more than one device): communication and the
               wrapper's work not hidden behind compute, and what the step's model misses
    t_other    the rest, where nothing is sent: what the step's model does not explain

    Compute is capped at what fits beside the data (the rest is then 0). compute_spread, how
    uncertain it is: the slowest round's compute minus the fastest's (or the cap), the largest
    over ranks; above SPREAD_LIMIT of the epoch, compute and the rest are `na`,
    breakdown=unreliable (breakdown_warning says why). Also the straggler: slowest_rank, and
    rank_time_spread between the busiest and least busy ranks. Every rank's numbers come in one
    all-reduce (every_rank), so every rank takes the same sums.
    """
    steps, data = segment.steps, segment.data
    room = segment.elapsed - data  # the most compute this rank's part of the epoch can hold
    compute = min(step.median * steps, room)
    own_spread = step.slowest * steps - min(step.fastest * steps, room)
    computes, datas, spreads = zip(*every_rank([compute, data, own_spread], device))
    busy = [c + d for c, d in zip(computes, datas)]
    slowest, spread = max(busy), max(spreads)
    rest = segment.elapsed - slowest
    reliable = spread <= SPREAD_LIMIT * segment.elapsed
    rest = rest if reliable else UNKNOWN
    return {
        "t_compute": sum(computes) / len(busy) if reliable else UNKNOWN,
        "t_data": sum(datas) / len(busy),
        "t_comm": rest if sends else 0.0,
        "t_wait": sum(slowest - b for b in busy) / len(busy),
        "t_other": 0.0 if sends else rest,
        "compute_spread": spread,
        "breakdown": "ok" if reliable else "unreliable",
        "slowest_rank": busy.index(slowest),
        "rank_time_spread": slowest - min(busy),
    }


def breakdown_warning(fields: dict) -> str | None:
    """Why an epoch's breakdown is unreliable (time_breakdown), or None where it is not."""
    if fields.get("breakdown") != "unreliable":
        return None
    spread, epoch = fields["compute_spread"], fields["time"]
    return (
        f"warning: epoch {fields['epoch']}: breakdown=unreliable: the compute calibration's "
        f"rounds beside the epoch leave its compute uncertain by compute_spread={spread:.3g} s, "
        f"{100 * spread / epoch:.0f}% of its {epoch:.3g} s (more than "
        f"{100 * SPREAD_LIMIT:.0f}%): the machine's speed changed while it trained (other work "
        "on its cores?), or the rounds' step is slower than the run's"
    )


def busy_seconds(events) -> float:
    """Seconds in which the GPU ran at least one of a kernel trace's device events (kernels,
    copies and sets, in microseconds): the union of their intervals, so that kernels overlapping
    on two streams count once. As in torch's own device totals, the host's events and user
    annotations mirrored onto the device's timeline (which span the gaps) are left out."""
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
    CUPTI times each kernel on the device, so the trace's cost to the host lengthens none."""
    quiet_kineto()  # its markers at start and stop would otherwise reach every run's stderr
    # acc_events: torch 2.10 warns on stderr at every trace that does not keep its events.
    cuda = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=cuda, acc_events=True) as trace:
        work()
        synchronize_device(device)  # every kernel done before the trace stops
    return busy_seconds(trace.events())


def gpu_busy(segment: Segment, kernel_seconds: float | None) -> dict:
    """gpu_busy: the share of the segment's time the GPU ran the steps' kernels (kernel_seconds
    a step x steps / time); UNKNOWN where no kernel time is known. Not clamped: above 1 the
    trace and the clock disagree."""
    if not kernel_seconds:
        return {"gpu_busy": UNKNOWN}
    return {"gpu_busy": kernel_seconds * segment.steps / segment.elapsed}


def epoch_fields(
    reached: Position, val: dict, memory: list[int], data_bytes: int, device: torch.device
) -> dict:
    """The `[METRIC]` fields of an epoch's training (its sums global), validation and memory:
    this rank's [peak, state, reserved, activations per image] bytes, the maximum over ranks,
    in MB (state_mem and act_per_image in bytes); data_mem, the data set on the device."""
    peak, state, reserved, per_image = all_reduce(memory, device, dist.ReduceOp.MAX)
    return {
        "epoch": reached.epoch,
        "time": reached.time,
        "val_loss": val["val_loss"],
        "acc": val["acc"],
        "peak_mem": round(peak / MB),
        "train_loss": reached.loss_sum / max(reached.seen, 1),
        "val_time": val["val_time"],
        "throughput": reached.seen / reached.time,
        "data_wait": reached.data_wait,
        "state_mem": int(state),
        "data_mem": round(data_bytes / MB),
        "reserved_mem": round(reserved / MB),
        "act_per_image": round(per_image),
    }


class ComputeCalibration:
    """One optimizer step's compute as one process does it on this rank's local batch: an
    unwrapped model of its own, stepped as the run steps (micro-batches, precision, clipping,
    compiled or graphed: session.calibrate_compute builds it) on fixed random data, touching
    neither the trained model nor any random stream.

    Timed beside the epoch, so that it sees the machine the epoch sees: rounds interleaved with
    the epoch's steps, spread evenly (plan), on every rank at once, the epoch's clock stopped
    and their memory set aside meanwhile. (Timed after the epoch on a shared machine, its
    fastest round missed the other work that slowed the epoch, taken then for communication.)
    A round's steps run back to back, synchronised around the round only, as the loop runs
    them: a step timed alone would add the launch latency the loop hides. A step's compute is
    the median round's: the typical one, neither the luckiest nor the unluckiest."""

    # Rounds an epoch: as many as take a tenth of its steps, LEAST to MOST.
    EPOCH_SHARE, LEAST, MOST = 0.1, 3, 10
    # Steps a round on a GPU, whose queue holds the next steps' launches while the device works
    # (a CPU computes as it is called: one step a round).
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
        self.rounds = []  # this epoch's, seconds a step
        # A CPU runs no kernels: nothing to trace, the profiler never starts.
        self.traced, self.kernel_seconds = self.device.type != "cuda", None

    def run_round(self) -> None:
        for _ in range(self.round_steps):
            self.step(self.images, self.labels, self.losses)

    def plan(self, first: int, total: int) -> list[int]:
        """A new epoch, of which steps first..total-1 are to train: the steps before which a
        round runs (total: after the last), in order, spread evenly over them."""
        self.rounds = []
        steps = total - first
        count = min(self.MOST, max(self.LEAST, round(self.EPOCH_SHARE * steps / self.round_steps)))
        return [first + (2 * i + 1) * steps // (2 * count) for i in range(count)]

    def timed_round(self) -> float:
        """One round beside the epoch, on every rank at once, its step's time kept. Returns the
        seconds it held this rank's epoch up, the wait for the other ranks' rounds included."""
        synchronize_device(self.device)  # the epoch's queued steps are the epoch's time
        start = time.perf_counter()
        self.run_round()
        synchronize_device(self.device)
        self.rounds.append((time.perf_counter() - start) / self.round_steps)
        barrier()  # the ranks go on together: no rank's next collective waits for a round
        return time.perf_counter() - start

    def step_compute(self) -> StepCompute:
        """The median, fastest and slowest of this epoch's rounds."""
        rounds = sorted(self.rounds)
        return StepCompute(statistics.median(rounds), rounds[0], rounds[-1])

    def kernel_seconds_per_step(self) -> float | None:
        """The GPU's time running one step's kernels (for gpu_busy): one more round, after the
        epoch, under a kernel trace, at the first call only (a step's kernels are the same every
        epoch). None on a CPU, or where the trace saw no kernel."""
        if not self.traced:
            self.traced = True
            busy = traced_busy_seconds(self.run_round, self.device)
            self.kernel_seconds = busy / self.round_steps if busy else None
        return self.kernel_seconds


@dataclass(kw_only=True)
class EpochMeters:
    """What a trainer measures its epochs with (session.build_trainer makes them): the memory
    meter, data_wait's timer, the compute calibration (None for a pipeline's stages, which
    measure their own), --profile's profiler, the model's FLOPs, and the `[METRIC]` line's
    fields that are not measured (labels)."""

    memory: MemoryMeter
    flops: ModelFlops  # for tflops and mfu
    labels: dict = field(default_factory=dict)
    calibration: ComputeCalibration | None = None
    profiler: StepProfiler | None = None

    @functools.cached_property
    def data_wait(self) -> StageTimer:
        """data_wait's timer: its CUDA events made once."""
        return StageTimer(self.memory.device)

    def tracing(self) -> bool:
        """Whether --profile's trace is still to come: it holds the run's steps alone."""
        return self.profiler is not None and not self.profiler.saved

    def calibration_plan(self, first: int, total: int) -> list[int]:
        """The steps of an epoch (first..total-1) before which the calibration times a round:
        none without one; while --profile's trace is still to come, after the steps it traces."""
        if self.calibration is None:
            return []
        if self.tracing():
            first = min(total, first + self.profiler.traced_steps[-1])
        return self.calibration.plan(first, total)

    def calibrate(self, planned: list[int], step: int) -> float:
        """The calibration's rounds planned before `step` (total: after the last), their memory
        set aside; returns the seconds they held the epoch up."""
        held, count = 0.0, planned.count(step)
        if count:
            say_where(f"in the compute calibration's rounds before step {step}")
        for _ in range(count):
            with self.memory.set_aside():
                held += self.calibration.timed_round()
        return held

    def step_compute(self) -> StepCompute:
        """One step's compute on this rank this epoch, for t_compute (time_breakdown); 0
        without a calibration."""
        return self.calibration.step_compute() if self.calibration else StepCompute.measured(0.0)

    def kernel_seconds_per_step(self, world_size: int) -> float | None:
        """One step's GPU kernel time, for gpu_busy; None where unknown: no calibration (a
        pipeline), or more than one rank (the unwrapped step runs none of the wrapper's
        collectives). Not while --profile's own trace is still to come: the profiler runs one
        trace at a time."""
        if self.calibration is None or world_size > 1 or self.tracing():
            return None
        return self.calibration.kernel_seconds_per_step()
