"""What one training step costs the host: the operations torch dispatches per step (each a
kernel launch on a GPU, where a host-bound step pays for every one), counted as benchmark.py
counts them. The budget fails when per-step work comes back: per-batch augmentation, the
for-loop optimizer, a list of micro-batches, a detach or division per step."""

import collections
import json
import sys

import pytest

from benchmark import OPERATIONS_AGAINST_DDP, operations_per_epoch_step, operations_per_step
from checkpoint import Position
from conftest import run
from dist_harness import spawn, steps_cfg
from session import build_trainer

pytestmark = pytest.mark.fast  # make test-fast

# DDP at world size 1, batch 256, fp32, with crop and flip, on the CPU: 99 with torch 2.14 (216
# before the epoch-level augmentation and the fused optimizer). What remains is torch's own:
# the model's forward and backward, autograd's bookkeeping (a detach per parameter and saved
# output), DDP's copy of each gradient into its bucket, the profiler markers of DDP's forward
# and of the optimizer.
BUDGET = 100
HOST_SYNC = "aten._local_scalar_dense"  # .item(), a bool of a tensor: the host waits


def count_step(
    env, strategy: str, precision: str = "fp32", batch: int = 256, optimizer: str = "adam"
) -> dict:
    cfg = steps_cfg(
        batch, 12, strategy=strategy, precision=precision, optimizer=optimizer, augment=True
    )
    trainer, _ = build_trainer(cfg, env)
    trainer.train_epoch(Position(1))  # warm-up: first allocations, lazy state
    return dict(operations_per_step(trainer, epoch=2, steps=4))


@pytest.mark.timeout(300)
def test_a_ddp_step_dispatches_at_most_100_operations():
    (ops,) = spawn(count_step, 1, "ddp")
    total = sum(ops.values())
    print(f"operations per step: {total:.1f}", collections.Counter(ops).most_common(8))
    assert total <= BUDGET, sorted(ops.items(), key=lambda kv: -kv[1])
    # The mechanisms, each one operation a step: the fused optimizer, and a batch that is a
    # slice of the epoch's augmented images normalized by one multiply-add.
    assert ops.get("aten._fused_adam_") == 1 and ops.get("aten.addcmul") == 1, ops
    assert not {"aten.gather", "aten.randint", "aten.index_select", "aten.slice"} & set(ops)
    assert HOST_SYNC not in ops, ops[HOST_SYNC]


def epoch_operations(env, strategies: tuple, steps: int = 6) -> dict:
    """Per strategy, world size 1, batch 256, fp32, crop and flip: an epoch's operations over its
    steps (benchmark.operations_per_epoch_step), after a warm-up epoch."""
    found = {}
    for strategy in strategies:
        trainer, _ = build_trainer(steps_cfg(256, steps, strategy=strategy, augment=True), env)
        trainer.train_epoch(Position(1))
        found[strategy] = operations_per_epoch_step(trainer, epoch=2)
    return found


@pytest.mark.timeout(300)
def test_an_fsdp_step_dispatches_at_most_its_budget_of_ddps_operations():
    """FSDP's host work per step against DDP's, per-epoch work included (issue 35's measure):
    what units of their own for the CNN's small conv blocks cost (model.own_units), and
    FSDP2's foreach optimizer (a host read of each parameter's step count)."""
    (found,) = spawn(epoch_operations, 1, ("ddp", *OPERATIONS_AGAINST_DDP), timeout=280)
    print({strategy: f"{n:.1f}" for strategy, n in found.items()})
    for strategy, most in OPERATIONS_AGAINST_DDP.items():
        assert found[strategy] <= most * found["ddp"], (strategy, found)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy, optimizer, synchronises",
    [("ddp", "adam", False), ("fsdp2", "adam", False), ("fsdp2", "sgd", True)],
)
def test_where_an_fp16_step_makes_the_host_wait(strategy, optimizer, synchronises):
    """No fp16 step waits for the device where the optimizer is fused: it takes the gradient
    scaler's inf check as a tensor (torch's _step_supports_amp_scaling), FSDP2's DTensor
    parameters too with Adam. Fused SGD has no DTensor sharding rule: FSDP2 with SGD runs the
    foreach optimizer, and the scaler reads its inf checks on the host."""
    (ops,) = spawn(count_step, 1, strategy, "fp16", 32, optimizer)
    print(f"{strategy} {optimizer}: {ops.get(HOST_SYNC, 0):.1f} host synchronisations per step")
    assert (ops.get(HOST_SYNC, 0) > 0) == synchronises, ops.get(HOST_SYNC)


@pytest.mark.timeout(300)
def test_benchmark_pys_tables_time_each_local_batch_and_strategy_and_no_graph_without_a_gpu():
    """The sweep's floor: one row per GPU count of the sweep, at global batch / N images a step,
    whose epoch time is its step time x the CIFAR-10 epoch's steps. The per-strategy table:
    each strategy of the study, its operations per step as operations_per_epoch_step counts
    them, eager steps at both local batches. Neither has a graphed column without a GPU (never
    a number that did not run)."""
    code = (  # in a fresh process, as benchmark.py makes them (header first)
        "import benchmark, torch, json; cpu = torch.device('cpu'); print(json.dumps("
        "[benchmark.sweep_floor(64, 4, cpu), benchmark.strategy_steps(64, 2, cpu)]))"
    )
    done = run([sys.executable, "-c", code], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    floor, steps = json.loads(done.stdout.splitlines()[-1])
    _, *rows = floor
    assert [(n, local) for n, local, *_ in rows] == [(1, 64), (2, 32), (4, 16), (8, 8)]
    for _, _, operations, step_ms, epoch_s, graph_step, graph_epoch in rows:
        assert float(operations) <= BUDGET
        assert float(epoch_s) == pytest.approx(float(step_ms) / 1000 * (50_000 // 64), abs=0.01)
        assert graph_step == graph_epoch == "no GPU"
    header, *rows = steps
    assert header[2:] == [
        "step at 64, eager (ms)",
        "step at 32, eager (ms)",
        "step at 64, CUDA graph (ms)",
        "step at 32, CUDA graph (ms)",
    ]
    assert [row[0] for row in rows] == ["single", "ddp", "fsdp", "fsdp2"]
    operations = {strategy: float(n) for strategy, n, *_ in rows}
    assert operations["single"] < operations["ddp"] < operations["fsdp"]  # wrappers add work
    for *_, eager_64, eager_32, graph_64, graph_32 in rows:
        assert float(eager_64) > 0 and float(eager_32) > 0
        assert graph_64 == graph_32 == "no GPU"
