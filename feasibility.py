"""Can this configuration run here, and if not, why: one answer, in one line, for `main.py
--check` (one process, at each world size it is asked about, loading no wrapper) and for every
rank before it builds its model (session.build_trainer).

The first refusal answers, in this order: the world (one process for a one-process baseline, a
pipeline's cuts, the options one strategy takes, the global batch's split, the data), then the
device (the precision it computes in, the options it cannot do, an explicit --cuda-graphs).
The world's rules are here (the strategies' traits they read are config.py's); which precision
a device computes in is precision.py's to say, and what a CUDA graph captures cuda_graphs.py's.
"""

import torch

import cuda_graphs
import precision
from config import (
    ONE_PROCESS,
    STAGED,
    STRATEGY_OPTIONS,
    Config,
    data_world,
    microbatches,
    option_flag,
    pipeline_cut,
    pipeline_world_sizes,
)
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
    return device_refusal(cfg, device)


def world_refusal(cfg: Config, world_size: int, train_size: int) -> str | None:
    """What world_size ranks and train_size training images cannot do: the checks that need the
    launcher's world size and the data, not the device."""
    if cfg.strategy in ONE_PROCESS and world_size > 1:
        return (
            f"--strategy {cfg.strategy} drives every device from one process; "
            f"start one process (python main.py), not {world_size}"
        )
    if cfg.strategy in STAGED and (why := pipeline_refusal(cfg, world_size)):
        return why
    for name, strategy in STRATEGY_OPTIONS.items():
        if getattr(cfg, name) and cfg.strategy != strategy:
            return f"{option_flag(name)} is for --strategy {strategy}"
    shards = data_world(cfg.strategy, world_size)
    if cfg.batch_size < shards or cfg.batch_size % shards:
        return (
            f"global batch size {cfg.batch_size} must be a multiple of the world "
            f"size {shards} (each rank gets an equal share)"
        )
    if (cfg.batch_size // shards) % cfg.grad_accum:
        return (
            f"each rank's {cfg.batch_size // shards} images per step do not "
            f"split into --grad-accum {cfg.grad_accum} equal micro-batches"
        )
    if train_size < cfg.batch_size:
        return f"{train_size} training images make no full global batch of {cfg.batch_size}"
    return None


def pipeline_refusal(cfg: Config, world_size: int) -> str | None:
    """Why --strategy pipeline cannot run this way on world_size ranks, or None."""
    if world_size not in pipeline_world_sizes(cfg.model):
        return f"{pipeline_cut(cfg.model)}, not {world_size}"
    m = microbatches(cfg, world_size)
    if cfg.batch_size % m:
        return f"global batch size {cfg.batch_size} does not split into {m} equal micro-batches"
    if cfg.schedule == "1f1b" and m < world_size:
        return f"--schedule 1f1b needs at least one micro-batch per stage: {m} < {world_size}"
    unsupported = {
        "--grad-accum": cfg.grad_accum > 1 and "use --microbatches",
        "--precision": precision.low_precision(cfg.precision) is not None and "fp32 or tf32 only",
        "--compile": cfg.compile and "not with pipeline stages",
    }
    return next((f"--strategy pipeline: {k}: {why}" for k, why in unsupported.items() if why), None)


def device_refusal(cfg: Config, device: torch.device) -> str | None:
    """What the device cannot do of these options. `main.py --check` asks it of the device the
    run would take (distributed_utils.check_device), every rank of its own."""
    if why := precision.device_refusal(cfg.precision, device):
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
