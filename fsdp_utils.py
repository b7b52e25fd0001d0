"""FullyShardedDataParallel: each rank stores only 1/world_size of parameters, gradients and
optimizer state.

FSDP wraps every block named by the wrap policy (model.SHARDABLE_BLOCKS: the conv blocks and
the classifier) as its own unit. Just before a unit runs, its full parameters are all-gathered;
right after, they are freed again; in backward, gradients are reduce-scattered so each rank keeps
the shard it owns. Peak memory is one unit's full parameters plus this rank's shards, bought with
more communication than DDP: worth it for models too large for one GPU, not for this small CNN.

Sharding strategies:
  full     (FULL_SHARD)    parameters, gradients and optimizer state sharded (ZeRO-3)
  grad_op  (SHARD_GRAD_OP) gradients and optimizer state sharded, parameters kept after forward
  hybrid   (HYBRID_SHARD)  full sharding inside a node, replication across nodes
NO_SHARD is deprecated upstream: for replicated training, use DDP (--strategy ddp).
"""

import socket

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from model import SHARDABLE_BLOCKS
from utils import UsageError

SHARDING = {
    "full": ShardingStrategy.FULL_SHARD,
    "grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
}

# The compute dtype of each --precision (tf32 is fp32 storage with TF32 matrix math on GPUs).
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}


def mixed_precision(precision: str) -> MixedPrecision | None:
    """Compute in the low precision; reduce gradients in fp32, as DDP does under autocast (its
    parameters, hence gradients, stay fp32), so that one --precision means the same numerics
    and the same bytes on the wire for both strategies. The optimizer's master copy of the
    (sharded) parameters stays fp32."""
    dtype = DTYPES[precision]
    if dtype == torch.float32:
        return None
    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)


def effective_sharding(model: nn.Module) -> str:
    """The sharding FSDP really applies: at world size 1 it falls back to NO_SHARD, whatever
    was asked, so a 1-GPU FSDP baseline is DDP-like."""
    root = getattr(model, "_orig_mod", model)  # under torch.compile
    if not isinstance(root, FSDP):
        return "replicate"
    names = {strategy: name for name, strategy in SHARDING.items()}
    return names.get(root.sharding_strategy, root.sharding_strategy.name.lower())


def check_ranks_by_node(ranks_per_node: int, device: torch.device) -> None:
    """Hybrid sharding shards within a node over the mesh's rows: ranks 0..k-1 must share a
    node, then k..2k-1, and so on (srun's and torchrun's default block layout). A cyclic
    layout (srun --distribution=cyclic) would shard across the network instead: refuse it."""
    hosts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    for rank, host in enumerate(hosts):
        first = hosts[rank - rank % ranks_per_node]
        if host != first:
            raise UsageError(f"hybrid sharding needs ranks laid out in blocks of "
                             f"{ranks_per_node} per node, but rank {rank} runs on {host} and "
                             f"rank {rank - rank % ranks_per_node} on {first}: use srun's "
                             "default (block) distribution")


def get_fsdp_model(model: nn.Module, device: torch.device, sharding: str = "full",
                   precision: str = "fp32", cpu_offload: bool = False,
                   ranks_per_node: int | None = None) -> FSDP:
    mesh = None
    if sharding == "hybrid":
        # Explicit (replicate, shard) mesh: FSDP's own guess of the node size counts GPUs,
        # which is wrong on CPU and under --gpus-per-task=1.
        world = torch.distributed.get_world_size()
        if not ranks_per_node or world % ranks_per_node:
            raise UsageError(f"hybrid sharding needs equal ranks per node; world size {world}, "
                             f"ranks per node {ranks_per_node}")
        check_ranks_by_node(ranks_per_node, device)
        mesh = init_device_mesh(device.type, (world // ranks_per_node, ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(SHARDABLE_BLOCKS),
        sharding_strategy=SHARDING[sharding],
        mixed_precision=mixed_precision(precision),
        cpu_offload=CPUOffload(offload_params=cpu_offload),
        # Also on CPU: without device_id, FSDP in torch 2.14 demands an accelerator.
        device_id=device,
        device_mesh=mesh,
        # Expose the original parameters (as views of the shards): torch.compile needs it,
        # and the optimizer then sees per-layer tensors.
        use_orig_params=True,
    )
