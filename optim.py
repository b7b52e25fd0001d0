"""The optimizer and the learning-rate schedule a run trains with (--optimizer, --lr,
--lr-schedule, --warmup-epochs), built as the step needs them: fused or foreach kernels, and
a learning rate a CUDA graph can read (--cuda-graphs).
"""

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from config import Config, scheduled


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """--optimizer: Adam, or SGD with momentum 0.9. Fused (one kernel for every parameter) where
    torch has it for the parameters, else foreach (one per operation over all of them): torch's
    default on a CPU is a loop of about ten operations per parameter and step. FSDP2's DTensor
    parameters have sharding rules for fused Adam (since torch 2.4), not for fused SGD (whose
    foreach kernels read a tensor rate on the host: cuda_graphs.refusal)."""
    optimizer, options = (
        (torch.optim.SGD, {"momentum": 0.9}) if cfg.optimizer == "sgd" else (torch.optim.Adam, {})
    )
    params = list(model.parameters())
    lr = cfg.lr
    if cfg.cuda_graphs:
        if optimizer is torch.optim.Adam:
            options["capturable"] = True  # its step count on the device, advanced by the graph
        if scheduled(cfg):
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
    if not scheduled(cfg):
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
