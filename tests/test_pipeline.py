"""Pipeline parallelism (--strategy pipeline) and naive model parallelism (--strategy model):
each stage holds its own consecutive layers, and both end where one process ends on the same
global batches; a pipeline resumes exactly, also after a stop mid-epoch."""

import pytest
import torch

import checkpoint
from checkpoint import Position
from config import Config
from conftest import TINY, assert_one_line_error, metrics_in, run_main
from dist_harness import EQUAL_CFG as CFG
from dist_harness import max_diff, signal_rank_then_train, spawn, train_and_gather
from model import build_model, count_parameters
from session import build_trainer, run

# fp32 on the CPU: the pipeline sums a step's gradient over its micro-batches, one process over
# the whole batch; both in another order, so they agree to rounding, not to the bit.
TOLERANCE = 1e-5

# What each stage holds, by the model's own names: the CNN's 4 units cut in 2 or 4.
STAGES = {
    2: [("conv1", "conv2"), ("conv3", "classifier")],
    4: [("conv1",), ("conv2",), ("conv3",), ("classifier",)],
}


def stage_state(env, cfg):
    """This rank's stage: the units it holds, its parameters, and the run's metrics."""
    outcome = run(cfg, env)
    model = outcome.trainer.model
    held = tuple(name for name, _ in model.named_children())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return held, state, outcome.history


def merged(results) -> dict:
    """The stages' parameters as one model's (no name held twice)."""
    whole = {}
    for _, state, _ in results:
        assert not whole.keys() & state.keys()
        whole.update(state)
    return whole


@pytest.fixture(scope="module")
def one_process():
    """The single-device run on the same global batches, and its untrained start."""
    state, history = spawn(train_and_gather, 1, Config(**CFG, strategy="single"))[0]
    initial, _ = spawn(train_and_gather, 1, Config(**{**CFG, "epochs": 0}, strategy="single"))[0]
    assert max_diff(state, initial) > 1e-2  # training moved the weights
    return state, history


