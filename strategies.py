"""How each `--strategy` runs: the wrapper that makes one rank's model data-parallel (DDP or
DataParallel from ddp_utils.py, FSDP1 or FSDP2 from fsdp_utils.py, or none) or cuts it into
parts (a pipeline stage from pipeline_utils.py, or model_parallel.py's parts on consecutive
GPUs), how a step of it runs at a `--precision`, and what its options need of the device.

The names of the strategies are config.py's; this module only maps them to the code that runs
them, so that adding a strategy touches config.py (its name) and this file.
"""

import contextlib

import torch

import distributed_utils
from config import SHARDED, Config
from cuda_graphs import side_stream
from ddp_utils import get_ddp_model, get_dp_model
from fsdp_utils import get_fsdp2_model, get_fsdp_model, low_precision
from model_parallel import get_model_parallel, usable_devices
from train import Precision
from utils import UsageError

# What a training step of each strategy waits on its peers in: a rank's last words (say_where)
# before it died or hung name it.
STEP_COLLECTIVES = {
    "ddp": "DDP's gradient all-reduces",
    "fsdp": "FSDP's all-gathers and reduce-scatters",
    "fsdp2": "FSDP2's all-gathers and reduce-scatters",
    "pipeline": "the pipeline's sends and receives of activations and gradients",
    "model": "a step of one process",
    "dp": "a step of one process",
    "single": "a step of one process",
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
    if cfg.strategy == "ddp":
        # A step captured as a CUDA graph must find none of DDP's set-up on the default stream.
        with side_stream(device) if cfg.cuda_graphs else contextlib.nullcontext():
            model = get_ddp_model(model, device)
    elif cfg.strategy == "fsdp":
        model = get_fsdp_model(model, device, **shard)
    elif cfg.strategy == "fsdp2":
        model = get_fsdp2_model(model, device, **shard)
    elif cfg.strategy == "pipeline":
        from pipeline_utils import get_stage_model  # see session.trainer_class

        model = get_stage_model(model, device, rank, world_size)
    elif cfg.strategy == "model":
        model = get_model_parallel(model, cfg.model, device)
    elif cfg.strategy == "dp":
        model = get_dp_model(model, device)
    else:  # single
        model = model.to(device)
    return torch.compile(model) if cfg.compile else model


def devices_per_rank(strategy: str, model_name: str, device: torch.device) -> int:
    """The devices one rank computes on: DataParallel drives every visible GPU from its one
    process, model parallelism those its model's parts go to; every other strategy one device
    per rank."""
    if strategy == "dp" and device.type == "cuda":
        return torch.cuda.device_count()
    if strategy == "model":
        return len(usable_devices(model_name, device))
    return 1


def make_precision(
    precision: str, strategy: str, device: torch.device, cuda_graphs: bool = False
) -> Precision:
    """How a step of this strategy runs at this --precision: FSDP casts through its mixed
    precision policy (fsdp_utils); every unsharded model (DDP, DP, single) needs autocast,
    without its cache of cast weights where the step is a CUDA graph (torch's notes: the cache
    would hold tensors of the capture)."""
    fp16 = precision == "fp16"
    if strategy == "fsdp":  # FSDP1's gradients are flat shards: its scaler sees them all
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type, enabled=fp16)
    else:
        scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    autocast = None if strategy in SHARDED else low_precision(precision)
    return Precision(autocast, scaler, cache=not cuda_graphs)


def check_device_options(cfg: Config, device: torch.device) -> None:
    """Options the device cannot do."""
    if (
        cfg.precision == "bf16"
        and device.type == "cuda"
        and torch.cuda.is_available()
        and not torch.cuda.is_bf16_supported()
    ):
        raise UsageError(
            f"bf16 is not supported on {torch.cuda.get_device_name(device)}; "
            "use --precision fp16 or fp32"
        )
    if cfg.cpu_offload and device.type != "cuda":
        raise UsageError(
            "--cpu-offload moves FSDP's shards from the GPU to the CPU; "
            "without a GPU they are on the CPU already"
        )
    if cfg.sync_bn and device.type != "cuda":
        raise UsageError("--sync-bn needs GPUs: torch's SyncBatchNorm does not run on the CPU")
    if cfg.sync_bn and cfg.strategy != "ddp":
        raise UsageError("--sync-bn is for --strategy ddp")
    if cfg.cuda_graphs and (why := cuda_graphs_refusal(cfg, device)):
        raise UsageError(f"--cuda-graphs: {why}")


def cuda_graphs_refusal(cfg: Config, device: torch.device) -> str | None:
    """Why the step of this run cannot be one CUDA graph, and what to do; None where it can.
    A graph replays the same kernels on the same addresses: nothing may be decided on the host
    between them."""
    if device.type != "cuda":
        return "a CUDA graph records GPU kernels: it needs a GPU (leave the option out on a CPU)"
    if cfg.strategy not in ("single", "ddp"):
        return (
            f"--strategy {cfg.strategy} cannot be captured (FSDP gathers and frees each unit "
            "from hooks run on the host; dp copies the model at every step; a pipeline's "
            "schedule and model parallelism's moves are decided on the host): use ddp or single"
        )
    if cfg.precision == "fp16":
        return (
            "fp16's gradient scaler has not been shown to work inside a captured step: use "
            "--precision bf16 (no scaler)"
        )
    if cfg.lr_schedule != "none" or cfg.warmup_epochs:
        return (
            "the graph would keep the first step's learning rate: use a constant one "
            "(--lr-schedule none, --warmup-epochs 0)"
        )
    if cfg.compile:
        return "torch.compile makes CUDA graphs of its own (mode='reduce-overhead'): use one"
    return None


def check_device(cfg: Config) -> tuple[torch.device, str]:
    """The device the run would take here, or, for `--device cuda` checked on a machine without
    a GPU (a login node planning a sweep), a GPU assumed: its model is unknown here."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return torch.device("cuda"), "cuda (no GPU here: bf16 support not checked)"
    device, _ = distributed_utils.pick_device(0, cfg.device)
    return device, device.type
