"""How each strategy communicates, counted: the collectives one training step issues on 2 gloo
ranks, as torch dispatches them (c10d's operations under a TorchDispatchMode, the counter
benchmark.py uses for a step's operations). Equal parameters (test_equivalence.py) prove the
arithmetic; these counts prove the pattern: DDP all-reduces its gradient buckets, FSDP gathers
each unit once for forward and, under full sharding, again for backward, and reduce-scatters
each unit's gradients once; with --grad-accum, once per optimizer step, not per micro-batch."""

import collections

import pytest

from benchmark import OperationCounter
from checkpoint import Position
from comm_bench import ddp_buckets
from config import Config
from dist_harness import spawn
from model import build_model
from session import build_trainer

pytestmark = pytest.mark.fast  # make test-fast

# c10d's operations by the collective they run (names as torch 2.14 dispatches them).
KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter"}
MICRO = 4  # micro-batches per optimizer step where the setup accumulates (--grad-accum)
# (strategy, sharding, --grad-accum)
SETUPS = [("ddp", "full", 1), ("fsdp", "full", 1), ("fsdp", "grad_op", 1), ("fsdp2", "full", 1)]
SETUPS += [("fsdp2", "grad_op", 1)]
SETUPS += [("ddp", "full", MICRO), ("fsdp", "full", MICRO), ("fsdp2", "full", MICRO)]


def collectives(counts: collections.Counter) -> dict:
    found = collections.Counter()
    for name, n in counts.items():
        if name.startswith("c10d."):
            kind = next((k for part, k in KINDS.items() if part in name), name)
            found[kind] += n
    return dict(found)


def one_step_each(env) -> dict:
    """The collectives of one training step (after a warm-up epoch), per setup."""
    found = {}
    for strategy, sharding, accum in SETUPS:
        cfg = Config(
            strategy=strategy,
            sharding=sharding,
            grad_accum=accum,
            dataset="synthetic",
            batch_size=32,
            train_samples=32 * 2,
            val_samples=32,
            checkpoint=False,
            print_every=10**9,
        )
        trainer, _ = build_trainer(cfg, env)
        trainer.train_epoch(Position(1))
        images, labels = next(iter(trainer.loaders.train))
        with OperationCounter() as counter:
            trainer.step(images, labels, trainer.loss_sum)
        found[strategy, sharding, accum] = collectives(counter.counts)
    return found


@pytest.mark.timeout(300)
def test_each_strategy_sends_the_collectives_its_design_says():
    counted = spawn(one_step_each, 2)
    assert counted[0] == counted[1], "every rank takes part in every collective"
    model = build_model("cnn")
    units, buckets = len(model.shard_units()), len(ddp_buckets(model))
    assert (units, buckets) == (4, 2)  # the CNN's 3 conv blocks and classifier; 2 DDP buckets
    print(counted[0])
    assert counted[0] == {
        ("ddp", "full", 1): {"all_reduce": buckets},
        ("fsdp", "full", 1): {"all_gather": 2 * units, "reduce_scatter": units},
        ("fsdp", "grad_op", 1): {"all_gather": units, "reduce_scatter": units},
        ("fsdp2", "full", 1): {"all_gather": 2 * units, "reduce_scatter": units},
        ("fsdp2", "grad_op", 1): {"all_gather": units, "reduce_scatter": units},
        # Accumulating, the gradients are reduced once a step, after the last micro-batch
        # (train.gradient_sync), while every micro-batch's forward and backward gathers.
        ("ddp", "full", MICRO): {"all_reduce": buckets},
        ("fsdp", "full", MICRO): {"all_gather": 2 * units * MICRO, "reduce_scatter": units},
        ("fsdp2", "full", MICRO): {"all_gather": 2 * units * MICRO, "reduce_scatter": units},
    }
