"""The state one rank keeps between steps (its parameters, their gradients, the optimizer's
state) predicted in bytes from the model's parameter shapes, for each --strategy, --sharding,
--precision, --optimizer and --cpu-offload at a world size: what measure.state_bytes measures
after a training step (the [METRIC] line's state_mem), to the byte (tests/test_memory_model.py).
The ZeRO paper's count (Rajbhandari et al. 2020: 16 bytes a parameter with Adam, 16/N sharded
over N ranks) made exact for this project's wrappers.

What a rank keeps of each parameter (`held`: its elements there, or None where it keeps no part
of it, and so no gradient and no optimizer state for it either):
- replicated (ddp, dp, single, model): the whole of every parameter (model: the one process's,
  over the GPUs it spreads them on).
- pipeline: the whole of each parameter of its own stage (model.cut).
- fsdp2 (fully_shard): its chunk of the parameter's rows, cut as torch.chunk cuts: N chunks of
  ceil(rows / N) rows, the last ones shorter or empty (torch's _fsdp_param stores each chunk
  padded to the full chunk for the all-gather: padding, no parameter's).
- fsdp (FSDP1, use_orig_params): each unit's parameters flattened in module order, each starting
  at a multiple of 16 bytes of the dtype the unit computes in, the whole padded to a multiple of
  N and cut into N equal chunks (torch's _flat_param); the rank keeps each parameter's overlap
  with its chunk, and one with none is no parameter of its optimizer.
N: the ranks a shard is cut over: every rank, or under hybrid sharding a node's.

Bytes an element: the storage dtype's (precision.storage_dtype: float64 under fp64, float32
under every other precision, mixed precision included: it computes from fp32 parameters,
reduces gradients in fp32, and holds its 16-bit copies only while a unit runs). Parameters and
gradients one element each; the optimizer OPTIMIZER_STATE's. All of it on the device, or with
--cpu-offload (FSDP) in host memory.

Not counted, as state_bytes counts none of it: FSDP's padding (FSDP2: the rows a rank's chunk
lacks, on the last ranks; FSDP1: under 16 bytes a parameter and N elements a unit); the buffers
(BatchNorm's statistics); and the transient: a unit's gathered parameters (FSDP's grad_op keeps
them from forward to backward: the difference from full is there; both reshard after backward,
and keep the same state between steps), activations, the loss scaler. DDP's buckets are its
gradients (gradient_as_bucket_view). Gradients exist only after a backward, and the optimizer's
state only after its first step.
"""

import math
from dataclasses import dataclass

import torch.nn as nn

from config import FLAT_SHARDS, SHARDED, STAGED, Config
from model import cut, unit_parameters
from precision import DTYPES, storage_dtype
from utils import MB

# Where FSDP1 starts each parameter in its flat buffer: a multiple of 16 bytes of the unit's
# compute dtype (torch's _flat_param._get_aligned_numel, with use_orig_params).
FSDP1_ALIGNMENT = 16

# Per --optimizer: its tensors of a parameter's size (Adam's exp_avg and exp_avg_sq, SGD's
# momentum_buffer), and its bytes of scalars a parameter (Adam's step count: a float32 scalar
# in fused Adam, optim.make_optimizer, whatever the parameters' dtype).
OPTIMIZER_STATE = {"adam": (2, 4), "sgd": (1, 0)}


@dataclass(frozen=True)
class RankState:
    """Bytes one rank keeps between steps."""

    parameters: int
    gradients: int
    optimizer: int
    on_host: bool = False  # --cpu-offload: all of it in host memory, none on the GPU

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def on_device(self) -> int:
        return 0 if self.on_host else self.total


def shard_ranks(sharding: str, world_size: int, nodes: int) -> int:
    """The ranks an FSDP shard is cut over: every rank, or a node's (hybrid, nodes of equal
    ranks, as fsdp_utils.hybrid_mesh demands)."""
    if sharding != "hybrid":
        return world_size
    if world_size % nodes:
        raise ValueError(f"hybrid sharding: {world_size} ranks do not split over {nodes} nodes")
    return world_size // nodes


