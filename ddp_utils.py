"""DistributedDataParallel: every rank holds the whole model; gradients are averaged. And its
one-process ancestor, DataParallel, kept as a baseline.

DDP registers hooks that all-reduce gradient buckets while backward is still running, so
communication overlaps computation. After `optimizer.step()` every replica is identical again,
which is why DDP's per-rank memory does not shrink with more GPUs (FSDP's does).
"""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from utils import log0


def get_ddp_model(model: nn.Module, device: torch.device) -> DDP:
    # exercise 4.1 begin
    model = model.to(device)
    # On a GPU, name it: DDP then places inputs and its buckets there. On CPU, device_ids=None.
    device_ids = [device.index] if device.type == "cuda" else None
    # Gradients as views into DDP's all-reduce buckets: one gradient-sized buffer less, and no
    # copy back from the buckets. The copy into them stays: zero_grad(set_to_none=True) makes
    # backward produce fresh gradients each step (docs/performance.md, On one H100).
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    # exercise 4.1 end


def get_dp_model(model: nn.Module, device: torch.device) -> nn.Module:
    """DataParallel, what DDP replaces: one process scatters each batch over every visible GPU,
    replicates the model at every forward and gathers the outputs on the first, a Python thread
    per GPU contending for the interpreter's lock. Without GPUs: the CPU as one device."""
    model = model.to(device)
    if device.type != "cuda":
        log0("dp: no GPU here: DataParallel runs the model on the CPU as one device")
        return nn.DataParallel(model, device_ids=[])
    return nn.DataParallel(model)
