"""Train and evaluate one data-parallel replica: the loop, the step and validation.

`Trainer.fit` is the whole loop: epochs of training and validation, one `[METRIC]` line and a
checkpoint each, and an early stop (with a checkpoint) when SLURM warns; the step is
`Learner.step`. Each rank runs the same loop on its own shard. Nothing in the hot loop waits on
the device: losses and counts accumulate as device tensors, all-reduced (summed) once per epoch,
so loss and accuracy are the whole data set's, not rank 0's shard's. Epoch time is taken between
two barriers around training only, less the compute calibration's rounds beside its steps; what
else an epoch measures, and how, is measure.py's.
"""

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from checkpoint_files import Position
from cost_model import UNKNOWN, implausible
from cuda_graphs import GraphedStep
from data import Loaders, validation_weights
from distributed_utils import DistEnv
from fsdp_utils import clip_gradients, gradient_sync, reshard
from measure import (
    EpochMeters,
    Segment,
    StepCompute,
    all_reduce,
    breakdown_warning,
    epoch_fields,
    gpu_busy,
    state_bytes_by_device,
    synchronize,
    time_breakdown,
)
from peer_failures import say_where
from precision import Precision, loss_input
from stopping import STOP_POLL_EVERY, StopRequest
from utils import Progress, format_metric, is_rank_zero, log0, metric_order


class Diverged(Exception):
    """The training loss became NaN or infinite: every further step is wasted."""


@dataclass(kw_only=True)
class Learner:
    """A model and what one optimizer step of it needs (its optimizer, precision, micro-batches
    and clipping), and that step: the trainer's, and the compute calibration's own copy of the
    run's step (session.calibrate_compute). Built with keywords."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    env: DistEnv
    grad_accum: int = 1
    clip_grad: float | None = None
    cuda_graphs: bool = False  # train_step as one CUDA graph (cuda_graphs.py)

    @functools.cached_property
    def loss_sum(self) -> torch.Tensor:
        """Where the steps add their mean losses: one tensor for the run (zeroed every epoch), the
        same memory for every replay of a CUDA graph of the step."""
        return torch.zeros((), device=self.env.device)

    @functools.cached_property
    def train_step(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """What trains one batch: `step`, or `step` captured as a CUDA graph."""
        if not self.cuda_graphs:
            return self.step
        # A graph records GPU kernels: elsewhere (a CPU test) the static-buffer step alone.
        return GraphedStep(self.step, self.env.device, capture=self.env.device.type == "cuda")

    def step(self, images: torch.Tensor, labels: torch.Tensor, mean_loss_sum: torch.Tensor) -> None:
        """One optimizer step on this rank's share of the global batch, in `grad_accum`
        micro-batches whose gradients are reduced over the ranks once, after the last. Adds the
        share's mean loss to `mean_loss_sum` (on the device: no host synchronisation)."""
        model, scaler = self.model, self.precision.scaler
        # exercise 6.1 begin
        self.optimizer.zero_grad(set_to_none=True)
        # exercise 6.1 end
        micro = (
            ((images, labels),)
            if self.grad_accum == 1
            else tuple(zip(images.chunk(self.grad_accum), labels.chunk(self.grad_accum)))
        )
        for i, (x, y) in enumerate(micro):
            with gradient_sync(model, enabled=i == len(micro) - 1):
                with self.precision.autocast(x.device):
                    logits = model(x)
                loss = F.cross_entropy(loss_input(logits), y)
                # Weighted by its share of the rank's batch, the micro-batches' gradients add up
                # to the share's mean's. Without fp16 the scaler passes everything through.
                weight = len(y) / len(labels)
                weighted = loss if weight == 1 else loss * weight
                # exercise 6.1 begin
                scaler.scale(weighted).backward()
                # exercise 6.1 end
            with torch.no_grad():  # no graph, and so no detach
                mean_loss_sum += weighted
        if self.clip_grad is not None:
            scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            clip_gradients(model, self.clip_grad)
        # exercise 6.1 begin
        scaler.step(self.optimizer)
        scaler.update()
        # exercise 6.1 end


