"""The optimizer and the learning-rate schedule a run trains with (--optimizer, --lr,
--lr-schedule, --warmup-epochs), built as the step needs them: fused or foreach kernels, and
a learning rate a CUDA graph can read (--cuda-graphs).

Both keep the form this run built them in when a checkpoint of any kind of run is loaded into
them: torch's load_state_dict would take the writer's settings along, and a graphed run resumed
from an eager checkpoint would fail at its capture (`capturable` False) or read a rate that its
schedule no longer writes.
"""

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from config import Config, scheduled

# What a parameter group keeps of its own when a checkpoint is loaded into it, whichever run
# wrote it: how the optimizer steps, decided for this run's device and graph (make_optimizer),
# and the rate its schedule started from (the scheduler's, saved with the scheduler's state).
KEPT_ON_RESUME = ("capturable", "differentiable", "foreach", "fused", "initial_lr")


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """--optimizer: Adam, or SGD with momentum 0.9. Fused (one kernel for every parameter) where
    torch has it for the parameters, else foreach (one per operation over all of them): torch's
    default on a CPU is a loop of about ten operations per parameter and step. FSDP2's DTensor
    parameters have sharding rules for fused Adam (since torch 2.4), not for fused SGD (whose
    foreach kernels read a tensor rate on the host: feasibility.graph_refusal)."""
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
            return keep_as_built(optimizer(params, lr=lr, fused=True, **options))
        except RuntimeError:  # parameters on a device without fused kernels
            pass
    return keep_as_built(optimizer(params, lr=lr, foreach=True, **options))


def keep_as_built(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer, made to keep its own ways through every load_state_dict (DCP's
    set_state_dict ends in it for every wrapper): KEPT_ON_RESUME stay as built, and the
    checkpoint's rate is written into this run's own object (the tensor a CUDA graph reads, or
    a number). Torch's load then puts the step counts where this run's settings put them."""
    own: list[dict] = []  # the groups as they stood before the load

    def settings_as_built(optimizer, state_dict: dict) -> dict:
        own[:] = [dict(group) for group in optimizer.param_groups]
        state_dict["param_groups"] = [
            {**saved, **{key: mine[key] for key in KEPT_ON_RESUME if key in mine}}
            for saved, mine in zip(state_dict["param_groups"], own, strict=True)
        ]
        return state_dict

    def rate_as_built(optimizer) -> None:
        for group, mine in zip(optimizer.param_groups, own, strict=True):
            group["lr"] = in_form_of(mine["lr"], group["lr"])

    optimizer.register_load_state_dict_pre_hook(settings_as_built)
    optimizer.register_load_state_dict_post_hook(rate_as_built)
    return optimizer


def in_form_of(mine: float | torch.Tensor, value: float | torch.Tensor) -> float | torch.Tensor:
    """A rate restored (a number, or a tensor as a checkpoint loads it) in this run's form:
    written into this run's own tensor, else a number."""
    return mine.fill_(value) if torch.is_tensor(mine) else float(value)


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose rates, loaded from a checkpoint, keep this run's form: a graphed run's
    writer saves them as tensors, which would turn an eager run's rate into one."""

    def load_state_dict(self, state_dict: dict) -> None:
        own = {key: getattr(self, key) for key in ("base_lrs", "_last_lr")}
        super().load_state_dict(state_dict)
        for key, mine in own.items():
            setattr(self, key, list(map(in_form_of, mine, getattr(self, key))))


def make_scheduler(
    cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int
) -> Schedule | None:
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

    return Schedule(optimizer, factor)
