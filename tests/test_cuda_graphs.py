"""--cuda-graphs (cuda_graphs.py) where no GPU is: every run it cannot apply to is refused in one
line, also by --check; and the step it captures, fed from static buffers into the run's one
loss accumulator, trains exactly as the plain step (eager, on 2 gloo ranks with DDP). That a
captured graph trains the same is shown only on a GPU (tests/test_gpu.py)."""

import pytest
import torch

from checkpoint import Position
from config import Config
from conftest import TINY, assert_one_line_error, run_main
from cuda_graphs import GraphedStep, refusal
from dist_harness import EQUAL_CFG, spawn
from session import build_trainer

pytestmark = pytest.mark.fast  # make test-fast

CHECK = [*TINY, "--cuda-graphs", "--device", "cuda", "--check", "1"]


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"strategy": "fsdp"}, "--strategy fsdp cannot be captured"),
        ({"strategy": "fsdp2"}, "--strategy fsdp2 cannot be captured"),
        ({"strategy": "dp"}, "--strategy dp cannot be captured"),
        ({"precision": "fp16"}, "use --precision bf16"),
        ({"lr_schedule": "cosine"}, "--lr-schedule none"),
        ({"warmup_epochs": 1}, "--warmup-epochs 0"),
        ({"compile": True}, "torch.compile makes CUDA graphs of its own"),
        ({}, None),
        ({"strategy": "single", "precision": "bf16", "clip_grad": 1.0, "grad_accum": 2}, None),
    ],
)
def test_what_cannot_be_one_graph_is_refused_with_the_reason(options, reason):
    why = refusal(Config(cuda_graphs=True, **options), torch.device("cuda"))
    assert why == reason or reason in why, why


def test_refusals_are_one_line_also_from_check_and_on_a_cpu():
    done = run_main([*CHECK, "--strategy", "fsdp"], timeout=120)
    assert_one_line_error(done, "--cuda-graphs: --strategy fsdp cannot be captured")
    done = run_main([*TINY, "--cuda-graphs", "--epochs", "1"], timeout=120)
    assert_one_line_error(done, "--cuda-graphs: ", "it needs a GPU")
    done = run_main(CHECK, timeout=120)
    assert done.returncode == 0 and "check: ok" in done.stdout, done.stderr


def train_two_epochs(env, static_buffers: bool):
    """DDP's parameters and every step's loss sum after two epochs, with the plain step or the
    static-buffer step (eager; its warm-up covers part of the first epoch)."""
    cfg = Config(**{**EQUAL_CFG, "optimizer": "adam", "augment": True})
    trainer, _ = build_trainer(cfg, env)
    if static_buffers:
        trainer.train_step = GraphedStep(trainer.step, env.device, warmup=3, capture=False)
    sums = []
    for epoch in (1, 2):
        reached, complete, _ = trainer.train_epoch(Position(epoch))
        assert complete
        sums.append(reached.loss_sum)
    step = trainer.train_step
    buffers = (step.images.data_ptr(), step.loss_sum is trainer.loss_sum) if static_buffers else ()
    return [p.detach().clone() for p in trainer.model.parameters()], sums, buffers


@pytest.mark.timeout(240)
def test_the_static_buffer_step_trains_exactly_as_the_plain_step():
    plain = spawn(train_two_epochs, 2, False)
    static = spawn(train_two_epochs, 2, True)
    for (params, sums, _), (static_params, static_sums, buffers) in zip(plain, static):
        assert sums == static_sums
        assert all(torch.equal(a, b) for a, b in zip(params, static_params))
        assert buffers[1], "the step added to the trainer's one loss accumulator"


def test_the_accumulator_must_be_the_runs_one_tensor():
    calls = []
    step = GraphedStep(lambda x, y, s: calls.append(x), torch.device("cpu"), capture=False)
    images, labels, total = torch.zeros(2, 3), torch.zeros(2), torch.zeros(())
    step(images, labels, total)
    step(images + 1, labels, total)
    assert calls[0] is calls[1] and torch.equal(calls[1], images + 1)  # one buffer, refilled
    with pytest.raises(AssertionError, match="one tensor"):
        step(images, labels, torch.zeros(()))
