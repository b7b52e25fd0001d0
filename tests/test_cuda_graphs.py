"""--cuda-graphs (cuda_graphs.py) where no GPU is: every run it cannot apply to is refused in one
line, also by --check; and the step it captures, fed from static buffers into the run's one
loss accumulator, trains exactly as the plain step (eager, on 2 gloo ranks with DDP); and
FSDP2's units are sharded wherever a capture or a replay would begin, so that a validation
between replays reads the weights they trained. That a captured graph trains and validates the
same is shown only on a GPU (tests/test_gpu.py)."""

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from benchmark import OperationCounter
from checkpoint import Position
from config import Config
from conftest import TINY, assert_one_line_error, run_main
from cuda_graphs import GraphedStep
from dist_harness import EQUAL_CFG, full_state, spawn
from feasibility import decide_graphs, graph_refusal
from fsdp_utils import get_fsdp2_model
from model import build_model
from optim import make_optimizer, make_scheduler
from session import build_trainer
from utils import release

pytestmark = pytest.mark.fast  # make test-fast

CHECK = [*TINY, "--cuda-graphs", "--device", "cuda", "--check", "1"]
# Before 2.11 FSDP2 is refused whole, and that reason comes first: make test runs torch 2.14,
# make test-oldest 2.10, both sides of the line.
CAPTURES_FSDP2 = release(torch.__version__) >= (2, 11)
FSDP2_REFUSED = (
    None
    if CAPTURES_FSDP2
    else f"torch captures FSDP2's step from 2.11 on (this is {torch.__version__})"
)
FSDP2_SGD_FP16 = "reads FSDP2's SGD's" if CAPTURES_FSDP2 else "from 2.11 on"


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"strategy": "fsdp"}, "--strategy fsdp cannot be captured"),
        ({"strategy": "fsdp2"}, FSDP2_REFUSED),
        ({"strategy": "fsdp2", "cpu_offload": True}, "--cpu-offload copies the parameters"),
        ({"strategy": "dp"}, "--strategy dp cannot be captured"),
        ({"precision": "fp16"}, None),  # the fused Adam skips an inf step on the device
        ({"precision": "fp16", "strategy": "fsdp2", "optimizer": "sgd"}, FSDP2_SGD_FP16),
        ({"compile": True}, "torch.compile makes CUDA graphs of its own"),
        ({}, None),
        ({"lr_schedule": "cosine", "warmup_epochs": 1}, None),
        ({"strategy": "single", "precision": "bf16", "clip_grad": 1.0, "grad_accum": 2}, None),
        ({"loader": "classic"}, "--loader classic pins batches in a thread of its own"),
        ({"loader": "classic", "num_workers": 0}, None),  # pinned by the loop, between steps
    ],
)
def test_what_cannot_be_one_graph_is_refused_with_the_reason(options, reason):
    why = graph_refusal(Config(cuda_graphs=True, **options), torch.device("cuda"))
    assert why == reason or reason in why, why


CUDA, CPU = torch.device("cuda"), torch.device("cpu")
HOST_SYNC = "aten._local_scalar_dense"  # .item(), a bool of a tensor: what a capture forbids


