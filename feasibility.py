"""Can this configuration run here, and if not, why: one answer, in one line, for `main.py
--check` (one process, at each world size it is asked about, loading no wrapper) and for every
rank before it builds its model (session.build_trainer); and whether its step is one CUDA graph
by default here.

The first refusal answers, in this order: the world (config.world_refusal: one process for a
one-process baseline, a pipeline's cuts, the options one strategy takes, the global batch's
split, the data; no torch needed), the precision (the strategy's and the device's), the options
the device cannot do, an explicit --cuda-graphs (graph_refusal).

CUDA graphs (cuda_graphs.py) are the default on a GPU wherever they apply and a GPU run has
shown them (docs/gpu-runs/2026-11-26-h200: graphed DDP at one rank trains as eager, 0.17-0.19 s
an epoch against 0.45-0.53 s; docs/performance.md): one rank, not yet two or more. Elsewhere the
run is eager and its [CONFIG] note says why (decide_graphs); --no-cuda-graphs turns them off.
"""

import torch
import torch.distributed as dist

from config import (
    CAPTURABLE,
    CAPTURED_SINCE,
    DTENSOR_PARAMETERS,
    STAGED,
    Config,
    scheduled,
    world_refusal,
)
from precision import LOSS_SCALED, MIXED
from utils import UsageError, release


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
    if cfg.strategy in STAGED and cfg.precision in MIXED:
        # A pipeline's stages (pipeline_utils) run neither autocast nor a loss scaler.
        return f"--strategy {cfg.strategy}: --precision: fp32 or tf32 only"
    gpu = device.type == "cuda"
    if cfg.precision == "bf16" and gpu and torch.cuda.is_available():
        if not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            return f"bf16 is not supported on {name}; use --precision fp16 or fp32"
    if cfg.cpu_offload and not gpu:
        return (
            "--cpu-offload moves FSDP's shards from the GPU to the CPU; "
            "without a GPU they are on the CPU already"
        )
    if cfg.sync_bn and not gpu:
        return "--sync-bn needs GPUs: torch's SyncBatchNorm does not run on the CPU"
    if cfg.cuda_graphs and (why := graph_refusal(cfg, device)):
        return f"--cuda-graphs: {why}"
    return None


def graph_refusal(cfg: Config, device: torch.device) -> str | None:
    """Why the step of this run cannot be one CUDA graph, and what to do; None where it can.
    A graph replays the same kernels on the same addresses: nothing may be decided on the host
    between them (a learning-rate schedule writes its rate into a device tensor between
    replays: optim.make_optimizer)."""
    if device.type != "cuda":
        return "a CUDA graph records GPU kernels: it needs a GPU (leave the option out on a CPU)"
    if cfg.strategy not in CAPTURABLE:
        return (
            f"--strategy {cfg.strategy} cannot be captured (FSDP1 gathers and frees each unit "
            "from hooks that wait on the host; dp copies the model at every step; a pipeline's "
            "schedule and model parallelism's moves are decided on the host): use "
            f"{', '.join(CAPTURABLE)}"
        )
    if cfg.cpu_offload:
        return "--cpu-offload copies the parameters between host and GPU around every step"
    name = cfg.strategy.upper()
    since = CAPTURED_SINCE.get(cfg.strategy, ())
    if release(torch.__version__) < since:
        return (
            f"torch captures {name}'s step from {'.'.join(map(str, since))} on "
            f"(this is {torch.__version__})"
        )
    foreach_sgd = cfg.strategy in DTENSOR_PARAMETERS and cfg.optimizer == "sgd"
    if foreach_sgd and scheduled(cfg):
        # foreach SGD takes a tensor rate as `alpha=-lr`: a host read (torch/optim/sgd.py).
        return (
            f"{name}'s SGD (foreach: torch has no fused SGD for sharded parameters) reads a "
            "scheduled rate on the host at every step: use --optimizer adam, or a constant rate"
        )
    if foreach_sgd and cfg.precision in LOSS_SCALED:
        # GradScaler hands a fused optimizer its inf check as a device tensor, any other steps
        # only after reading it on the host (torch/amp/grad_scaler.py, _maybe_opt_step).
        return (
            f"{cfg.precision}'s gradient scaler reads {name}'s SGD's inf check on the host "
            "(foreach: torch has no fused SGD for sharded parameters): use --optimizer adam, "
            "or --precision bf16"
        )
    if cfg.compile:
        return "torch.compile makes CUDA graphs of its own (mode='reduce-overhead'): use one"
    if cfg.loader == "classic" and cfg.num_workers > 0:
        # DataLoader's workers pin each batch in a thread of their own (pin_memory.py), also
        # during a capture, whose default (global) mode forbids that thread's CUDA calls (the host
        # allocator's process_events). Without workers the loop's own thread pins, between steps.
        return (
            "--loader classic pins batches in a thread of its own, whose CUDA calls a capture "
            "forbids: use --loader tensor (or --num-workers 0)"
        )
    backend = str(dist.get_backend()) if dist.is_initialized() else "nccl"
    if dist.is_initialized() and dist.get_world_size() > 1 and "nccl" not in backend:
        return f"{backend}'s collectives cannot be captured in a CUDA graph (NCCL's can)"
    return None


