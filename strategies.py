"""How each `--strategy` runs: the wrapper that makes one rank's model data-parallel (DDP or
DataParallel from ddp_utils.py, FSDP1 or FSDP2 from fsdp_utils.py, or none) or cuts it into
parts (a pipeline stage from pipeline_utils.py, or model_parallel.py's parts on consecutive
GPUs). How a step of it runs at a `--precision` is precision.py's to say; whether it can run
here is feasibility.py's: `main.py --check` asks that without loading the wrappers.

The names of the strategies and their traits (which shard, which capture as a CUDA graph, ...)
are config.py's; this module only maps them to the code that runs them, so that adding a
strategy touches config.py (its name and traits) and this file.
"""

import contextlib

import torch

from config import ONE_PROCESS, Config
from cuda_graphs import side_stream
from ddp_utils import get_ddp_model, get_dp_model
from fsdp_utils import get_fsdp2_model, get_fsdp_model
from model_parallel import ModelParallel, get_model_parallel

# What a training step of each strategy waits on its peers in: a rank's last words (say_where)
# before it died or hung name it.
STEP_COLLECTIVES = {
    "ddp": "DDP's gradient all-reduces",
    "fsdp": "FSDP's all-gathers and reduce-scatters",
    "fsdp2": "FSDP2's all-gathers and reduce-scatters",
    "pipeline": "the pipeline's sends and receives of activations and gradients",
    **dict.fromkeys(ONE_PROCESS, "a step of one process"),
}


def wrap_model(
    cfg: Config,
    model: torch.nn.Module,
    device: torch.device,
    rank: int,
    world_size: int,
    nodes: int,
) -> torch.nn.Module:
    """The model as --strategy trains it on this rank: in --channels-last memory format,
    with synchronized BatchNorm (--sync-bn), wrapped, and compiled (--compile)."""
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    shard = dict(
        sharding=cfg.sharding,
        precision=cfg.precision,
        cpu_offload=cfg.cpu_offload,
        ranks_per_node=world_size // nodes,
    )
    # A step captured as a CUDA graph must find none of the wrapper's set-up on the default stream.
    built_aside = side_stream(device) if cfg.cuda_graphs else contextlib.nullcontext()
    if cfg.strategy == "ddp":
        with built_aside:
            # exercise 5.1 begin
            model = get_ddp_model(model, device)
            # exercise 5.1 end
    elif cfg.strategy == "fsdp":
        # exercise 5.1 begin
        model = get_fsdp_model(model, device, **shard)
        # exercise 5.1 end
    elif cfg.strategy == "fsdp2":
        with built_aside:
            model = get_fsdp2_model(model, device, **shard)
    elif cfg.strategy == "pipeline":
        from pipeline_utils import get_stage_model  # see session.trainer_class

        model = get_stage_model(model, device, rank, world_size)
    elif cfg.strategy == "model":
        model = get_model_parallel(model, device)
    elif cfg.strategy == "dp":
        model = get_dp_model(model, device)
    else:  # single
        model = model.to(device)
    return compiled(cfg, model)


def compiled(cfg: Config, model: torch.nn.Module) -> torch.nn.Module:
    """The model as --compile runs it (the compute calibration's copy too)."""
    return torch.compile(model) if cfg.compile else model


def devices_per_rank(model: torch.nn.Module) -> int:
    """The devices one rank computes on, as its wrapper drives them: DataParallel every visible
    GPU from its one process (none listed on a CPU: the CPU), model parallelism those its parts
    went to; every other wrapper one device per rank."""
    root = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(root, torch.nn.DataParallel):
        return max(1, len(root.device_ids))
    if isinstance(root, ModelParallel):
        return len(root.devices)
    return 1
