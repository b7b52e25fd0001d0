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
(validation does: train.Trainer.evaluate).

Whether a run's step is graphed (by default: on a GPU where a GPU run has shown it), and why an
explicit --cuda-graphs cannot apply, is feasibility.py's to say.
"""

import contextlib
import functools
from collections.abc import Callable

import torch

# torch's notes: DDP needs at least 11 eager iterations before its backward can be captured.
WARMUP_STEPS = 11


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
        self.replay_peak = 0  # the bytes a replay holds: the capture's peak (_capture)

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
        memory a replay holds: a step's temporaries live in the graph's private pool, which the
        allocator counts while capturing but not while replaying, so the capture's peak is every
        replay's (peak_mem: train.Trainer.replay_peak). The peak it resets was the same step's,
        run eager in warm-up."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=_side_stream(self.device)):
            self.step(self.images, self.labels, self.loss_sum)
        self.replay_peak = torch.cuda.max_memory_allocated(self.device)