# What a GPU run has shown captured (docs/gpu-runs/2026-11-26-h200*): the default graphs only
# these; anything else runs eager unless --cuda-graphs asks for it. One rank: no run has
# captured a collective between GPUs (the GPU tests' two ranks share one GPU over gloo, which
# refuses graphs; torch's own tests capture a bare all-reduce, no DDP step). FSDP2's capture
# waits behind an explicit --cuda-graphs (tests/test_gpu.py holds the proof to run).
SHOWN_STRATEGIES = ("single", "ddp")
SHOWN_MODELS = ("cnn", "resnet18")
SHOWN_WORLD_SIZE = 1


def not_yet_shown(cfg: Config, world_size: int) -> str | None:
    """Why a capturable run still runs eager by default: a part of it no GPU run has captured."""
    if cfg.strategy not in SHOWN_STRATEGIES:
        return f"--strategy {cfg.strategy}"
    if world_size > SHOWN_WORLD_SIZE:
        return f"{cfg.strategy.upper()}'s communication across {world_size} GPUs"
    if cfg.model not in SHOWN_MODELS:
        return f"--model {cfg.model}"
    if cfg.precision in LOSS_SCALED:
        return f"{cfg.precision}'s gradient scaler"
    if scheduled(cfg):
        return "a learning-rate schedule"
    if cfg.loader == "classic":
        return "--loader classic"
    if cfg.grad_accum > 1:
        return "--grad-accum"
    if cfg.clip_grad is not None:
        return "--clip-grad"
    if cfg.sync_bn:
        return "--sync-bn"
    return None


def decide_graphs(cfg: Config, device: torch.device, world_size: int) -> tuple[bool, str | None]:
    """Whether the step of this run, at world_size ranks, is one CUDA graph and, where the
    default leaves it eager, why. An explicit --cuda-graphs that cannot apply is refused
    (refusal)."""
    if cfg.cuda_graphs is not None:
        return cfg.cuda_graphs, None
    if device.type != "cuda":
        return False, None
    why = graph_refusal(cfg, device)
    if why is None and (unshown := not_yet_shown(cfg, world_size)):
        why = f"{unshown} has not yet run captured on a GPU (--cuda-graphs asks for it)"
    return why is None, why


def describe_graphs(cfg: Config, device: torch.device, world_sizes: list[int]) -> str:
    """`main.py --check`'s word on the step at each world size (the default may differ between
    them), one phrase where they agree."""
    said = {}
    for size in world_sizes:
        graphed, why = decide_graphs(cfg, device, size)
        said[size] = "one CUDA graph" if graphed else f"eager ({why})" if why else "eager"
    if len(set(said.values())) == 1:
        return said[world_sizes[0]]
    return "; ".join(f"at world size {size}: {says}" for size, says in said.items())
