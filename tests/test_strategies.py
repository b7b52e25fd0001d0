"""The breadth beyond the course: one-process baselines (single, dp), ResNets, gradient
accumulation and clipping, learning-rate schedules, and checkpoints on a shared file system
(--keep-last, an unreadable newest checkpoint). Each on real gloo ranks, each able to fail."""

import pytest

import checkpoint
from config import Config
from conftest import TINY, assert_one_line_error, main_on_ranks, metrics_in, run_main
from dist_harness import EQUAL_CFG as EQUAL
from dist_harness import full_state, max_diff, signal_rank_then_train, spawn, train_and_gather
from session import build_trainer, run


@pytest.fixture(scope="module")
def one_process():
    """The equivalence tests' reference run: one process, SGD, no wrapper to speak of."""
    return spawn(train_and_gather, 1, Config(**EQUAL))[0][0]


# ----------------------------------------------------------------------------- baselines


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_one_process_baselines_train_like_ddp_on_one_rank(one_process, strategy):
    state, _ = spawn(train_and_gather, 1, Config(**EQUAL, strategy=strategy))[0]
    state = {k.removeprefix("module."): v for k, v in state.items()}  # DataParallel's prefix
    assert max_diff(state, one_process) <= 1e-6


@pytest.mark.parametrize("strategy", ["single", "dp", "model"])
def test_one_process_baselines_refuse_several_processes(strategy):
    done = main_on_ranks([*TINY, "--batch-size", "64", "--strategy", strategy], 2)[0]
    assert_one_line_error(done, "start one process")
    check = run_main(["--check", "1", "2", *TINY, "--batch-size", "64", "--strategy", strategy])
    assert_one_line_error(check, f"--strategy {strategy} drives every device from one process")


def test_dp_without_a_gpu_says_it_runs_on_the_cpu():
    done = run_main([*TINY, *"--batch-size 64 --epochs 1 --no-checkpoint --strategy dp".split()])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DataParallel runs the model on the CPU as one device" in done.stdout


# ----------------------------------------------------------------------------- training options


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_gradient_accumulation_equals_one_big_step(one_process, strategy):
    """--grad-accum 4 on two ranks: each rank's 12 images as 4 micro-batches of 3, gradients
    reduced once per step: the same parameters as one process with whole batches."""
    state, history = spawn(train_and_gather, 2, Config(**EQUAL, strategy=strategy, grad_accum=4))[0]
    assert max_diff(state, one_process) <= 1e-5


def test_grad_accum_must_split_the_local_batch():
    done = run_main(["--check", "2", *TINY, "--batch-size", "64", "--grad-accum", "5"])
    assert_one_line_error(done, "do not split into --grad-accum 5")


CLIPPED = dict(EQUAL, clip_grad=0.05)  # far below the norm: every step is scaled


@pytest.fixture(scope="module")
def clipped_in_one_process(one_process):
    state, _ = spawn(train_and_gather, 1, Config(**CLIPPED))[0]
    assert max_diff(state, one_process) > 1e-3, "clipping must change the run"
    return state


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_clipping_uses_the_global_norm_over_ranks_and_shards(clipped_in_one_process, strategy):
    """Clipped hard, two ranks end where one process ends: the norm was taken over all of the
    gradient, not one rank's shard."""
    state, _ = spawn(train_and_gather, 2, Config(**CLIPPED, strategy=strategy))[0]
    assert max_diff(state, clipped_in_one_process) <= 1e-5


def learning_rates(env, cfg):
    outcome = run(cfg, env)
    rates = [g["lr"] for g in outcome.trainer.optimizer.param_groups]
    return rates, full_state(env, outcome.trainer.model)


