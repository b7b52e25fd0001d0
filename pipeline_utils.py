"""Pipeline parallelism (--strategy pipeline): one stage of the model per rank, fed with
micro-batches, run by torch.distributed.pipelining.

Each rank holds one part of the model (`model.cut`, at the model's units: the CNN's 3 conv
blocks and classifier cut in 2 or 4 stages). A `PipelineStage` sends its activations to the
next rank and its input gradients to the one before; a schedule orders the micro-batches'
forwards (F) and backwards (B): GPipe all forwards, then all backwards; 1F1B, once the
pipeline is full, one forward, one backward, so a stage holds the activations of at most p
micro-batches rather than m (docs/concepts.md draws both).

Every stage takes the whole global batch (config.data_world): the first feeds its images, the
last computes each micro-batch's mean loss with its labels, and the schedule divides the
gradients by m: the global batch's mean, as one process computes it. The loss and accuracy are
the last stage's; the others add zeros to the all-reduced sums, so every rank reports the same
`[METRIC]` line. A stage computes in its forwards and backwards (`TimedStage`) and waits for its
neighbours the rest of a step: the bubble, (p - 1) / (m + p - 1) of a step for p equal stages
and m micro-batches, which communication and unequal stages make larger.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from measure import StageTimer, StepCompute, all_reduce
from model import cut
from precision import loss_input
from train import Trainer

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # config.SCHEDULES' names


def get_stage_model(model: nn.Module, device: torch.device, rank: int, stages: int) -> nn.Module:
    """This rank's part of the model, on its device; the other parts are left to be freed."""
    return cut(model, stages)[rank].to(device)


def ideal_bubble(stages: int, microbatches: int) -> float:
    """The share of a step each of p equal stages waits with m micro-batches, communication
    free: (p - 1) / (m + p - 1), in GPipe's and 1F1B's schedules alike."""
    return (stages - 1) / (microbatches + stages - 1)


class TimedStage(PipelineStage):
    """A PipelineStage that times its forwards and backwards with measure.StageTimer: on a GPU
    CUDA events, which wait for nothing (a synchronisation would also wait for the stage's
    sends and keep them from overlapping the next micro-batch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = StageTimer(self.device)

    def forward_one_chunk(self, *args, **kwargs):
        with self.timer.measure():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.timer.measure():
            return super().backward_one_chunk(*args, **kwargs)


def clip_across_stages(stage: nn.Module, max_norm: float) -> None:
    """Scale the gradients so that their norm over every stage's is at most max_norm: each
    stage's squared norm, summed over the stages, is the whole model's."""
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    squared = torch.nn.utils.get_total_norm(grads).pow(2)
    dist.all_reduce(squared)
    torch.nn.utils.clip_grads_with_norm_(stage.parameters(), max_norm, squared.sqrt())


def _mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(loss_input(logits), labels)


@dataclass
class StepClock:
    """This stage's training steps in an epoch: how many, their wall time, and the part of it
    the stage computed (its forwards and backwards; validation's forwards not counted)."""

    steps: int = 0
    seconds: float = 0.0
    busy: float = 0.0


@dataclass(kw_only=True)
class PipelineTrainer(Trainer):
    """A Trainer whose step and validation run through the pipeline's schedule."""

    microbatches: int
    schedule_name: str  # config.SCHEDULES'

    def __post_init__(self):
        env = self.env
        self.first, self.last = env.rank == 0, env.rank == env.world_size - 1
        self.stage = TimedStage(self.model, env.rank, env.world_size, env.device)
        self.schedule = SCHEDULES[self.schedule_name](
            self.stage, self.microbatches, loss_fn=_mean_loss
        )
        self.clock = StepClock()

    @property
    def shows_progress(self) -> bool:
        return self.last  # the stage that computes the loss

    @property
    def reports_sums(self) -> bool:
        return self.last  # the loss and images are counted once, where the loss is

    @property
    def data_ranks(self) -> tuple[int, int]:
        return 0, 1  # every stage takes the whole global batch

    def _feed(self, images: torch.Tensor) -> tuple:
        return (images,) if self.first else ()

    def train_epoch(self, start, stop=None):
        self.clock = StepClock()
        self.stage.timer.reset()
        trained = super().train_epoch(start, stop)  # ends with the device synchronised
        self.clock.busy = self.stage.timer.total()  # training's chunks: validation's come later
        return trained

    def step(self, images: torch.Tensor, labels: torch.Tensor, mean_loss_sum: torch.Tensor) -> None:
        """One optimizer step of this stage: the schedule runs the global batch's micro-batches
        through the pipeline (their forwards, backwards and the sends between stages), then
        every stage steps its own parameters."""
        # exercise 6.1 twin begin
        self.optimizer.zero_grad(set_to_none=True)
        losses = [] if self.last else None
        start = time.perf_counter()
        self.schedule.step(
            *self._feed(images),
            target=labels if self.last else None,
            losses=losses,
            return_outputs=False,
        )
        self.clock.seconds += time.perf_counter() - start
        self.clock.steps += 1
        if self.last:  # equal micro-batches: the mean of their means is the batch's
            with torch.no_grad():
                mean_loss_sum += torch.stack(losses).mean()
        if self.clip_grad is not None:
            clip_across_stages(self.model, self.clip_grad)
        self.optimizer.step()
        # exercise 6.1 twin end

    def step_compute(self) -> StepCompute:
        """Measured, not calibrated: this stage's own forwards and backwards, per step."""
        return StepCompute.measured(self.clock.busy / max(self.clock.steps, 1))

    def strategy_fields(self) -> dict:
        """bubble: the share of a step the stages waited (the mean over stages) this epoch;
        bubble_ideal: the textbook's for this many stages and micro-batches."""
        waited = 1 - self.clock.busy / self.clock.seconds if self.clock.seconds else 0.0
        (total,) = all_reduce([waited], self.env.device)
        stages = self.env.world_size
        return {
            "bubble": total / stages,
            "bubble_ideal": ideal_bubble(stages, self.microbatches),
        }

    def predict(self, images: torch.Tensor) -> torch.Tensor | None:
        """The logits of a validation batch on the last stage (None on the others), a short last
        batch padded with zeros to the schedule's buffers' shape, the padding's logits dropped."""
        n, full = len(images), self.loaders.train.batch_size
        padded = torch.cat([images, images.new_zeros(full - n, *images.shape[1:])])
        # The schedule computes its loss in eval too, so the last stage needs labels: any will do.
        dummy_labels = torch.zeros(full, dtype=torch.long, device=images.device)
        logits = self.schedule.eval(*self._feed(padded), target=dummy_labels if self.last else None)
        return logits[:n] if self.last else None