@pytest.mark.parametrize("stages,schedule", [(2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b")])
def test_pipeline_ends_where_one_process_ends(one_process, stages, schedule):
    """Each stage holds its own units' parameters alone: at 4 stages the classifier's holds
    nearly all of the state, and state_mem is the largest stage's, the last one's."""
    ref_state, ref_history = one_process
    results = spawn(stage_state, stages, Config(**CFG, strategy="pipeline", schedule=schedule))
    assert [held for held, _, _ in results] == STAGES[stages]
    model = build_model("cnn")
    own = [sum(count_parameters(getattr(model, u)) for u in units) for units in STAGES[stages]]
    assert [sum(v.numel() for v in state.values()) for _, state, _ in results] == own
    diff = max_diff(merged(results), ref_state)
    print(f"pipeline {stages} stages {schedule}: max |param diff| = {diff:.3g}")
    assert diff <= TOLERANCE
    histories = [history for _, _, history in results]
    for mine, ref in zip(histories[0], ref_history):
        assert mine["train_loss"] == pytest.approx(ref["train_loss"], rel=TOLERANCE)
        assert mine["val_loss"] == pytest.approx(ref["val_loss"], rel=TOLERANCE)
        assert mine["acc"] == ref["acc"]
        assert mine["train_images"] == ref["train_images"] == 240  # every image once
        assert mine["microbatches"] == 2 * stages  # the default
        assert mine["bubble_ideal"] == pytest.approx((stages - 1) / (3 * stages - 1))
        assert 0 < mine["bubble"] < 1
        # parameters, gradients and SGD's momentum: 3 fp32 copies of the largest stage
        assert mine["state_mem"] == 3 * 4 * max(own) == 3 * 4 * own[-1]
    # Every rank has the same numbers (the last stage's loss, the max of the stages' memory),
    # but for its own clock's validation time: any rank's [METRIC] line would say the same.
    for history in histories:
        for mine, first in zip(history, histories[0]):
            assert {**mine, "val_time": 0} == {**first, "val_time": 0}


def test_clipping_takes_the_norm_over_every_stage():
    """Clipped hard (every step is scaled), 2 stages end where one process ends: the norm was
    the whole model's, not a stage's."""
    clipped = dict(CFG, clip_grad=0.05, epochs=1)
    single, _ = spawn(train_and_gather, 1, Config(**clipped, strategy="single"))[0]
    unclipped, _ = spawn(train_and_gather, 1, Config(**{**CFG, "epochs": 1}, strategy="single"))[0]
    assert max_diff(single, unclipped) > 1e-3, "clipping must change the run"
    results = spawn(stage_state, 2, Config(**clipped, strategy="pipeline"))
    assert max_diff(merged(results), single) <= TOLERANCE


def schedule_order(env, cfg) -> str:
    """The order in which this stage ran one training step's forwards (F) and backwards (B)."""
    trainer, _ = build_trainer(cfg, env)
    trainer.train_epoch(Position(1))  # one-off work (buffers, shapes) out of the step recorded
    order, stage = [], trainer.stage

    def recording(letter: str, run):
        def recorded(*args, **kwargs):
            order.append(letter)
            return run(*args, **kwargs)

        return recorded

    stage.forward_one_chunk = recording("F", stage.forward_one_chunk)
    stage.backward_one_chunk = recording("B", stage.backward_one_chunk)
    images, labels = next(iter(trainer.loaders.train))
    trainer.step(images, labels, trainer.loss_sum)
    return "".join(order)


def most_held(order: str) -> int:
    """The most micro-batches whose activations a stage held at once: forwarded, not yet
    backwarded."""
    held = peak = 0
    for letter in order:
        held += 1 if letter == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_schedule_runs_its_order_and_holds_its_activations(schedule):
    """At 2 stages and 8 micro-batches, each stage runs every forward and backward once. GPipe:
    all 8 forwards, then the 8 backwards, so a stage holds 8 micro-batches' activations. 1F1B:
    a stage forwards p - rank micro-batches, then alternates a backward and a forward, so it
    holds p - rank at most (2 and 1): the memory 1F1B is chosen for (docs/concepts.md)."""
    cfg = Config(**{**CFG, "epochs": 1}, strategy="pipeline", microbatches=8, schedule=schedule)
    orders = spawn(schedule_order, 2, cfg)
    print(schedule, orders)
    assert all(sorted(order) == ["B"] * 8 + ["F"] * 8 for order in orders)
    if schedule == "gpipe":
        assert orders == ["F" * 8 + "B" * 8] * 2
        assert [most_held(order) for order in orders] == [8, 8]
    else:
        assert orders == ["FF" + "BF" * 6 + "BB", "FB" * 8]
        assert [most_held(order) for order in orders] == [2, 1]


SLOW_FORWARD_S = 0.02


def waits_behind_a_slow_last_stage(env, cfg):
    """The last stage's forwards made 20 ms longer: each stage's own share of the epoch's steps
    spent waiting, and its compute time."""
    import time

    from model import Part

    if env.rank == env.world_size - 1:
        forward = Part.forward

        def slow_forward(self, x):
            time.sleep(SLOW_FORWARD_S)
            return forward(self, x)

        Part.forward = slow_forward
    clock = run(cfg, env).trainer.clock
    return 1 - clock.busy / clock.seconds, clock.busy, clock.steps


def test_the_bubble_is_the_time_a_stage_waits_for_a_slow_neighbour():
    """With the last of 2 stages slowed, the first waits for it most of each step and the last
    hardly waits: the measured bubble counts waiting, not computing. The last stage's compute
    clock holds every slowed forward of training (10 steps x 4 micro-batches x 20 ms) and none
    of validation's (it would then exceed the steps' time: a negative wait)."""
    cfg = Config(**{**CFG, "epochs": 1}, strategy="pipeline", microbatches=4)
    (first_wait, _, steps), (last_wait, last_busy, _) = spawn(
        waits_behind_a_slow_last_stage, 2, cfg
    )
    print(f"waited: first stage {first_wait:.2f}, last stage {last_wait:.2f}")
    assert steps == 10
    assert last_busy >= steps * 4 * SLOW_FORWARD_S
    assert first_wait > 0.5 > last_wait >= 0


def synchronisations_in_an_epoch(env, cfg):
    """How often the device is synchronised while a pipeline stage trains an epoch."""
    import measure
    import pipeline_utils

    calls, synchronize_device = [], measure.synchronize_device

    def counted(device):
        calls.append(device)
        synchronize_device(device)

    for module in (measure, pipeline_utils):  # wherever a stage could reach it from
        if hasattr(module, "synchronize_device"):
            module.synchronize_device = counted
    trainer = build_trainer(cfg, env)[0]
    trainer.train_epoch(Position(1))
    return len(calls), trainer.clock.steps


def test_timing_a_stage_does_not_synchronise_the_device_per_chunk():
    """A stage's forwards and backwards are timed without waiting for the device around each
    (which on a GPU would also wait for the stage's sends and keep them from overlapping the
    next micro-batch): the epoch synchronises at its start and end only, not per chunk."""
    cfg = Config(**{**CFG, "epochs": 1}, strategy="pipeline", microbatches=4)
    for calls, steps in spawn(synchronisations_in_an_epoch, 2, cfg):
        assert steps == 10 and calls <= 2, calls  # per chunk: 2 x 2 x 4 x 10 = 160


def test_naive_model_parallel_ends_where_one_process_ends(one_process):
    ref_state, _ = one_process
    state, _ = spawn(train_and_gather, 1, Config(**CFG, strategy="model"))[0]
    assert max_diff(state, ref_state) <= 1e-6


def test_model_parallel_places_consecutive_parts_and_computes_the_model():
    """Four 'devices' (the CPU four times: the placement logic without GPUs): four parts, one
    unit each, in order, and the model's output; the rank computes on all four (mfu's count)."""
    from model_parallel import ModelParallel
    from strategies import devices_per_rank

    torch.manual_seed(0)
    model = build_model("cnn").eval()
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    parallel = ModelParallel(model, [torch.device("cpu")] * 4)
    assert [tuple(dict(part.named_children())) for part in parallel.parts] == STAGES[4]
    assert torch.equal(parallel(x), expected)
    assert parallel.state_dict().keys() == model.state_dict().keys()
    assert devices_per_rank(torch.compile(parallel)) == 4


@pytest.mark.parametrize("visible,used", [(1, 1), (2, 2), (3, 2), (4, 4), (8, 4)])
def test_model_parallel_takes_as_many_gpus_as_divide_the_units(monkeypatch, visible, used):
    """The CNN's 4 units: 2 of 3 visible GPUs, 4 of 8 (no GPU is needed to ask)."""
    from model_parallel import usable_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    devices = usable_devices(4, torch.device("cuda", 0))
    assert devices == [torch.device("cuda", i) for i in range(used)]
    assert usable_devices(4, torch.device("cpu")) == [torch.device("cpu")]


def test_model_parallel_on_one_device_says_so():
    """The log line and the [METRIC] line agree: the model ran whole, nothing split."""
    args = [*TINY, "--batch-size", "64", "--epochs", "1", "--no-checkpoint"]
    done = run_main([*args, "--strategy", "model"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "model: one device here (cpu): the model runs whole on it" in done.stdout
    assert [m["sharding"] for m in metrics_in(done.stdout)] == ["replicate"]


# ----------------------------------------------------------------------------- resume

RESUME = dict(CFG, strategy="pipeline", epochs=3, checkpoint=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    cfg = Config(**RESUME, checkpoint_dir=str(tmp_path_factory.mktemp("pp")))
    return spawn(stage_state, 2, cfg)


def assert_same_stages(results, reference):
    assert max_diff(merged(results), merged(reference)) == 0  # to the bit
    ref_history = reference[0][2]
    for mine in results[0][2]:
        ref = ref_history[mine["epoch"] - 1]
        # A stopped epoch's loss is summed in two parts: the same to rounding (test_resume.py's).
        assert mine["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-6)
        assert (mine["val_loss"], mine["acc"]) == (ref["val_loss"], ref["acc"])


def test_pipeline_resumes_exactly_from_a_file_per_stage(tmp_path, straight):
    common = dict(RESUME, checkpoint_dir=str(tmp_path))
    spawn(stage_state, 2, Config(**{**common, "epochs": 1}))
    saved = checkpoint.latest(tmp_path)
    assert sorted(p.name for p in saved.glob("stage*.pt")) == ["stage0.pt", "stage1.pt"]
    results = spawn(stage_state, 2, Config(**common, resume="auto"))
    assert [h["epoch"] for h in results[0][2]] == [2, 3]
    assert_same_stages(results, straight)


def stop_then_state(env, cfg, at_poll):
    return signal_rank_then_train(env, cfg, at_poll, train=stage_state)


def test_pipeline_resumes_exactly_after_a_stop_mid_epoch(tmp_path, straight):
    common = dict(RESUME, checkpoint_dir=str(tmp_path))
    # 10 steps an epoch, agreements every 4 polls: the signal at the 13th poll (epoch 2's
    # third step) is read at the 17th, after epoch 2's 6th step.
    spawn(stop_then_state, 2, Config(**common), 13)
    assert checkpoint.latest(tmp_path).name == "ckpt_e0002_s000006"
    results = spawn(stage_state, 2, Config(**common, resume="auto"))
    assert_same_stages(results, straight)


def test_a_pipeline_checkpoint_resumes_only_with_as_many_stages(tmp_path):
    common = dict(RESUME, checkpoint_dir=str(tmp_path), epochs=1)
    spawn(stage_state, 2, Config(**common))
    with pytest.raises(AssertionError, match="holds 2 pipeline stages: resume it on 2 ranks"):
        spawn(stage_state, 4, Config(**{**common, "epochs": 2}, resume="auto"))


# ----------------------------------------------------------------------------- checks


def test_check_takes_the_world_sizes_the_model_cuts_into():
    ok = run_main(["--check", "2", "4", *TINY, "--strategy", "pipeline"])
    assert ok.returncode == 0, ok.stderr
    assert "strategy=pipeline world sizes 2 4" in ok.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--check", "3"], "one stage per rank, the same number each: world size 2 or 4, not 3"),
        (["--check", "1"], "world size 2 or 4, not 1"),
        (["--check", "8"], "not 8"),
        (["--check", "2", "--microbatches", "5"], "does not split into 5 equal micro-batches"),
        (["--check", "4", "--microbatches", "2"], "at least one micro-batch per stage: 2 < 4"),
        (["--check", "2", "--grad-accum", "2"], "--grad-accum: use --microbatches"),
        (["--check", "2", "--precision", "bf16"], "fp32 or tf32 only"),
        (
            ["--check", "2", "--strategy", "ddp", "--microbatches", "4"],
            "is for --strategy pipeline",
        ),
    ],
)
def test_check_refuses_what_a_pipeline_cannot_run(args, fragment):
    done = run_main([*TINY, "--batch-size", "64", "--strategy", "pipeline", *args])
    assert_one_line_error(done, fragment)
