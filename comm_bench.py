"""What the interconnect delivers for the messages this model sends: a collective micro-benchmark.

In an initialized process group, times `all_reduce` at the sizes DDP sends (each gradient
bucket, and the whole gradient: its first iteration's one bucket), all-gather and reduce-scatter
at the sizes FSDP sends for each unit, in the dtypes the run's --precision sends
(precision.wire_dtypes), and each of the three over a sweep of message sizes. Rank 0 prints one
`[COMM]` line per measurement (utils.format_comm): the time of one collective (the median
round, the slowest rank's) and nccl-tests' algorithm and bus bandwidths
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

    torchrun --nproc_per_node=2 benchmark.py --comm     # alone
    main.py --comm-benchmark ...                        # once at the start of a training job
"""

import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

from distributed_utils import BACKENDS
from measure import StageTimer, all_reduce, synchronize_device
from model import unit_parameters
from precision import wire_dtypes
from utils import format_comm, log0

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# The new names of all_gather_into_tensor and reduce_scatter_tensor (the old ones warn on every
# call in recent torch); the old ones where torch is older.
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
# DDP's bucket caps (torch.nn.parallel.DistributedDataParallel's defaults, which ddp_utils keeps):
# once its buckets are rebuilt, the first is capped at 1 MiB so that communication starts early
# in backward, the others at bucket_cap_mb=25.
DDP_FIRST_BUCKET = 1 << 20
DDP_BUCKET = 25 << 20
# The sweep: 4 KiB, 16 KiB, ... up to the largest size (a GPU's links need large messages to be
# saturated; gloo on a CPU takes seconds beyond a few MiB).
SWEEP_MIN = 4 << 10
SWEEP_MAX = {"cuda": 256 << 20, "cpu": 4 << 20}
# Per measurement: (warm-up runs, timed rounds, runs back to back in a round). On a GPU a round
# of several, as nccl-tests times them: a small collective lasts microseconds. On a CPU gloo
# returns when it is done, and a round of one is timed by the wall clock.
REPEATS = {"cuda": (5, 5, 10), "cpu": (2, 5, 1)}


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw, what each rank's link carries: 2(n-1)/n for an all-reduce
    (reduce-scatter then all-gather), (n-1)/n for an all-gather or a reduce-scatter."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}: one of {', '.join(OPS)}")


def bandwidths(op: str, nbytes: int, world_size: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes), nccl-tests' way: algbw = bytes / time, where bytes is
    the whole message (an all-gather's output, a reduce-scatter's input)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, world_size)


def fill_buckets(sizes: list[int], caps: list[int]) -> list[int]:
    """The bytes of each bucket as DDP's reducer fills them (compute_bucket_assignment_by_size):
    a bucket closes once it reaches its cap; each takes the next cap, the last repeating."""
    buckets, current = [], 0
    for size in sizes:
        current += size
        if current >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def ddp_buckets(model: nn.Module, gradient_bytes: int, rebuilt: bool = True) -> list[int]:
    """The bytes of each gradient bucket DDP all-reduces, in order, at gradient_bytes an
    element. The first iteration (rebuilt=False) sends the whole gradient as one bucket (DDP
    does not know yet the order gradients arrive in); then it rebuilds the buckets in arrival
    order, modelled as the parameters' reverse. A gradient that arrives later than that
    (under autocast, the CNN's first linear bias) can move a bucket's edge (test_collectives)."""
    sizes = [p.numel() * gradient_bytes for p in model.parameters() if p.requires_grad]
    if not rebuilt:
        return [sum(sizes)]
    return fill_buckets(sizes[::-1], [DDP_FIRST_BUCKET, DDP_BUCKET])


def fsdp_units(model: nn.Module, element_bytes: int) -> dict[str, int]:
    """The flat parameter bytes each FSDP unit gathers (model.unit_parameters)."""
    return {
        name: sum(p.numel() for p in params) * element_bytes
        for name, params in unit_parameters(model).items()
    }


