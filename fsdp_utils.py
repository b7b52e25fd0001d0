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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision(precision: str) -> MixedPrecision | None:
    """Compute, communicate and keep buffers in the low precision; the optimizer's master
    copy of the (sharded) parameters stays fp32."""
    if precision == "fp32":
        return None
    dtype = DTYPES[precision]
    return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)


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
