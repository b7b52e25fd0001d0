"""Every reported number means what docs/metrics.md says, and no run goes wrong silently: the parts
of the GPU path that a CPU can show (the rest is in test_gpu.py, which needs CUDA)."""

import math
from types import SimpleNamespace

import pytest
import torch

import checkpoint
import train
from config import Config
from conftest import TINY, assert_one_line_error, main_on_ranks, metrics_in, run_main
from dist_harness import spawn, spawn_outcomes
from session import build_trainer, run
from utils import parse_config

CFG = dict(
    dataset="synthetic",
    train_samples=256,
    val_samples=64,
    batch_size=32,
    epochs=1,
    print_every=10**6,
    checkpoint=False,
)


def config_line(stdout: str) -> dict:
    return next(filter(None, map(parse_config, stdout.splitlines())))


# ----------------------------------------------------------------------------- memory


def peak_and_data(*args: str) -> tuple[int, int]:
    # Batches of 256: the 8x larger set then trains in 64 steps, not 256 (the test's time).
    done = run_main([*TINY, "--batch-size", "256", "--epochs", "2", "--no-checkpoint", *args])
    assert done.returncode == 0, done.stderr[-2000:]
    last = metrics_in(done.stdout)[-1]
    return last["peak_mem"], last["data_mem"]


@pytest.mark.slow
def test_peak_mem_counts_training_not_the_data_set():
    """peak_mem is the training peak above a baseline taken with the data set resident: 8x the
    images leaves it as it is (the data set, the epoch's augmented copy included, has its own
    key), a 4x wider model raises it. Two epochs: the second refills the epoch's copy."""
    small, small_data = peak_and_data("--train-samples", "2048")
    large, large_data = peak_and_data("--train-samples", "16384")
    # Its 4x wider layers take 8x the small run's time a step: 512 images (peak_mem is a
    # step's, whatever the data set's size, as the two runs above show).
    wide, _ = peak_and_data("--train-samples", "512", "--model", "cnn-wide")
    print(
        f"peak_mem: 2,048 images {small} MB, 16,384 images {large} MB, cnn-wide {wide} MB; "
        f"data_mem {small_data} and {large_data} MB"
    )
    assert large_data - small_data >= 40  # 14,336 more images of 3 KB
    # The C heap's fragmentation over 8x the steps moves a CPU peak by some MB (about 10 seen):
    # far less than the data set's growth, which would show whole if it leaked in.
    assert large - small < (large_data - small_data) / 2, "the data set leaked into peak_mem"
    assert wide >= small + 30, "a wider model's activations and state must show"


class GreedyCalibration:
    """Stands in for the compute calibration, which steps an unsharded copy of the model after
    each epoch's training: holds 256 MB (touched) while it runs."""

    def seconds_per_step(self, epoch_seconds: float) -> float:
        held = torch.ones(2**26)
        return float(held[0]) * 0.001


class TimedSteps:
    """A trainer whose step takes `seconds` of a clock of its own, and counts itself."""

    env = SimpleNamespace(device=torch.device("cpu"))

    def __init__(self, seconds: float):
        self.seconds, self.steps, self.now = seconds, 0, 0.0

    def clock(self) -> float:
        return self.now

    def step(self, images, labels, losses):
        self.steps += 1
        self.now += self.seconds


@pytest.mark.parametrize(
    "epoch_s, step_s, steps",
    [
        (0.0, 0.01, 3),  # no budget: three steps all the same, for a median
        (0.55, 0.01, 6),  # a tenth of the epoch: 55 ms, the sixth step starts within it
        (100.0, 0.01, 10),  # plenty: ten at most
        (100.0, 0.04, 7),  # a long epoch: 0.25 s at most, the seventh step starts at 0.24 s
    ],
)
def test_the_calibration_times_three_to_ten_steps_in_a_tenth_of_the_epoch(
    monkeypatch, epoch_s, step_s, steps
):
    """t_compute's calibration after an epoch: the steps that fit in a tenth of the epoch's
    training and in 0.25 s, never fewer than three (a median), never more than ten."""
    bare = TimedSteps(step_s)
    monkeypatch.setattr(train.time, "perf_counter", bare.clock)
    calibration = train.ComputeCalibration(bare, 2, (3, 8, 8), 10, torch.contiguous_format)
    bare.steps = 0  # the first step, at its making, is not timed
    assert calibration.seconds_per_step(epoch_s) == pytest.approx(step_s)
    assert bare.steps == steps


