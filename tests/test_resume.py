"""Checkpoint and resume: an interrupted run ends exactly where an uninterrupted one ends."""

import shutil
from dataclasses import replace

import pytest
import torch

import checkpoint
from config import Config
from dist_harness import (
    EQUAL_CFG,
    full_state,
    max_diff,
    mid_epoch_stop,
    signal_rank_then_train,
    spawn,
    spawn_outcomes,
    stop_mid_epoch_then_resume,
    train_and_gather,
)
from session import run

# Augmentation on: resuming must also restore every rank's random stream.
CFG = dict(
    dataset="synthetic",
    augment=True,
    train_samples=384,
    val_samples=96,
    batch_size=32,
    print_every=10**6,
    seed=5,
)
# [METRIC] fields that measure the machine's speed and memory, not the training: they differ
# between any two runs. Every other field must be the same after a resume.
MACHINE_FIELDS = {
    "time",
    "val_time",
    "throughput",
    "data_wait",
    "peak_mem",
    "reserved_mem",
    "act_per_image",  # the peak's share above the state
    "t_compute",
    "t_data",
    "t_comm",
    "t_wait",
    "t_other",
    "compute_spread",
    "tflops",
    "mfu",
    "slowest_rank",
    "rank_time_spread",
    "breakdown",  # whether the calibration could tell compute from the rest
    "gpu_busy",
}