@dataclass(kw_only=True)
class Trainer(Learner):
    """One rank's part of a training run, and the loop that trains it. Built with keywords."""

    loaders: Loaders
    meters: EpochMeters  # what the epochs are measured with, and the [METRIC] line's labels
    print_every: int = 50
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    step_collectives: str = "the step's collectives"  # strategies.STEP_COLLECTIVES, for say_where

    @property
    def shows_progress(self) -> bool:
        """Whether this rank prints the progress lines: one that knows the loss."""
        return is_rank_zero()

    @property
    def reports_sums(self) -> bool:
        """Whether this rank's images and losses count in the global sums (a pipeline's stages
        all take the same batch: only its last, which computes the loss, counts)."""
        return True

    @property
    def data_ranks(self) -> tuple[int, int]:
        """(rank, world size) of the data's shards: one per rank, in data parallelism."""
        return self.env.rank, self.env.world_size

    def fit(
        self, start: Position, epochs: int, stop: StopRequest, save: Callable[[Position], None]
    ) -> tuple[list[dict], Position | None]:
        """Epochs from `start` to `epochs`, each saved when done. Returns the `[METRIC]` fields
        of the epochs finished and, if a stop was agreed, the position saved (else None).
        Raises Diverged, saving nothing, after an epoch whose training loss is not finite."""
        history, position, profiler = [], start, self.meters.profiler
        with profiler.profiler if profiler else contextlib.nullcontext():
            while position.epoch <= epochs:
                reached, measured = self.run_epoch(position, stop)
                stopping = stop.drain()  # the same answer on every rank
                if measured is None:  # a stop came mid-epoch: keep what this epoch has done
                    save(reached)
                    return history, reached
                loss = measured["train_loss"]
                if not math.isfinite(loss):  # the same on every rank: all-reduced
                    raise Diverged(f"epoch {reached.epoch}: the training loss is {loss}")
                history.append(metric_order({**measured, **self.meters.labels}))
                log0(format_metric(history[-1]))
                for warning in (implausible(history[-1]), breakdown_warning(history[-1])):
                    if warning:
                        log0(warning)
                position = Position(epoch=position.epoch + 1)
                save(position)
                if stopping and position.epoch <= epochs:
                    return history, position
        return history, None

    def run_epoch(
        self, start: Position, stop: StopRequest | None = None
    ) -> tuple[Position, dict | None]:
        """Train (from `start`) and validate one epoch: the position reached and the measurements
        of its `[METRIC]` line, None for them if a stop came mid-epoch."""
        device, meters = self.env.device, self.meters
        meters.memory.reset()
        replay_peak = self.replay_peak()
        reached, complete, segment = self.train_epoch(start, stop)
        if not complete:
            return reached, None
        # Read before validation (whose forward holds FSDP2's root gathered), the calibration's
        # rounds set aside (its unsharded model would hide FSDP's saving): training's memory.
        own_peak = meters.memory.training_peak(replay_peak)
        state = state_bytes_by_device(self.model, self.optimizer)
        # The activations' share: what the peak held beyond the state on its device, per image.
        per_image = (own_peak - state.get(device, 0)) / self.loaders.train.batch_size
        memory = [own_peak, sum(state.values()), meters.memory.reserved_peak(), per_image]
        # Nothing is sent where the run trains on one device (a rank, not dp's or model's GPUs).
        sends = meters.flops.devices > 1
        breakdown = time_breakdown(segment, self.step_compute(), device, sends)
        # After the timing: the kernel trace's round is no part of the epoch.
        busy = gpu_busy(segment, meters.kernel_seconds_per_step(self.env.world_size))
        val = self.evaluate()
        epoch = epoch_fields(reached, val, memory, self.loaders.device_bytes(), device)
        return reached, {
            **epoch,
            **breakdown,
            **busy,
            **meters.flops.fields(epoch["throughput"]),
            **self.strategy_fields(),
        }

    def replay_peak(self) -> int:
        """The least peak of an epoch whose steps replay a captured graph: the capture's, which
        each replay holds again unseen by the allocator, so peak_mem means the same graphed as
        eager."""
        step = self.train_step
        return step.replay_peak if isinstance(step, GraphedStep) and step.graph else 0

    def step_compute(self) -> StepCompute:
        """One step's compute on this rank this epoch, for t_compute: the calibration's (a
        pipeline's stage measures its own)."""
        return self.meters.step_compute()

    def strategy_fields(self) -> dict:
        """The pipeline's measurements (pipeline_utils.PipelineTrainer): no bubble here."""
        return {"bubble": UNKNOWN, "bubble_ideal": UNKNOWN}

    def train_epoch(
        self, start: Position, stop: StopRequest | None = None
    ) -> tuple[Position, bool, Segment]:
        """Train from `start` until the epoch ends or a stop is agreed. Returns the position
        reached (its sums global and including `start`'s), whether the epoch is complete, and
        this rank's own timing of what it trained."""
        # exercise 6.1 begin
        self.model.train()
        # exercise 6.1 end
        device = self.env.device
        mean_loss_sum = self.loss_sum.zero_()  # of the steps' mean losses
        seen = 0  # images: known on the host, no device work per step
        self.loaders.set_position(start.epoch, start.step)
        total = len(self.loaders.train)
        progress = Progress(start.epoch, total, self.print_every, self.shows_progress, start.step)
        meters, data_wait = self.meters, self.meters.data_wait
        data_wait.reset()
        planned = meters.calibration_plan(start.step, total)
        held = 0.0  # seconds the compute calibration's rounds held the epoch up: not its time

        synchronize(device)
        t_start = time.perf_counter()
        batches = iter(self.loaders.train)
        step = start.step
        while step < total and not (stop and stop.poll()):
            if step % STOP_POLL_EVERY == 0:
                say_where(f"at epoch {start.epoch} step {step} in {self.step_collectives}")
            rounds = meters.calibrate(planned, step)  # 0 where none is planned here
            held, progress.start = held + rounds, progress.start + rounds
            with data_wait.measure():
                images, labels = next(batches)

            self.train_step(images, labels, mean_loss_sum)
            if self.scheduler is not None:  # on the host, outside a captured step
                self.scheduler.step()
            if meters.profiler:
                meters.profiler.profiler.step()
            seen += len(labels)
            progress.update(step, mean_loss_sum)
            step += 1
        if step == total:
            held += meters.calibrate(planned, step)
        synchronize(device)
        elapsed = time.perf_counter() - t_start - held

        own_data = data_wait.total()
        say_where(f"at the end of epoch {start.epoch}'s training, in its all-reduces")
        # Every step takes a full local batch: the images' loss sum, once per epoch.
        loss_sum, seen = all_reduce(
            [mean_loss_sum * self.loaders.train.batch_size, seen if self.reports_sums else 0],
            device,
        )
        # The epoch lasts until its slowest rank is done: every rank takes that time, so that
        # `time` does not depend on which rank reports it and the t_* parts add up to it.
        most_data, elapsed = all_reduce([own_data, elapsed], device, dist.ReduceOp.MAX)
        segment = Segment(elapsed, own_data, step - start.step)
        reached = Position(
            start.epoch,
            step,
            start.loss_sum + loss_sum,
            start.seen + int(seen),
            start.data_wait + most_data,
            start.time + elapsed,
        )
        return reached, step == total, segment

    def predict(self, images: torch.Tensor) -> torch.Tensor | None:
        """The logits of a validation batch."""
        with self.precision.autocast(images.device):
            return self.model(images)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and accuracy over the whole validation set, each image counted exactly once."""
        # exercise 6.1 begin
        self.model.eval()
        # exercise 6.1 end
        loaders, device = self.loaders, self.env.device
        loss_sum, correct, count = torch.zeros(3, device=device).unbind()
        offset = 0
        say_where("in validation")
        synchronize(device)
        start = time.perf_counter()
        for images, labels in loaders.val:
            weights = validation_weights(
                offset, len(labels), *self.data_ranks, loaders.val_size, device
            )
            offset += len(labels)
            logits = self.predict(images)
            if logits is None:  # this rank computes no logits: its sums stay zero
                continue
            losses = F.cross_entropy(loss_input(logits), labels, reduction="none")
            loss_sum += (losses * weights).sum()
            correct += ((logits.argmax(dim=1) == labels).float() * weights).sum()
            count += weights.sum()
        # A forward alone leaves gathered the units kept for backward (FSDP2's root; every unit
        # under grad_op). A CUDA graph's replay runs no FSDP2 hook, so the next validation would
        # read this one's gathered copy, weights an epoch old: back to their shards, the state
        # a capture begins in and every replay expects.
        reshard(self.model)
        synchronize(device)
        elapsed = time.perf_counter() - start
        # exercise 6.1 begin
        loss_sum, correct, count = all_reduce([loss_sum, correct, count], device)
        # exercise 6.1 end
        assert int(count) == loaders.val_size, (count, loaders.val_size)
        return {
            "val_loss": loss_sum / count,
            "acc": 100.0 * correct / count,
            "val_correct": int(correct),
            "val_time": elapsed,
        }