@pytest.mark.parametrize("schedule", ["step", "cosine"])
def test_lr_schedule_follows_its_formula_and_resumes(tmp_path, schedule):
    base = dict(EQUAL, lr_schedule=schedule, warmup_epochs=1, epochs=4, checkpoint=True)
    straight_lrs, straight = spawn(
        learning_rates, 2, Config(**base, checkpoint_dir=str(tmp_path / "a"))
    )[0]
    # 10 steps per epoch, 40 in all, 10 of warm-up; the step after the last has been taken.
    expected = {"step": 0.05 * 0.01, "cosine": 0.0}[schedule]
    assert straight_lrs[0] == pytest.approx(expected, abs=1e-12)
    # The same run stopped by a signal in epoch 3 (the schedule depends on the run's length:
    # a shorter run would be another schedule), then resumed.
    folder = str(tmp_path / "b")
    spawn(signal_rank_then_train, 2, Config(**base, checkpoint_dir=folder), 25, 1, learning_rates)
    assert checkpoint.latest(folder).name.startswith("ckpt_e0003_s")
    resumed_lrs, resumed = spawn(
        learning_rates, 2, Config(**base, checkpoint_dir=folder, resume="auto")
    )[0]
    assert resumed_lrs == straight_lrs
    assert max_diff(resumed, straight) <= 1e-6


def test_sync_bn_without_a_gpu_is_refused():
    done = run_main([*TINY, "--batch-size", "64", "--sync-bn"])
    assert_one_line_error(done, "--sync-bn needs GPUs")


# ----------------------------------------------------------------------------- models


def units_and_parameters(env, cfg):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    trainer, resolved = build_trainer(cfg, env)
    units = [type(m.module).__name__ for m in trainer.model.modules() if isinstance(m, FSDP)]
    images, _ = next(iter(trainer.loaders.train))
    return units, resolved["parameters"], tuple(trainer.model(images).shape)


@pytest.mark.parametrize("model,parameters", [("resnet18", 11_173_962), ("resnet50", 23_520_842)])
def test_resnets_are_sharded_per_residual_stage(model, parameters):
    cfg = Config(**{**EQUAL, "batch_size": 4, "train_samples": 8}, strategy="fsdp", model=model)
    units, count, logits = spawn(units_and_parameters, 2, cfg)[0]
    assert units == ["SmallImageResNet", "Sequential", "Sequential", "Sequential", "Sequential"]
    assert count == parameters and logits == (2, 10)


def test_resnet18_trains():
    options = "--model resnet18 --train-samples 128 --val-samples 32 --batch-size 16 --epochs 2"
    done = run_main([*TINY, *options.split(), "--no-checkpoint"], timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = metrics_in(done.stdout)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]


# ----------------------------------------------------------------------------- checkpoints


def test_keep_last_keeps_the_newest_and_the_one_resumed_from(tmp_path):
    args = [*TINY, "--batch-size", "64", "--checkpoint-dir", str(tmp_path), "--keep-last", "2"]
    assert run_main([*args, "--epochs", "4"]).returncode == 0

    def kept() -> list[str]:
        return [p.name for p in checkpoint.finished(tmp_path)]

    assert kept() == ["ckpt_e0004_s000000", "ckpt_e0005_s000000"]
    resumed_from = tmp_path / "ckpt_e0004_s000000"
    done = run_main([*args, "--epochs", "6", "--resume", str(resumed_from)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert kept() == ["ckpt_e0004_s000000", "ckpt_e0006_s000000", "ckpt_e0007_s000000"]


def test_an_unreadable_newest_checkpoint_falls_back_to_an_older_one(tmp_path):
    args = [*TINY, "--batch-size", "64", "--checkpoint-dir", str(tmp_path)]
    assert run_main([*args, "--epochs", "2"]).returncode == 0
    newest = tmp_path / "ckpt_e0003_s000000"
    (newest / checkpoint.DDP_FILE).write_bytes(b"a disk fault")
    given = run_main([*args, "--epochs", "3", "--resume", str(newest)])
    assert_one_line_error(given, f"cannot read checkpoint {newest}", status=5)  # no guessing
    done = main_on_ranks([*args, "--epochs", "3", "--resume", "auto"], 2)[0]
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"cannot read checkpoint {newest}" in done.stdout
    assert f"resumed from {tmp_path / 'ckpt_e0002_s000000'}" in done.stdout
    assert [m["epoch"] for m in metrics_in(done.stdout)] == [2, 3]
    # Epoch 2 trained again wrote its checkpoint anew, the unreadable one set aside.
    assert run_main([*args, "--epochs", "3", "--resume", str(newest)]).returncode == 0