def assert_same_run(state, history, ref_state, ref_history, epochs):
    assert max_diff(state, ref_state) <= 1e-6
    assert [h["epoch"] for h in history] == list(epochs)
    for mine in history:
        ref = ref_history[mine["epoch"] - 1]
        assert mine.keys() == ref.keys()
        for key in mine.keys() - MACHINE_FIELDS:
            expected = (
                ref[key]
                if isinstance(ref[key], str)
                else pytest.approx(ref[key], rel=1e-6, abs=1e-9)
            )
            assert mine[key] == expected, (mine["epoch"], key)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four uninterrupted epochs per strategy, at world size 2: (the final state, the history,
    the folder of its checkpoints)."""
    runs = {}
    for strategy in ("ddp", "fsdp", "fsdp2"):
        folder = tmp_path_factory.mktemp(strategy)
        cfg = Config(**CFG, strategy=strategy, epochs=4, checkpoint_dir=str(folder))
        runs[strategy] = (*spawn(train_and_gather, 2, cfg)[0], folder)
    return runs


def test_two_epochs_then_resume_equals_four_straight(tmp_path, straight):
    """At an epoch's end; each strategy's own checkpoint files are resumed mid-epoch below."""
    ref_state, ref_history, _ = straight["ddp"]
    common = dict(**CFG, strategy="ddp", checkpoint_dir=str(tmp_path))
    spawn(train_and_gather, 2, Config(**common, epochs=2))
    state, history = spawn(train_and_gather, 2, Config(**common, epochs=4, resume="auto"))[0]
    assert_same_run(state, history, ref_state, ref_history, epochs=[3, 4])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_stop_on_signal_mid_epoch_then_resume_equals_straight(tmp_path, straight, strategy):
    ref_state, ref_history, _ = straight[strategy]
    common = dict(**CFG, strategy=strategy, checkpoint_dir=str(tmp_path), epochs=4)
    # 12 steps per epoch: the 17th poll comes before epoch 2's fifth step (index 4), and it is
    # one of the polls that start an agreement (the 1st, 5th, 9th, ...). The ranks read its
    # result at the next one, the 21st poll: both stop after 8 steps of epoch 2.
    _, first = spawn(signal_rank_then_train, 2, Config(**common), 17)[0]
    saved = checkpoint.latest(tmp_path)
    assert saved.name == "ckpt_e0002_s000008"
    assert [h["epoch"] for h in first] == [1]  # the interrupted epoch printed no [METRIC] line

    state, rest = spawn(train_and_gather, 2, Config(**common, resume="auto"))[0]
    assert_same_run(state, first + rest, ref_state, ref_history, epochs=[1, 2, 3, 4])


def test_the_gpu_tests_stop_lands_mid_epoch_by_construction(tmp_path):
    """test_gpu's stop, with its numbers, on a CPU (so that every machine checks them): 10 steps
    an epoch, the signal at epoch 2's first poll, the agreement read 6 steps in; resumed, the
    run ends as an uninterrupted one."""
    cfg = Config(**{**EQUAL_CFG, "strategy": "ddp", "epochs": 2})
    assert mid_epoch_stop(cfg.train_samples // cfg.batch_size) == (11, "ckpt_e0002_s000006")
    reached, difference = stop_mid_epoch_then_resume(tmp_path, cfg)
    assert reached == "ckpt_e0002_s000006"
    assert difference <= 1e-6


def resumed_state(env, cfg):
    """Resume (training nothing: the checkpoint is already at cfg.epochs) and return the
    weights and the random streams."""
    outcome = run(cfg, env)
    streams = (torch.get_rng_state(), outcome.trainer.loaders.generator.get_state())
    return full_state(env, outcome.trainer.model), streams


def fresh_streams(env, cfg):
    outcome = run(cfg, env)
    return torch.get_rng_state(), outcome.trainer.loaders.generator.get_state()


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2", "ddp"])
def test_resume_at_another_world_size_loads_the_weights_exactly(tmp_path, straight, strategy):
    """A world-size-2 checkpoint (straight's last), named by its path, loads at world size 1:
    the same weights to the bit, and the random streams start afresh (the ranks' saved streams
    map onto no new rank); training on, the run writes its checkpoints beside it."""
    saved, _, folder = straight[strategy]
    last = shutil.copytree(folder, tmp_path / "ckpt") / "ckpt_e0005_s000000"
    resumed = dict(**CFG, strategy=strategy, resume=str(last))
    state, streams = spawn(resumed_state, 1, Config(**resumed, epochs=4))[0]
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in state)
    fresh = spawn(fresh_streams, 1, Config(**CFG, strategy=strategy, epochs=0, checkpoint=False))
    assert all(torch.equal(a, b) for a, b in zip(streams, fresh[0]))
    _, history = spawn(train_and_gather, 1, Config(**resumed, epochs=5))[0]
    assert [h["epoch"] for h in history] == [5]
    assert checkpoint.latest(last.parent).name == "ckpt_e0006_s000000"


def test_unfinished_checkpoint_is_never_the_latest(tmp_path):
    (tmp_path / "ckpt_e0002_s000000").mkdir()
    torch.save({}, tmp_path / "ckpt_e0002_s000000" / checkpoint.META_FILE)
    (tmp_path / "ckpt_e0003_s000000.tmp").mkdir()  # a crash mid-write
    (tmp_path / "ckpt_e0004_s000000").mkdir()  # no meta file: not finished
    assert checkpoint.latest(tmp_path).name == "ckpt_e0002_s000000"


def test_a_mid_epoch_checkpoint_resumes_at_its_global_batch_and_survives_an_early_stop(tmp_path):
    """Stopped 2 steps into epoch 2: resumed with another global batch, refused (its position
    counts that batch's steps); stopped again before the first step after resuming (a warning
    that lands during start-up; one rank: there the poll answers at once), nothing new to save
    and no crash over it."""
    common = dict(**CFG, strategy="ddp", checkpoint_dir=str(tmp_path), epochs=3)
    spawn(signal_rank_then_train, 1, Config(**common), 15, 0)  # stops at epoch 2 after 2 steps
    assert checkpoint.latest(tmp_path).name == "ckpt_e0002_s000002"
    ((status, message),) = spawn_outcomes(
        train_and_gather, 1, Config(**{**common, "batch_size": 16}, resume="auto")
    )
    assert status == "error" and "resume it with --batch-size 32" in message.splitlines()[0]
    _, history = spawn(signal_rank_then_train, 1, Config(**common, resume="auto"), 1, 0)[0]
    assert history == [] and checkpoint.latest(tmp_path).name == "ckpt_e0002_s000002"


# ----------------------------------------------------------------------------- across modes
# The optimizer and schedule each kind of run builds (optim.py): an eager run's, or the one a
# graphed CUDA run builds (capturable, its rate a tensor that the scheduler fills), which a CPU
# builds as well; or an eager run's without a schedule.
MODES = {
    "eager": {"cuda_graphs": False},
    "graphed": {"cuda_graphs": True},
    "constant": {"cuda_graphs": False, "lr_schedule": "none"},
}
# How an optimizer steps: the run's own, whoever wrote the checkpoint.
HOW_IT_STEPS = ("capturable", "differentiable", "foreach", "fused")


def resume_across_modes(env, strategy: str, folder: str, written_by: str, read_by: str) -> dict:
    """One rank: a model trained 3 steps by a `written_by` run's optimizer and schedule and
    saved, then resumed through checkpoint.load by a `read_by` run's, and both stepped once more
    on the same batch. Returns what the resumed optimizer holds beside a fresh one of its
    configuration, and the writer's and the resumed run's rates and weights after that step."""
    import torch.nn.functional as F

    from model import build_model
    from optim import make_optimizer, make_scheduler
    from strategies import wrap_model

    cfg = Config(strategy=strategy, lr_schedule="cosine", epochs=2)
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def built(mode: str, model=None):
        """A run's model (or `model`), its optimizer and schedule."""
        if model is None:
            model = wrap_model(cfg, build_model("cnn"), env.device, env.rank, env.world_size, 1)
        run_cfg = replace(cfg, **MODES[mode])
        optimizer = make_optimizer(run_cfg, model)
        return model, optimizer, make_scheduler(run_cfg, optimizer, steps_per_epoch=10)

    def step(model, optimizer, scheduler):
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler:
            scheduler.step()

    def forms(group) -> dict:
        """Each rate's type, dtype and device."""
        return {
            key: (type(rate).__name__, getattr(rate, "dtype", None), getattr(rate, "device", None))
            for key, rate in group.items()
            if key in ("lr", "initial_lr")
        }

    writer = built(written_by)
    for _ in range(3):
        step(*writer)
    identity = checkpoint.Identity(strategy, "cnn", 0, len(images))
    written = checkpoint.Resumable(*writer[:2], None, writer[2])
    saved = checkpoint.save(folder, checkpoint.Position(1, 3), identity, written)
    model, optimizer, scheduler = built(read_by)
    own_rate = optimizer.param_groups[0]["lr"]
    fresh = built(read_by, model)[1].param_groups[0]
    checkpoint.load(saved, identity, checkpoint.Resumable(model, optimizer, None, scheduler))
    group = optimizer.param_groups[0]
    found = {
        "how": {key: group[key] for key in HOW_IT_STEPS if key in fresh},
        "fresh_how": {key: fresh[key] for key in HOW_IT_STEPS if key in fresh},
        "forms": forms(group),
        "fresh_forms": forms(fresh),
        "own_rate_kept": group["lr"] is own_rate,
        "rate": float(group["lr"]),
        "written_rate": float(writer[1].param_groups[0]["lr"]),
    }
    step(*writer)
    step(model, optimizer, scheduler)
    group = optimizer.param_groups[0]
    found["next"] = float(group["lr"]), float(writer[1].param_groups[0]["lr"])
    found["forms_after_step"] = forms(group)
    found["own_rate_kept_after_step"] = group["lr"] is own_rate
    found["weights"] = full_state(env, model), full_state(env, writer[0])
    return found


@pytest.mark.parametrize(
    "written_by, read_by",
    [("eager", "graphed"), ("graphed", "eager"), ("graphed", "graphed"), ("constant", "graphed")],
)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_checkpoint_resumes_with_the_optimizer_this_run_builds(
    tmp_path, strategy, written_by, read_by
):
    """DDP's one file and FSDP2's shards, written by an eager run and resumed by a graphed one,
    the other way, graphed both, or written without a schedule: the resumed optimizer steps as
    this run's own (capturable, fused/foreach), its rates are of the forms a fresh one's are (a
    graphed run's rate the very tensor its graph reads), the schedule goes on writing into it,
    and the next step trains as the writer's would."""
    (found,) = spawn(resume_across_modes, 1, strategy, str(tmp_path), written_by, read_by)
    assert found["how"] == found["fresh_how"]
    assert found["forms"] == found["fresh_forms"]
    assert found["own_rate_kept"] == (read_by == "graphed")
    assert found["rate"] == pytest.approx(found["written_rate"], rel=1e-6)
    assert max_diff(*found["weights"]) <= 1e-6
    resumed_next, written_next = found["next"]
    assert resumed_next != found["rate"], "the schedule no longer moves the rate"
    if written_by != "constant":  # else the schedule starts afresh
        assert resumed_next == pytest.approx(written_next, rel=1e-6)
    assert found["forms_after_step"] == found["fresh_forms"]
    assert found["own_rate_kept_after_step"] == (read_by == "graphed")