def peak_beside_a_greedy_calibration(env, cfg):
    trainer, _ = build_trainer(cfg, env)
    trainer.calibration = GreedyCalibration()
    _, measured = trainer.run_epoch(checkpoint.Position())
    return measured["peak_mem"]


def test_peak_mem_is_read_before_the_calibration_runs():
    """The calibration's memory is not training's: with FSDP, its unsharded model would hide
    the very saving peak_mem is there to show."""
    cfg = Config(**{**CFG, "strategy": "fsdp"})
    peak = spawn(peak_beside_a_greedy_calibration, 1, cfg)[0]
    assert peak < 128, f"peak_mem {peak} MB holds the calibration's 256 MB"


# ----------------------------------------------------------------------------- precision


def precision_facts(env, cfg):
    trainer, resolved = build_trainer(cfg, env)
    model = trainer.model
    reduce = getattr(getattr(model, "mixed_precision", None), "reduce_dtype", None)
    return {
        "conv": torch.backends.cudnn.conv.fp32_precision,
        "matmul": torch.backends.cuda.matmul.fp32_precision,
        # what code that knows only the legacy switches reads (it raises on a mix)
        "legacy": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "fp32_math": resolved["fp32_math"],
        "autocast": trainer.precision.autocast_dtype,
        "reduce": reduce,
        "scaler": trainer.precision.scaler.is_enabled(),
        "grad_dtype": next(model.parameters()).dtype,
        "calibration_autocast": trainer.calibration.bare.precision.autocast_dtype,
        "calibration_scaler": type(trainer.calibration.bare.precision.scaler).__name__,
    }


@pytest.mark.parametrize("precision,math_mode", [("fp32", "ieee"), ("tf32", "tf32")])
def test_fp32_is_ieee_and_tf32_is_asked_for(precision, math_mode):
    facts = spawn(precision_facts, 1, Config(**CFG, precision=precision))[0]
    assert (facts["conv"], facts["matmul"], facts["fp32_math"]) == (math_mode,) * 3
    assert facts["legacy"] == (math_mode == "tf32",) * 2
    assert facts["autocast"] is None and not facts["scaler"]


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_ddp_and_fsdp_compute_low_and_reduce_fp32(precision, dtype):
    """The same --precision means the same numerics and traffic for both strategies: compute in
    the low precision, gradients reduced in fp32 (DDP: its fp32 parameters' gradients)."""
    ddp = spawn(precision_facts, 2, Config(**CFG, precision=precision))[0]
    fsdp = spawn(precision_facts, 2, Config(**CFG, precision=precision, strategy="fsdp"))[0]
    assert ddp["autocast"] == dtype and ddp["grad_dtype"] == torch.float32
    assert fsdp["reduce"] == torch.float32
    assert ddp["scaler"] == fsdp["scaler"] == (precision == "fp16")
    # t_compute's unwrapped step computes as the run does, with a scaler that talks to no rank
    for facts in (ddp, fsdp):
        assert facts["calibration_autocast"] == dtype
        assert facts["calibration_scaler"] == "GradScaler"


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_one_process_baselines_compute_in_the_precision_they_report(strategy):
    facts = spawn(precision_facts, 1, Config(**CFG, precision="bf16", strategy=strategy))[0]
    assert facts["autocast"] == torch.bfloat16 and facts["grad_dtype"] == torch.float32


# ----------------------------------------------------------------------------- sharding


def sharding_of(env, cfg):
    return run(cfg, env).history[-1]["sharding"]


