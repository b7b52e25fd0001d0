"""Fully sharded data parallel: each rank stores only 1/world_size of parameters, gradients and
optimizer state. Two APIs, one idea:

- `--strategy fsdp`: `FullyShardedDataParallel` (FSDP1, what the course uses). A wrap policy
  makes each unit of `own_units` its own FSDP unit.
- `--strategy fsdp2`: `fully_shard` (PyTorch's current FSDP), applied explicitly to each unit,
  then to the root; parameters become DTensors sharded over a device mesh.

Just before a unit runs, its full parameters are all-gathered; right after, they are freed
again; in backward, gradients are reduce-scattered so each rank keeps the shard it owns. A rank
never holds the whole model: at its peak, in backward, its shards plus the current unit's full
parameters and gradients and the next unit's parameters, prefetched. Bought with more
communication than DDP: worth it for models too large for one GPU, not for this small CNN.

The units (`model.own_units`): each of the model's `shard_units()` (the CNN's conv blocks and
classifier, a ResNet's stages) of at least MIN_UNIT_PARAMS parameters; the root holds the rest.
A unit costs the host the same hooks and copies whatever its size, and a tiny one's gather is
all latency (docs/performance.md; budgets: tests/test_step_cost.py). Both APIs keep the root's
parameters from forward to backward, which needs them first (as torchtitan keeps its last
block); the CNN's classifier, 96% of the model, is still resharded after forward under `full`:
kept, it would make ZeRO-3 ZeRO-2.

Sharding (`--sharding`):
  full     parameters, gradients and optimizer state sharded (ZeRO-3): FULL_SHARD, or
           fully_shard(reshard_after_forward=True)
  grad_op  gradients and optimizer state sharded, parameters kept from forward to backward
           (ZeRO-2): SHARD_GRAD_OP, or reshard_after_forward=False
  hybrid   full sharding inside a node, replication across nodes: HYBRID_SHARD, or a 2-D
           (replicate, shard) mesh
NO_SHARD is deprecated upstream: for replicated training, use DDP (--strategy ddp).

Mixed precision: compute in bf16/fp16, reduce gradients in fp32 (as DDP under autocast does;
precision.py). What the step does differently under each wrapper: `gradient_sync` (micro-batches
accumulated without reducing), `clip_gradients` (FSDP1's flat shards) and `reshard` (FSDP2's
units left gathered).
"""

import contextlib
import socket
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy

import distributed_utils
from model import own_units
from precision import low_precision
from utils import UsageError

SHARDING = {
    "full": ShardingStrategy.FULL_SHARD,
    "grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
}


def check_ranks_by_node(ranks_per_node: int) -> None:
    """Hybrid sharding shards within a node over the mesh's rows: ranks 0..k-1 must share a
    node, then k..2k-1, ... (srun's and torchrun's default block layout), not cyclic."""
    hosts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    for rank, host in enumerate(hosts):
        first = hosts[rank - rank % ranks_per_node]
        if host != first:
            raise UsageError(
                f"hybrid sharding needs ranks laid out in blocks of "
                f"{ranks_per_node} per node, but rank {rank} runs on {host} and "
                f"rank {rank - rank % ranks_per_node} on {first}: use srun's "
                "default (block) distribution"
            )


