"""--cuda-graphs: the whole training step as one CUDA graph, replayed once per step.

A small model's step is host-bound on a GPU: its forward, backward, gradient all-reduce and
optimizer launch about a hundred kernels, each microseconds of GPU work that the Python
interpreter and the launch path take longer to issue. A CUDA graph records the kernels of one
step once; each later step is a single launch. What the step reads and writes must then stay
at the same addresses, so the step reads its batch from static buffers (one copy a step) and
adds its loss to one accumulator the trainer keeps for the whole run.

Following torch's notes on CUDA graphs (torch.cuda.graph; "Usage with
DistributedDataParallel"): DDP is built on a side stream, the first WARMUP_STEPS steps run
eagerly on that stream (DDP's lazy buckets, the optimizer's state, cuDNN's algorithm choice),
the capture too, and the optimizer keeps its step count on the device (`capturable=True`).
These warm-up steps are real training steps, so a graphed run trains the same steps as an eager
one.

FSDP2 is built on that side stream too, and its step captured the same way (torch 2.11 or
newer): its hooks queue each unit's all-gather and reduce-scatter on streams of its own, which
the capture records with the compute. A replay runs none of those hooks, so whatever runs the
model eagerly between replays must leave every unit sharded, as the capture found it
(validation does: train.Trainer.evaluate). No GPU has run that yet: it waits behind an explicit
--cuda-graphs (tests/test_gpu.py holds the proof to run).

Run on one H200 (docs/gpu-runs/2026-11-26-h200): graphed DDP runs at one rank train as eager
ones, resume and stop exactly, and an epoch of 50,000 images at batch 256 takes 0.17-0.19 s
against 0.45-0.53 s eager (docs/performance.md). So on a GPU it is the default wherever it
applies and a GPU run has shown it (`decide`: one rank, not yet two or more; --no-cuda-graphs
turns it off); elsewhere the run is eager and its [CONFIG] note says why. Where an explicit
--cuda-graphs cannot apply, `refusal` says why, and `main.py --check` and every rank refuse the
run (feasibility.py).
"""

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from config import CAPTURABLE, CAPTURED_SINCE, DTENSOR_PARAMETERS, Config, scheduled
from precision import LOSS_SCALED
from utils import release

# torch's notes: DDP needs at least 11 eager iterations before its backward can be captured.
WARMUP_STEPS = 11


def refusal(cfg: Config, device: torch.device) -> str | None:
    """Why the step of this run cannot be one CUDA graph, and what to do; None where it can.
    A graph replays the same kernels on the same addresses: nothing may be decided on the host
    between them (a learning-rate schedule writes its rate into a device tensor between
    replays: make_optimizer)."""
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
        # torch has no sharding rule for fused SGD on DTensors (optim.make_optimizer), and
        # foreach SGD takes a tensor rate as `alpha=-lr`: a host read (torch/optim/sgd.py).
        return (
            f"{name}'s SGD (foreach: torch has no fused SGD for sharded parameters) reads a "
            "scheduled rate on the host at every step: use --optimizer adam, or a constant rate"
        )
    if foreach_sgd and cfg.precision in LOSS_SCALED:
        # GradScaler hands a fused optimizer its inf check as a device tensor; it steps any
        # other only after reading the check on the host (torch/amp/grad_scaler.py,
        # _maybe_opt_step).
        return (
            f"{cfg.precision}'s gradient scaler reads {name}'s SGD's inf check on the host "
            "(foreach: torch has no fused SGD for sharded parameters): use --optimizer adam, "
            "or --precision bf16"
        )
    if cfg.compile:
        return "torch.compile makes CUDA graphs of its own (mode='reduce-overhead'): use one"
    if cfg.loader == "classic" and cfg.num_workers > 0:
        # With workers, DataLoader pins each batch in a thread of its own (utils/data/
        # _utils/pin_memory.py), also while the step is captured, and the host allocator then
        # queries CUDA events (ATen/core/CachingHostAllocator.h, process_events): a call from
        # another thread that a capture in torch's default (global) mode forbids. Without
        # workers the loop's own thread pins, between steps.
        return (
            "--loader classic pins batches in a thread of its own, whose CUDA calls a capture "
            "forbids: use --loader tensor (or --num-workers 0)"
        )
    backend = str(dist.get_backend()) if dist.is_initialized() else "nccl"
    if dist.is_initialized() and dist.get_world_size() > 1 and "nccl" not in backend:
        return f"{backend}'s collectives cannot be captured in a CUDA graph (NCCL's can)"
    return None