def fsdp2_held(shape: tuple[int, ...], ranks: int, index: int) -> int:
    """The elements of a parameter of this shape in chunk `index` of `ranks` (fully_shard)."""
    chunk = -(-shape[0] // ranks)
    rows = max(0, min(chunk, shape[0] - index * chunk))
    return rows * math.prod(shape[1:])


def fsdp1_held(numels: list[int], align: int, ranks: int, index: int) -> list[int | None]:
    """The elements of each parameter of one FSDP1 unit (their numels, in its order) in chunk
    `index` of `ranks` of its flat parameter, each starting at a multiple of `align` elements."""
    spans, end = [], 0
    for numel in numels:
        end += -end % align
        spans.append((end, end + numel))
        end += numel
    chunk = -(-end // ranks)  # the flat parameter padded to a multiple of ranks
    low, high = index * chunk, (index + 1) * chunk
    overlaps = [min(stop, high) - max(start, low) for start, stop in spans]
    return [n if n > 0 else None for n in overlaps]


def held(cfg: Config, model: nn.Module, world_size: int, nodes: int, rank: int) -> list[int | None]:
    """What rank `rank` keeps of each parameter: its elements, or None for no part of it."""
    if cfg.strategy in STAGED:
        return [p.numel() for p in cut(model, world_size)[rank].parameters()]
    if cfg.strategy not in SHARDED:
        return [p.numel() for p in model.parameters()]
    ranks = shard_ranks(cfg.sharding, world_size, nodes)
    index = rank % ranks  # ranks laid out in blocks, a node's consecutive
    if cfg.strategy not in FLAT_SHARDS:  # fully_shard: each parameter on its first dimension
        return [fsdp2_held(tuple(p.shape), ranks, index) for p in model.parameters()]
    align = FSDP1_ALIGNMENT // DTYPES[cfg.precision].itemsize
    return [
        n
        for unit in unit_parameters(model).values()  # FSDP1 flattens each in module order
        for n in fsdp1_held([p.numel() for p in unit], align, ranks, index)
    ]


def offloaded(cfg: Config) -> bool:
    """Whether the state lives in host memory: FSDP's --cpu-offload (its shards, their gradients,
    and so the optimizer's state made like them)."""
    return cfg.cpu_offload and cfg.strategy in SHARDED


def rank_state(
    cfg: Config, model: nn.Module, world_size: int, nodes: int = 1, rank: int = 0
) -> RankState:
    """The bytes rank `rank` of `world_size` (over `nodes`) keeps between steps of `model` (its
    parameters' shapes alone are read: a model on the meta device will do)."""
    kept = [n for n in held(cfg, model, world_size, nodes, rank) if n is not None]
    elements, size = sum(kept), storage_dtype(cfg.precision).itemsize
    tensors, scalar_bytes = OPTIMIZER_STATE[cfg.optimizer]
    return RankState(
        parameters=elements * size,
        gradients=elements * size,
        optimizer=tensors * elements * size + scalar_bytes * len(kept),
        on_host=offloaded(cfg),
    )


def state_mem(cfg: Config, model: nn.Module, world_size: int, nodes: int = 1) -> int:
    """The [METRIC] line's state_mem, predicted: the most any rank keeps."""
    return max(rank_state(cfg, model, world_size, nodes, r).total for r in range(world_size))


def describe(cfg: Config, model: nn.Module, world_sizes: list[int], nodes: int) -> str:
    """`main.py --check`'s word on the state a rank will keep at each world size."""
    said = []
    for size in world_sizes:
        try:
            said.append(f"{state_mem(cfg, model, size, nodes) / MB:.1f} MB at {size}")
        except ValueError:  # hybrid sharding of a world that does not split over the nodes
            said.append(f"n/a at {size}")
    where = " in host memory" if offloaded(cfg) else ""
    return (
        "state per rank (parameters, gradients, optimizer state), predicted: "
        + ", ".join(said)
        + where
    )


def bytes_per_parameter(optimizer: str, precision: str) -> int:
    """What a replicated rank keeps of each parameter element: the element, its gradient and the
    optimizer's tensors of its size, in the storage dtype (the ZeRO paper's 16 with Adam in
    fp32; the optimizer's scalars, bytes a tensor rather than an element, left out)."""
    tensors, _ = OPTIMIZER_STATE[optimizer]
    return (2 + tensors) * storage_dtype(precision).itemsize