def hybrid_mesh(device: torch.device, ranks_per_node: int | None) -> DeviceMesh:
    """A (replicate, shard) mesh: one row per node. Explicit, because FSDP's own guess of the
    node size counts GPUs, which is wrong on CPU and under --gpus-per-task=1."""
    world = torch.distributed.get_world_size()
    if not ranks_per_node or world % ranks_per_node:
        raise UsageError(
            f"hybrid sharding needs equal ranks per node; world size {world}, "
            f"ranks per node {ranks_per_node}"
        )
    check_ranks_by_node(ranks_per_node)
    mesh = torch.arange(world).view(world // ranks_per_node, ranks_per_node)
    # Groups of our own, with --pg-timeout: init_device_mesh's would get the backend default.
    replicate = distributed_utils.subgroups(mesh.t().tolist())  # one rank of each node
    shard = distributed_utils.subgroups(mesh.tolist())  # the ranks of one node
    return DeviceMesh.from_group(
        [replicate, shard], device.type, mesh, mesh_dim_names=("replicate", "shard")
    )


def get_fsdp_model(
    model: nn.Module,
    device: torch.device,
    sharding: str = "full",
    precision: str = "fp32",
    cpu_offload: bool = False,
    ranks_per_node: int | None = None,
) -> FSDP:
    """FSDP1: the wrap policy makes each of `own_units` an FSDP unit."""
    units = {id(unit) for unit in own_units(model)}
    dtype = low_precision(precision)
    with warnings.catch_warnings():
        # At world size 1 FSDP runs NO_SHARD whatever was asked, and warns so on stderr: the
        # sweep's 1-GPU FSDP baseline is that on purpose, and its [METRIC] line says so
        # (sharding=no_shard, effective_sharding).
        warnings.filterwarnings(
            "ignore", message="FSDP is switching to use `NO_SHARD`", category=UserWarning
        )
        # exercise 4.2 begin
        return FSDP(
            model,
            auto_wrap_policy=CustomPolicy(lambda module: id(module) in units),
            sharding_strategy=SHARDING[sharding],
            mixed_precision=MixedPrecision(
                param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype
            )
            if dtype
            else None,
            cpu_offload=CPUOffload(offload_params=cpu_offload),
            # Also on CPU: without device_id, FSDP in torch 2.14 demands an accelerator.
            device_id=device,
            device_mesh=hybrid_mesh(device, ranks_per_node) if sharding == "hybrid" else None,
            # Expose the original parameters (as views of the shards): torch.compile needs it,
            # and the optimizer then sees per-layer tensors.
            use_orig_params=True,
        )
        # exercise 4.2 end


def get_fsdp2_model(
    model: nn.Module,
    device: torch.device,
    sharding: str = "full",
    precision: str = "fp32",
    cpu_offload: bool = False,
    ranks_per_node: int | None = None,
) -> nn.Module:
    """FSDP2: fully_shard each of `own_units`, then the root (which holds what no unit does)."""
    # exercise 4.2 twin begin
    world = torch.distributed.get_world_size()
    mesh = (
        hybrid_mesh(device, ranks_per_node)
        if sharding == "hybrid"
        else init_device_mesh(device.type, (world,))
    )
    dtype = low_precision(precision)
    options = dict(
        mesh=mesh,
        reshard_after_forward=sharding != "grad_op",
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype
        else MixedPrecisionPolicy(),
        offload_policy=CPUOffloadPolicy() if cpu_offload else None,
    )
    options = {k: v for k, v in options.items() if v is not None}
    model = model.to(device)
    for unit in own_units(model):
        fully_shard(unit, **options)
    # Backward needs the root's parameters first: keep them (as FSDP1 always does; FSDP2 has
    # resharded a root told True since torch 2.8).
    fully_shard(model, **{**options, "reshard_after_forward": False})
    return model
    # exercise 4.2 twin end


def effective_sharding(model: nn.Module, sharding: str) -> str:
    """The sharding really applied, for the [METRIC] line: at world size 1 FSDP holds everything
    whatever was asked (NO_SHARD), a DDP-like baseline. Not FSDP: `replicate`."""
    root = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(root, FSDP):
        names = {strategy: name for name, strategy in SHARDING.items()}
        return names.get(root.sharding_strategy, root.sharding_strategy.name.lower())
    if isinstance(root, FSDPModule):
        return "no_shard" if torch.distributed.get_world_size() == 1 else sharding
    return "replicate"


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
    """Scale the gradients so that their norm over all ranks and shards is at most max_norm:
    FSDP1's flat shards need its own method; DDP's are whole, FSDP2's DTensors whose norm
    torch's function takes over all shards."""
    root = getattr(model, "_orig_mod", model)
    if isinstance(root, FSDP):
        return root.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def reshard(model: nn.Module) -> None:
    """Free the parameters every FSDP2 unit holds gathered (FSDPModule.reshard is not
    recursive). Other wrappers hold nothing between steps."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