@pytest.mark.parametrize(
    "strategy,world_size,expected",
    [("fsdp", 1, "no_shard"), ("fsdp", 2, "full"), ("ddp", 2, "replicate")],
)
def test_metric_line_reports_the_sharding_really_used(strategy, world_size, expected):
    """FSDP at world size 1 falls back to NO_SHARD: a 1-GPU FSDP baseline is DDP-like."""
    assert spawn(sharding_of, world_size, Config(**CFG, strategy=strategy))[0] == expected


def hybrid_on_fake_nodes(env, cfg, layout):
    """Two "nodes" of two ranks each: `layout` says which node each rank's hostname names."""
    import os
    import socket

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # distributed_utils.num_nodes: 4 ranks on 2 nodes
    socket.gethostname = lambda: f"node{layout[env.rank]}"
    build_trainer(cfg, env)
    return "built"


@pytest.mark.timeout(300)
def test_hybrid_sharding_needs_ranks_in_blocks_per_node():
    cfg = Config(**{**CFG, "batch_size": 64}, strategy="fsdp", sharding="hybrid")
    assert spawn(hybrid_on_fake_nodes, 4, cfg, [0, 0, 1, 1]) == ["built"] * 4
    outcomes = spawn_outcomes(hybrid_on_fake_nodes, 4, cfg, [0, 1, 0, 1])
    assert all(status == "error" for status, _ in outcomes)
    assert "ranks laid out in blocks of 2 per node" in outcomes[0][1]


# ----------------------------------------------------------------------------- divergence


def diverge_in_epoch_2(env, cfg):
    run_epoch = train.Trainer.run_epoch

    def poisoned(self, start, stop=None):
        reached, measured = run_epoch(self, start, stop)
        if measured and measured["epoch"] == 2:
            measured["train_loss"] = math.nan
        return reached, measured

    train.Trainer.run_epoch = poisoned
    outcome = run(cfg, env)
    return outcome.diverged, [h["epoch"] for h in outcome.history]


def test_a_diverged_run_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = Config(**{**CFG, "epochs": 3, "checkpoint": True}, checkpoint_dir=str(tmp_path))
    diverged, epochs = spawn(diverge_in_epoch_2, 2, cfg)[0]
    assert "epoch 2: the training loss is nan" in diverged
    assert f"last good checkpoint is {tmp_path / 'ckpt_e0002_s000000'}" in diverged
    assert checkpoint.latest(tmp_path).name == "ckpt_e0002_s000000"  # epoch 2 not saved


def test_a_diverged_run_is_one_line_and_exit_status_4():
    done = run_main(
        [*TINY, "--batch-size", "64", "--epochs", "3", "--no-checkpoint", "--lr", "1e9"]
    )
    assert_one_line_error(
        done,
        "the training loss is",
        "training diverged",
        "no checkpoint was kept (--no-checkpoint)",
        status=4,
    )
    assert len(metrics_in(done.stdout)) < 3


# ----------------------------------------------------------------------------- across devices