def fp16_steps(optimizer_options: dict) -> list[tuple[int, bool, float]]:
    """Three fp16 steps as train.Learner.step takes them (autocast, the scaler's scale,
    backward, step and update), the last with an inf loss: per step, the host reads it made,
    whether the parameters moved, and the scale after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), **optimizer_options)
    scaler = torch.amp.GradScaler("cpu")
    images = torch.randn(3, 4)
    steps = []
    for overflow in (False, False, True):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(images).float().mean()
        with OperationCounter() as counter:
            scaler.scale(loss * float("inf") if overflow else loss).backward()
            scaler.step(optimizer)
            scaler.update()
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        steps.append((counter.counts[HOST_SYNC], moved, scaler.get_scale()))
    return steps


def test_fp16s_scaler_skips_a_step_on_the_device_where_the_optimizer_is_fused():
    """Why fp16's step may be one graph: GradScaler hands a fused optimizer (the Adam a graphed
    run builds: capturable) its inf check as a device tensor, which skips the update on the
    device, and updates the scale with a device kernel (torch/amp/grad_scaler.py:
    _step_supports_amp_scaling, _amp_update_scale_): no host read, also in the step it skips.
    A foreach optimizer is stepped only after a read of the check on the host."""
    fused = fp16_steps({"fused": True, "capturable": True})
    assert [syncs for syncs, _, _ in fused] == [0, 0, 0]
    assert [moved for _, moved, _ in fused] == [True, True, False]  # the inf step skipped
    assert fused[2][2] == fused[1][2] / 2  # and the scale backed off
    foreach = fp16_steps({"foreach": True})
    assert all(syncs > 0 for syncs, _, _ in foreach), foreach


# FSDP2 with SGD as --cuda-graphs would build it: its rate scheduled, or constant; and Adam.
FSDP2_SGD = {
    "sgd, cosine": ({"optimizer": "sgd", "lr_schedule": "cosine"}, True),
    "sgd, warm-up": ({"optimizer": "sgd", "warmup_epochs": 1}, True),
    "sgd, constant": ({"optimizer": "sgd"}, False),  # a float rate, baked into the graph
    "adam, cosine": ({"optimizer": "adam", "lr_schedule": "cosine"}, False),  # fused Adam
}


def fsdp2_optimizers(env) -> dict:
    """Per FSDP2_SGD case, the optimizer a graphed run builds on FSDP2's sharded parameters:
    whether it is foreach, and whether its rate is a tensor."""
    built = {}
    for name, (options, _) in FSDP2_SGD.items():
        model = get_fsdp2_model(build_model("cnn", 10, (3, 32, 32)), env.device)
        optimizer = make_optimizer(Config(cuda_graphs=True, strategy="fsdp2", **options), model)
        foreach = bool(optimizer.defaults["foreach"]) and not optimizer.defaults["fused"]
        built[name] = foreach, torch.is_tensor(optimizer.param_groups[0]["lr"])
    return built


@pytest.mark.skipif(not CAPTURES_FSDP2, reason="FSDP2 refused whole before")
def test_fsdp2_with_sgd_and_a_schedule_is_refused_where_its_step_reads_the_rate_on_the_host():
    """FSDP2's SGD is foreach (this torch has no sharding rule for fused SGD on DTensors), and
    foreach SGD passes a tensor rate as `alpha=-lr`, a read on the host (torch/optim/sgd.py)
    that a capture forbids. Refused where make_optimizer builds exactly that, only there."""
    built = spawn(fsdp2_optimizers, 1)[0]
    for name, (options, refused) in FSDP2_SGD.items():
        why = graph_refusal(Config(cuda_graphs=True, strategy="fsdp2", **options), CUDA)
        assert all(built[name]) == refused, (name, built[name])  # foreach, and a tensor rate
        assert (why is not None) == refused, (name, why)
        assert not refused or why.startswith("FSDP2's SGD") and "--optimizer adam" in why, why


# FSDP2 runs eager by default: captured by torch 2.11 and newer, but not yet on a GPU here.
FSDP2_EAGER = "--strategy fsdp2 has not yet run captured" if CAPTURES_FSDP2 else FSDP2_REFUSED


@pytest.mark.parametrize(
    "options, device, graphed, why",
    [
        ({}, CUDA, True, None),  # the default on a GPU: what an H200 run showed
        ({"strategy": "single", "model": "resnet18", "precision": "bf16"}, CUDA, True, None),
        ({"channels_last": True, "precision": "tf32"}, CUDA, True, None),
        ({}, CPU, False, None),  # a CPU: eager, nothing to say
        ({"cuda_graphs": False}, CUDA, False, None),  # --no-cuda-graphs
        ({"strategy": "fsdp"}, CUDA, False, "--strategy fsdp cannot be captured"),
        ({"strategy": "fsdp2"}, CUDA, False, FSDP2_EAGER),
        ({"precision": "fp16"}, CUDA, False, "fp16's gradient scaler has not yet run captured"),
        ({"precision": "fp16", "cuda_graphs": True}, CUDA, True, None),  # asked for
        ({"lr_schedule": "cosine"}, CUDA, False, "a learning-rate schedule has not yet run"),
        ({"grad_accum": 2}, CUDA, False, "--grad-accum has not yet run captured"),
        ({"model": "resnet50"}, CUDA, False, "--model resnet50 has not yet run"),
        ({"cuda_graphs": True, "lr_schedule": "cosine"}, CUDA, True, None),  # asked for
        ({"loader": "classic"}, CUDA, False, "--loader classic pins batches"),  # not refused
        ({"loader": "classic", "num_workers": 0}, CUDA, False, "--loader classic has not yet"),
    ],
)
def test_graphs_are_the_default_on_a_gpu_where_shown_and_eager_says_why(
    options, device, graphed, why
):
    decided, note = decide_graphs(Config(**options), device, 1)
    assert decided == graphed
    assert note == why or why in note, note


def test_two_ranks_run_eager_by_default_until_a_gpu_run_shows_them_captured():
    """A machine where torch sees a GPU (its device passed in: nothing here touches CUDA), no
    process group (as main.py --check decides): one rank is graphed by default, two are eager
    and say why, and an explicit --cuda-graphs at two ranks is still accepted (NCCL's
    collectives can be captured)."""
    assert decide_graphs(Config(), CUDA, 1) == (True, None)
    assert decide_graphs(Config(), CUDA, 2) == (
        False,
        "DDP's communication across 2 GPUs has not yet run captured on a GPU "
        "(--cuda-graphs asks for it)",
    )
    asked = Config(cuda_graphs=True)
    assert graph_refusal(asked, CUDA) is None and decide_graphs(asked, CUDA, 2) == (True, None)


@pytest.mark.parametrize(
    "options, sizes, says",
    [
        ([], ["1"], "the step: one CUDA graph"),
        (["--no-cuda-graphs"], ["1"], "the step: eager"),
        (["--strategy", "fsdp"], ["1"], "the step: eager (--strategy fsdp cannot be captured"),
        (["--loader", "classic"], ["1"], "the step: eager (--loader classic pins batches"),
        (
            [],
            ["1", "2"],
            "the step: at world size 1: one CUDA graph; at world size 2: eager (DDP's "
            "communication across 2 GPUs has not yet run captured",
        ),
        (["--cuda-graphs"], ["2"], "the step: one CUDA graph"),
    ],
)
def test_check_says_whether_the_step_is_graphed(options, sizes, says):
    """--check as on a login node planning GPU runs (--device cuda, no GPU here): the step at
    each world size, where they differ."""
    done = run_main([*TINY, "--device", "cuda", *options, "--check", *sizes], timeout=120)
    assert done.returncode == 0 and says in done.stdout, (done.stdout, done.stderr)


def test_refusals_are_one_line_also_from_check_and_on_a_cpu():
    done = run_main([*CHECK, "--strategy", "fsdp"], timeout=120)
    assert_one_line_error(done, "--cuda-graphs: --strategy fsdp cannot be captured")
    done = run_main([*CHECK, "--loader", "classic"], timeout=120)
    assert_one_line_error(done, "--cuda-graphs: --loader classic pins batches")
    done = run_main([*TINY, "--cuda-graphs", "--epochs", "1"], timeout=120)
    assert_one_line_error(done, "--cuda-graphs: ", "it needs a GPU")


def train_two_epochs(env, static_buffers: bool, schedule: dict | None = None, strategy="ddp"):
    """This rank's parameters (its shards under FSDP2) and every step's loss sum after two
    epochs, with the plain step or the static-buffer step (eager; its warm-up covers part of the
    first epoch). With a learning-rate schedule, the static-buffer step gets the optimizer a
    graphed run gets: its rate a tensor that the scheduler fills between steps."""
    options = {"optimizer": "adam", "augment": True, "strategy": strategy, **(schedule or {})}
    cfg = Config(**{**EQUAL_CFG, **options})
    trainer, _ = build_trainer(cfg, env)
    if static_buffers:
        trainer.train_step = GraphedStep(trainer.step, env.device, warmup=3, capture=False)
        if schedule:
            graphed = replace(cfg, cuda_graphs=True)
            trainer.optimizer = make_optimizer(graphed, trainer.model)
            trainer.scheduler = make_scheduler(
                graphed, trainer.optimizer, len(trainer.loaders.train)
            )
    rate = trainer.optimizer.param_groups[0]["lr"]
    sums = []
    for epoch in (1, 2):
        reached, complete, _ = trainer.train_epoch(Position(epoch))
        assert complete
        sums.append(reached.loss_sum)
    if schedule and static_buffers:  # what a graph captures: one tensor, rewritten in place
        now = trainer.optimizer.param_groups[0]["lr"]
        assert torch.is_tensor(rate) and now is rate and float(now) != cfg.lr, (rate, now)
    step = trainer.train_step
    buffers = (step.images.data_ptr(), step.loss_sum is trainer.loss_sum) if static_buffers else ()
    local = [getattr(p, "to_local", lambda p=p: p)() for p in trainer.model.parameters()]
    return [p.detach().clone() for p in local], sums, buffers


# --lr-schedule cosine with warm-up. SGD: Adam turns a rounding difference in a near-zero
# gradient into a whole step of lr.
SCHEDULE = {"lr_schedule": "cosine", "warmup_epochs": 1, "epochs": 2, "optimizer": "sgd"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "strategy, schedule",
    [("ddp", None), ("fsdp2", None), ("ddp", SCHEDULE)],
    ids=["ddp", "fsdp2", "ddp-cosine"],
)
def test_the_static_buffer_step_trains_as_the_plain_step(strategy, schedule):
    """Exactly; on a schedule the graphed run's optimizer (a tensor rate, filled by the
    scheduler between steps) ends where the eager run ends, to rounding."""
    plain = spawn(train_two_epochs, 2, False, schedule, strategy)
    static = spawn(train_two_epochs, 2, True, schedule, strategy)
    tolerance = 1e-6 if schedule else 0
    for (params, sums, _), (static_params, static_sums, buffers) in zip(plain, static):
        assert static_sums == pytest.approx(sums, rel=10 * tolerance, abs=0)
        assert max((a - b).abs().max().item() for a, b in zip(params, static_params)) <= tolerance
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


# ----------------------------------------------------------------------------- FSDP2's units
# A replay runs no Python hook: no unit is gathered or freed by FSDP2's state, only by the
# kernels the capture recorded. So every unit must be in the state the capture began in,
# sharded, whenever a replay (or the capture) begins: a unit left gathered would have its next
# forward skip the gather and read the copy it holds.


def gathered_parameters(model, optimizer) -> list[str]:
    """The parameters the model holds that are not the optimizer's sharded DTensors: those of
    FSDP2 units left gathered (FSDPModule.reshard "registers the sharded parameters to the
    module"; a gathered unit holds plain tensors instead)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [
        name
        for name, p in model.named_parameters()
        if id(p) not in stepped or not isinstance(p, DTensor)
    ]


