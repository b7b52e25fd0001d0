"""How each strategy communicates, counted and sized: the collectives one training step issues
on 2 gloo ranks, as torch dispatches them (c10d's operations under a TorchDispatchMode, the
counter benchmark.py uses for a step's operations). Equal parameters (test_equivalence.py)
prove the arithmetic; these counts prove the pattern: DDP all-reduces its gradient buckets, FSDP
gathers each unit once for forward and, under full sharding, again for backward, and
reduce-scatters each unit's gradients once; the root, kept from forward to backward, is gathered
once; with --grad-accum, the reductions once per optimizer step, not per micro-batch. Their sizes
are those comm_bench.py times."""

import collections

import pytest
import torch

from benchmark import OperationCounter
from checkpoint import Position
from comm_bench import ddp_buckets, messages
from dist_harness import spawn, steps_cfg
from model import build_model, own_units
from precision import wire_dtypes
from session import build_trainer

pytestmark = pytest.mark.fast  # make test-fast

# c10d's operations by the collective they run (names as torch 2.14 dispatches them).
KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter"}
MICRO = 4  # micro-batches per optimizer step where the setup accumulates (--grad-accum)
# (strategy, sharding, precision, --grad-accum): bf16 where the dtype of what is sent could change.
SETUPS = [("ddp", "full", "fp32", 1), ("ddp", "full", "bf16", 1), ("fsdp", "full", "bf16", 1)]
SETUPS += [("fsdp", "grad_op", "fp32", 1), ("fsdp2", "full", "bf16", 1)]
SETUPS += [("fsdp2", "grad_op", "fp32", 1)]
SETUPS += [("ddp", "full", "fp32", MICRO), ("fsdp", "full", "fp32", MICRO)]
SETUPS += [("fsdp2", "full", "fp32", MICRO)]


def tensor_bytes(arg) -> int:
    """The bytes of the tensors in one argument of a c10d operation (a tensor, or lists)."""
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(tensor_bytes(a) for a in arg)
    return 0


class MessageCounter(OperationCounter):
    """Also each collective's kind and whole message, nccl-tests' bytes: the larger of its output
    and input (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("c10d."):
            kind = next((k for part, k in KINDS.items() if part in name), name)
            self.messages.append((kind, max(tensor_bytes(a) for a in args[:2])))
        return super().__torch_dispatch__(func, types, args, kwargs)


def one_step_each(env) -> dict:
    """The collectives of one training step (after a warm-up epoch), per setup: (kind, bytes)
    of each, in the order issued."""
    found = {}
    for strategy, sharding, precision, accum in SETUPS:
        cfg = steps_cfg(
            32, 2, strategy=strategy, sharding=sharding, precision=precision, grad_accum=accum
        )
        trainer, _ = build_trainer(cfg, env)
        trainer.train_epoch(Position(1))
        images, labels = next(iter(trainer.loaders.train))
        with MessageCounter() as counter:
            trainer.step(images, labels, trainer.loss_sum)
        found[strategy, sharding, precision, accum] = counter.messages
    return found


def expected_messages(strategy: str, sharding: str, precision: str) -> collections.Counter:
    """(kind, bytes) of what comm_bench.py times for this setup, counted as one step sends
    them: DDP each bucket once; FSDP each unit's gather once for forward and, fully sharded,
    again for backward, but the root's, kept from forward to backward; and each unit's
    reduce-scatter once."""
    expected = collections.Counter()
    for op, label, size in messages(build_model("cnn"), precision, strategy, []):
        if strategy == "ddp" and label.startswith("bucket"):
            expected[op, size] += 1
        if strategy != "ddp" and label.startswith("unit_"):
            again = op == "all_gather" and sharding == "full" and label != "unit_root"
            expected[op, size] += 2 if again else 1
    return expected


@pytest.mark.timeout(300)
def test_each_strategy_sends_the_collectives_its_design_says_at_the_sizes_timed():
    """The counts by design, then the sizes: FSDP's gathers in the compute dtype (2 bytes a
    parameter in bf16), its reduce-scatters in fp32 (reduce_dtype); DDP's buckets in fp32 also
    under bf16. At 2 ranks no unit needs padding, so the sizes are exact."""
    sent = spawn(one_step_each, 2, timeout=280)
    assert sent[0] == sent[1], "every rank takes part in every collective"
    model = build_model("cnn")
    # model.own_units: the classifier alone; the root holds the 3 conv blocks. 2 DDP buckets.
    units, buckets = 1 + len(own_units(model)), len(ddp_buckets(model, 4))
    assert (units, buckets) == (2, 2)
    design = {
        "ddp": {"all_reduce": buckets},
        "full": {"all_gather": 2 * units - 1, "reduce_scatter": units},  # the root's once
        "grad_op": {"all_gather": units, "reduce_scatter": units},
    }
    for (strategy, sharding, precision, accum), found in sent[0].items():
        counted = collections.Counter(kind for kind, _ in found)
        expected = dict(design["ddp" if strategy == "ddp" else sharding])
        if "all_gather" in expected:
            # Accumulating, every micro-batch's forward and backward gathers, while the
            # gradients are reduced once a step, after the last one (fsdp_utils.gradient_sync).
            expected["all_gather"] *= accum
        assert counted == expected, (strategy, sharding, accum)
        if accum > 1:
            continue  # the sizes: those of one micro-batch's step, below
        modelled = expected_messages(strategy, sharding, precision)
        if (strategy, precision) == ("ddp", "bf16"):
            # Under autocast DDP buckets the classifier's first bias one bucket later than
            # ddp_buckets models it (test_comm.py): the bytes are fp32's all the same.
            reduced = wire_dtypes(precision, strategy)[1].itemsize
            assert sum(size for _, size in found) == sum(ddp_buckets(model, reduced))
            continue
        assert collections.Counter(found) == modelled, (strategy, sharding, precision)