def test_resume_from_a_checkpoint_of_another_device_type(tmp_path):
    """A GPU checkpoint resumed on a CPU (faked: the loader stream marked as CUDA's) trains on,
    with fresh random streams, instead of failing to seed a generator of another device."""
    args = [*TINY, "--batch-size", "64", "--checkpoint-dir", str(tmp_path)]
    assert run_main([*args, "--epochs", "1"]).returncode == 0
    rng = tmp_path / "ckpt_e0002_s000000" / "rng_rank0.pt"
    state = torch.load(rng, weights_only=False)
    state.update(loader_device="cuda", loader=torch.zeros(16, dtype=torch.uint8))
    torch.save(state, rng)
    done = run_main([*args, "--epochs", "2", "--resume", "auto"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "written on another device type: the random streams start afresh" in done.stdout
    assert [m["epoch"] for m in metrics_in(done.stdout)] == [2]


# ----------------------------------------------------------------------------- determinism


def test_deterministic_switches_torch_to_deterministic_kernels():
    done = run_main(
        [*TINY, "--batch-size", "64", "--epochs", "1", "--no-checkpoint", "--deterministic"]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert config_line(done.stdout)["deterministic"] == "True"
    plain = run_main([*TINY, "--batch-size", "64", "--epochs", "1", "--no-checkpoint"])
    assert config_line(plain.stdout)["deterministic"] == "False"


def test_multi_node_nccl_without_the_network_plugin_is_warned():
    from distributed_utils import network_warning

    assert "falls back to TCP" in network_warning(2, "nccl", {})
    assert network_warning(2, "nccl", {"NCCL_NET": "AWS Libfabric"}) is None
    assert network_warning(1, "nccl", {}) is None  # one node: NVLink, no network
    assert network_warning(2, "gloo", {}) is None


# ----------------------------------------------------------------------------- time breakdown


def test_time_breakdown_accounts_for_the_epoch():
    """t_compute + t_data + t_comm + t_wait is the epoch's time; compute is measured (not
    zero), waiting and fetching are never negative."""
    done = main_on_ranks([*TINY, "--batch-size", "64", "--epochs", "2", "--no-checkpoint"], 2)[0]
    assert done.returncode == 0, done.stderr[-2000:]
    for m in metrics_in(done.stdout):
        parts = m["t_compute"] + m["t_data"] + m["t_comm"] + m["t_wait"]
        assert parts == pytest.approx(m["time"], rel=1e-3, abs=0.01)
        assert m["t_compute"] > 0 and m["t_data"] >= 0 and m["t_wait"] >= 0


def slowed_rank_metrics(env, cfg, slowed: int, seconds_per_batch: float):
    """One rank fetches every batch `seconds_per_batch` later than the others (a slow node)."""
    import time

    import data

    if env.rank == slowed:
        normalize = data.Normalize.__call__

        def slow_normalize(self, images):
            time.sleep(seconds_per_batch)
            return normalize(self, images)

        data.Normalize.__call__ = slow_normalize
    return run(cfg, env).history


LATE_S = 0.3  # how much later a slowed rank's batches come


@pytest.mark.parametrize("slowed", [0, 2])
def test_a_straggler_is_named_and_the_others_wait_for_it(slowed):
    """Of 3 ranks, one whose batches come 300 ms late (4 steps: 1.2 s an epoch) is named in
    every epoch, and the spread is about its lateness; the busy times compared are compute +
    data_wait, as t_wait's. t_wait, the mean over ranks of each one's wait for the slowest, is
    about 2/3 of the lateness: the two others wait that long, the slowed rank not at all. (The
    other way round it would be 1/3; every rank waiting, the whole; forced to 0, 0: the bounds
    lie halfway between.)"""
    cfg = Config(**{**CFG, "epochs": 2, "batch_size": 12, "train_samples": 4 * 12})
    history = spawn(slowed_rank_metrics, 3, cfg, slowed, LATE_S)[0]
    late = 4 * LATE_S
    for m in history:
        print(f"spread {m['rank_time_spread']:.3f} s, t_wait {m['t_wait']:.3f} s, late {late} s")
        assert m["slowest_rank"] == slowed, m
        assert late / 2 < m["rank_time_spread"] < 2 * late, m
        assert late / 2 < m["t_wait"] < 5 * late / 6, m


def training_result(env, cfg, calibrate):
    import session

    if not calibrate:
        session.calibrate_compute = lambda *args: None
    outcome = session.run(cfg, env)
    return [{k: h[k] for k in ("train_loss", "val_loss", "acc")} for h in outcome.history]


def test_the_compute_calibration_leaves_training_exactly_as_it_was():
    """The calibration steps a model of its own on data of its own: with it or without it, the
    same losses to the bit."""
    cfg = Config(**{**CFG, "epochs": 2, "augment": True})
    assert spawn(training_result, 1, cfg, True)[0] == spawn(training_result, 1, cfg, False)[0]