def units_gathered_around_validation(env, sharding: str) -> dict:
    """Two epochs of FSDP2 on this rank: the parameters left gathered at each step's start
    (where a capture or a replay would begin) and at each validation's end."""
    trainer, _ = build_trainer(
        Config(**{**EQUAL_CFG, "strategy": "fsdp2", "sharding": sharding}), env
    )
    model, optimizer, step = trainer.model, trainer.optimizer, trainer.step
    found = {"at a step's start": [], "after validation": []}

    def watched_step(images, labels, loss_sum):
        found["at a step's start"] += gathered_parameters(model, optimizer)
        step(images, labels, loss_sum)

    trainer.train_step = watched_step
    for epoch in (1, 2):
        trainer.run_epoch(Position(epoch))
        found["after validation"] += gathered_parameters(model, optimizer)
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharding", ["full", "grad_op"])
def test_fsdp2_validation_leaves_every_unit_sharded_as_a_replay_expects(sharding):
    """The root is kept gathered after forward (reshard_after_forward=False), and under grad_op
    every unit: validation, a forward with no backward to free them, must free them itself."""
    for found in spawn(units_gathered_around_validation, 2, sharding):
        assert found == {"at a step's start": [], "after validation": []}, found


def validation_after_a_hookless_step(env) -> tuple[float, float]:
    """FSDP2 on this rank: an epoch, then the weights moved as a replay moves them (the
    optimizer's step on the shards, no forward, so no FSDP2 hook), then validation: its val_loss,
    and that of a validation of the same weights after a state dict was taken (whose hook
    reshards every unit, as a checkpoint's does)."""
    trainer, _ = build_trainer(Config(**{**EQUAL_CFG, "strategy": "fsdp2"}), env)
    trainer.run_epoch(Position(1))
    # A gradient of each shard's own value: a small step that moves every layer's output (a
    # gradient of ones would shift the classifier's hidden layer below ReLU's zero, hiding the
    # convolutions). The optimizer's shards: a gathered unit holds other tensors.
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            p.grad = p.detach().clone()
    trainer.optimizer.step()
    after_step = trainer.evaluate()["val_loss"]
    full_state(env, trainer.model)
    return after_step, trainer.evaluate()["val_loss"]


@pytest.mark.timeout(240)
def test_fsdp2_validation_after_a_hookless_step_reads_the_current_weights():
    """What a graphed run's second validation met (issue 45): the root's layers evaluated with
    the weights of the previous validation, as if the epoch between had not trained them."""
    for after_step, current in spawn(validation_after_a_hookless_step, 2):
        assert after_step == current, (after_step, current)
