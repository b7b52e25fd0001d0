"""Checkpoint and resume: an interrupted run ends exactly where an uninterrupted one ends."""

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
    """Four uninterrupted epochs per strategy, at world size 2."""
    runs = {}
    for strategy in ("ddp", "fsdp", "fsdp2"):
        cfg = Config(
            **CFG,
            strategy=strategy,
            epochs=4,
            checkpoint_dir=str(tmp_path_factory.mktemp(strategy)),
        )
        runs[strategy] = spawn(train_and_gather, 2, cfg)[0]
    return runs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_two_epochs_then_resume_equals_four_straight(tmp_path, straight, strategy):
    ref_state, ref_history = straight[strategy]
    common = dict(**CFG, strategy=strategy, checkpoint_dir=str(tmp_path))
    spawn(train_and_gather, 2, Config(**common, epochs=2))
    state, history = spawn(train_and_gather, 2, Config(**common, epochs=4, resume="auto"))[0]
    assert_same_run(state, history, ref_state, ref_history, epochs=[3, 4])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_stop_on_signal_mid_epoch_then_resume_equals_straight(tmp_path, straight, strategy):
    ref_state, ref_history = straight[strategy]
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
    weights, the random streams and the position it loaded."""
    outcome = run(cfg, env)
    streams = (torch.get_rng_state(), outcome.trainer.loaders.generator.get_state())
    return full_state(env, outcome.trainer.model), streams


def fresh_streams(env, cfg):
    outcome = run(cfg, env)
    return torch.get_rng_state(), outcome.trainer.loaders.generator.get_state()


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2", "ddp"])
def test_resume_at_another_world_size_loads_the_weights_exactly(tmp_path, strategy):
    """A world-size-2 checkpoint loads at world size 1: the same weights to the bit, and the
    random streams start afresh (the ranks' saved streams map onto no new rank)."""
    common = dict(**CFG, strategy=strategy, checkpoint_dir=str(tmp_path), epochs=2)
    saved, _ = spawn(train_and_gather, 2, Config(**common))[0]
    state, streams = spawn(resumed_state, 1, Config(**common, resume="auto"))[0]
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in state)
    fresh = spawn(fresh_streams, 1, Config(**{**common, "epochs": 0, "checkpoint": False}))[0]
    assert all(torch.equal(a, b) for a, b in zip(streams, fresh))
    # And it trains on from there.
    _, history = spawn(train_and_gather, 1, Config(**{**common, "epochs": 3}, resume="auto"))[0]
    assert [h["epoch"] for h in history] == [3]


def test_checkpoint_of_another_strategy_is_refused(tmp_path):
    common = dict(**CFG, checkpoint_dir=str(tmp_path), epochs=1)
    spawn(train_and_gather, 1, Config(**common, strategy="ddp"))
    ((status, message),) = spawn_outcomes(
        train_and_gather, 1, Config(**common, strategy="fsdp", resume="auto")
    )
    assert status == "error" and "written by strategy=ddp" in message.splitlines()[0]


def test_unfinished_checkpoint_is_never_the_latest(tmp_path):
    (tmp_path / "ckpt_e0002_s000000").mkdir()
    torch.save({}, tmp_path / "ckpt_e0002_s000000" / checkpoint.META_FILE)
    (tmp_path / "ckpt_e0003_s000000.tmp").mkdir()  # a crash mid-write
    (tmp_path / "ckpt_e0004_s000000").mkdir()  # no meta file: not finished
    assert checkpoint.latest(tmp_path).name == "ckpt_e0002_s000000"


def test_fresh_run_never_overwrites_an_earlier_runs_checkpoints(tmp_path):
    common = dict(**CFG, checkpoint_dir=str(tmp_path), epochs=1)
    spawn(train_and_gather, 1, Config(**common))
    ((status, message),) = spawn_outcomes(train_and_gather, 1, Config(**common))
    assert status == "error" and "--resume auto" in message.splitlines()[0]


def test_stop_before_the_first_step_after_resuming_keeps_that_checkpoint(tmp_path):
    """A warning that lands during start-up: nothing new to save, and no crash over it.
    (One rank: there the poll answers at once, before any step.)"""
    common = dict(**CFG, strategy="ddp", checkpoint_dir=str(tmp_path), epochs=3)
    spawn(signal_rank_then_train, 1, Config(**common), 15, 0)  # stops at epoch 2 after 2 steps
    assert checkpoint.latest(tmp_path).name == "ckpt_e0002_s000002"
    _, history = spawn(signal_rank_then_train, 1, Config(**common, resume="auto"), 1, 0)[0]
    assert history == [] and checkpoint.latest(tmp_path).name == "ckpt_e0002_s000002"


def test_mid_epoch_checkpoint_needs_the_same_global_batch(tmp_path):
    common = dict(**CFG, strategy="ddp", checkpoint_dir=str(tmp_path), epochs=3)
    spawn(signal_rank_then_train, 1, Config(**common), 15, 0)  # stops at epoch 2 after 2 steps
    ((status, message),) = spawn_outcomes(
        train_and_gather, 1, Config(**{**common, "batch_size": 16}, resume="auto")
    )
    assert status == "error" and "resume it with --batch-size 32" in message.splitlines()[0]


def test_resume_from_a_path_goes_on_writing_beside_it(tmp_path):
    common = dict(**CFG, strategy="ddp")
    spawn(train_and_gather, 1, Config(**common, epochs=1, checkpoint_dir=str(tmp_path)))
    spawn(
        train_and_gather, 1, Config(**common, epochs=2, resume=str(tmp_path / "ckpt_e0002_s000000"))
    )
    assert checkpoint.latest(tmp_path).name == "ckpt_e0003_s000000"
