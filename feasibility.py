"""Can this configuration run here, and if not, why: one answer, in one line, for `main.py
--check` (one process, at each world size it is asked about, loading no wrapper) and for every
rank before it builds its model (session.build_trainer).

The first refusal answers, in this order: the world (config.world_refusal: one process for a
one-process baseline, a pipeline's cuts, the options one strategy takes, the global batch's
split, the data; no torch needed), the precision (precision.refusal: the strategy's and the
device's), the options the device cannot do (here), an explicit --cuda-graphs
(cuda_graphs.refusal).
"""

import torch

import cuda_graphs
import precision
from config import Config, world_refusal
from utils import UsageError


def check(cfg: Config, world_sizes: list[int], train_size: int, device: torch.device) -> None:
    """Refuse a configuration that cannot run here in one line (refusal)."""
    if why := refusal(cfg, world_sizes, train_size, device):
        raise UsageError(why)


def refusal(
    cfg: Config, world_sizes: list[int], train_size: int, device: torch.device
) -> str | None:
    """Why this configuration cannot run at each of world_sizes ranks with train_size training
    images on device, the first reason found; None where it can."""
    for world_size in world_sizes:
        if why := world_refusal(cfg, world_size, train_size):
            return why
    if why := precision.refusal(cfg.precision, cfg.strategy, device):
        return why
    if cfg.cpu_offload and device.type != "cuda":
        return (
            "--cpu-offload moves FSDP's shards from the GPU to the CPU; "
            "without a GPU they are on the CPU already"
        )
    if cfg.sync_bn and device.type != "cuda":
        return "--sync-bn needs GPUs: torch's SyncBatchNorm does not run on the CPU"
    if cfg.cuda_graphs and (why := cuda_graphs.refusal(cfg, device)):
        return f"--cuda-graphs: {why}"
    return None