def sweep_sizes(device: torch.device, largest: int | None = None) -> list[int]:
    largest = largest or SWEEP_MAX[device.type]
    sizes, size = [], SWEEP_MIN
    while size <= largest:
        sizes.append(size)
        size *= 4
    return sizes


def messages(
    model: nn.Module, precision: str, strategy: str, sizes: list[int]
) -> list[tuple[str, str, int]]:
    """(op, label, bytes) of every measurement: the model's own messages in the dtypes this
    strategy sends at this precision (precision.wire_dtypes), then the sweep."""
    gathered, reduced = (dtype.itemsize for dtype in wire_dtypes(precision, strategy))
    (grad,) = ddp_buckets(model, reduced, rebuilt=False)  # the whole gradient
    found = [("all_reduce", "grad", grad)]
    found += [("all_reduce", f"bucket{i}", b) for i, b in enumerate(ddp_buckets(model, reduced))]
    scattered = fsdp_units(model, reduced)
    for name, nbytes in fsdp_units(model, gathered).items():
        found += [
            ("all_gather", f"unit_{name}", nbytes),
            ("reduce_scatter", f"unit_{name}", scattered[name]),
        ]
    found += [(op, "sweep", size) for size in sizes for op in OPS]
    return found


def collective(op: str, nbytes: int, world_size: int, device: torch.device):
    """A function that runs one collective on fp32 buffers of nbytes (an all-gather's or
    reduce-scatter's rounded up so that every rank has an equal share), and the bytes moved."""
    elements = -(-nbytes // 4)
    if op != "all_reduce":
        elements = -(-elements // world_size) * world_size
    full = torch.ones(elements, dtype=torch.float32, device=device)
    shard = torch.ones(elements // world_size, dtype=torch.float32, device=device)
    run = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: ALL_GATHER(full, shard),
        "reduce_scatter": lambda: REDUCE_SCATTER(shard, full),
    }[op]
    return run, elements * 4


def time_round(run, device: torch.device, runs: int) -> float:
    """Seconds per collective over `runs` of them back to back. Ranks start together (barrier);
    the device's time, as measure.StageTimer takes a step's stage."""
    dist.barrier()
    timer = StageTimer(device)
    with timer.measure():
        for _ in range(runs):
            run()
    synchronize_device(device)
    return timer.total() / runs


def measure(op: str, nbytes: int, device: torch.device, repeats: tuple[int, int, int]) -> tuple:
    """(bytes moved, seconds per collective): the median of the timed rounds after warm-up, the
    slowest rank's (a collective ends for all when it ends for the last)."""
    world_size = dist.get_world_size()
    run, moved = collective(op, nbytes, world_size, device)
    warmup, rounds, runs = repeats
    for _ in range(warmup):
        run()
    median = statistics.median(time_round(run, device, runs) for _ in range(rounds))
    (slowest,) = all_reduce([median], device, dist.ReduceOp.MAX)
    return moved, slowest


def run_comm_benchmark(
    model: nn.Module,
    device: torch.device,
    precision: str,
    strategy: str,
    largest: int | None = None,
    repeats: tuple[int, int] | None = None,
    extra: dict | None = None,
) -> list[dict]:
    """Every measurement's [COMM] fields (rank 0 also prints them), on every rank of a process
    group. model: unwrapped (meta tensors do), for its message sizes."""
    world_size = dist.get_world_size()
    repeats = repeats or REPEATS[device.type]
    rows = []
    for op, label, nbytes in messages(model, precision, strategy, sweep_sizes(device, largest)):
        moved, seconds = measure(op, nbytes, device, repeats)
        algbw, busbw = bandwidths(op, moved, world_size, seconds)
        row = {
            "op": op,
            "label": label,
            "bytes": moved,
            "world_size": world_size,
            "time_us": seconds * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
            "device": device.type,
            "backend": BACKENDS[device.type],
            **(extra or {}),
        }
        log0(format_comm(row))
        rows.append(row)
    return rows
