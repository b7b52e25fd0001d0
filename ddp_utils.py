"""DistributedDataParallel: every rank holds the whole model; gradients are averaged.

DDP registers hooks that all-reduce gradient buckets while backward is still running, so
communication overlaps computation. After `optimizer.step()` every replica is identical again,
which is why DDP's per-rank memory does not shrink with more GPUs (FSDP's does).
"""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def get_ddp_model(model: nn.Module, device: torch.device) -> DDP:
    model = model.to(device)
    # On a GPU, name it: DDP then places inputs and its buckets there. On CPU, device_ids=None.
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids)