# What a GPU run has shown captured (docs/gpu-runs/2026-11-26-h200*): the default graphs only
# these; anything else runs eager unless --cuda-graphs asks for it, until a GPU run shows it.
# One rank: no run has captured a collective between GPUs (the GPU tests' two ranks share one
# GPU over gloo, which refuses graphs; torch's own tests capture a bare all-reduce, no DDP step).
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


def decide(cfg: Config, device: torch.device, world_size: int) -> tuple[bool, str | None]:
    """Whether the step of this run, at world_size ranks, is one CUDA graph and, where the
    default (on a GPU, graphed wherever it applies and has been shown to) leaves it eager, why.
    An explicit --cuda-graphs that cannot apply is refused elsewhere (feasibility.py)."""
    if cfg.cuda_graphs is not None:
        return cfg.cuda_graphs, None
    if device.type != "cuda":
        return False, None
    why = refusal(cfg, device)
    if why is None and (unshown := not_yet_shown(cfg, world_size)):
        why = f"{unshown} has not yet run captured on a GPU (--cuda-graphs asks for it)"
    return why is None, why


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def side_stream(device: torch.device):
    """Run the block on the device's one side stream, which the current stream then waits for
    (capture must not find the work of warm-up or construction pending on the default stream).
    One stream for DDP's construction, every warm-up step and the capture: autograd keeps
    DDP's gradient accumulators on the stream they were made on, and a step on another stream
    would keep each earlier step's graph alive (65 MB a warm-up step at batch 256, measured:
    docs/gpu-runs/2026-11-26-h200-session) and warn. On a CPU: the block as it is."""
    if device.type != "cuda":
        yield
        return
    current, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


class GraphedStep:
    """A training step `step(images, labels, loss_sum)` fed from static buffers: eager for the
    first `warmup` steps, then captured once and replayed for every step after. With
    capture=False it stays eager (the static-buffer step alone: on a CPU, where the tests
    compare it with the plain step)."""

    def __init__(
        self,
        step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        device: torch.device,
        warmup: int = WARMUP_STEPS,
        capture: bool = True,
    ):
        self.step, self.device, self.warmup, self.capture = step, device, warmup, capture
        self.images = self.labels = self.loss_sum = None  # static, made at the first step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_steps = 0
        # The memory a replay holds, as the allocator counted it at the capture's peak: see
        # _capture. Bytes, 0 until captured.
        self.replay_peak = 0

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor):
        if self.images is None:
            self.images, self.labels = torch.empty_like(images), torch.empty_like(labels)
            self.loss_sum = loss_sum
        # The graph adds to the accumulator it was captured with: it must be that one.
        assert loss_sum is self.loss_sum, "the loss accumulator must be the run's one tensor"
        self.images.copy_(images)
        self.labels.copy_(labels)
        if self.graph is not None:
            self.graph.replay()
        elif self.capture and self.eager_steps >= self.warmup:
            self._capture()
            self.graph.replay()  # capturing records the step without running it
        else:
            with side_stream(self.device):
                self.step(self.images, self.labels, self.loss_sum)
            self.eager_steps += 1

    def _capture(self) -> None:
        """Record the step into a graph, on the side stream its warm-up ran on, and measure the
        memory a replay holds: the tensors a step makes and frees live in the graph's private
        pool, which the allocator counts while capturing but not while replaying, so the
        capture's peak is every replay's (peak_mem: train.Trainer.replay_peak). The capture's
        step is the warm-up's: the epoch's peak before it, which measuring resets, was the
        same step's."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=_side_stream(self.device)):
            self.step(self.images, self.labels, self.loss_sum)
        self.replay_peak = torch.cuda.max_memory_allocated(self.device)
