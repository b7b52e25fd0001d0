"""Features a user turns on with one option, each shown by a real run of main.py: hybrid
sharding, bf16/fp16, --compile with checkpoints, --channels-last, the classic loader, cnn-wide;
and what the `[METRIC]` fields time, throughput and peak_mem measure, each measured here rather
than read off the code.

Most runs are compared with one eager fp32 DDP run of the same tiny setting (`reference`): a
feature that is silently ignored, or that changes the numerics it should not change, shows in
the losses; one that trains wrongly shows too.
"""

import math

import pytest
import torch

from checkpoint import Position
from config import Config
from conftest import (
    TINY,
    TINY_CFG,
    assert_breakdown_holds,
    config_in,
    main_on_ranks,
    metrics_in,
    run_main,
)
from cost_model import state_mem
from dist_harness import spawn
from helpers import meta_model
from session import build_trainer

# Two epochs of 8 steps on TINY's 256 images, no checkpoint: a few seconds per run.
ARGS = [*TINY, "--batch-size", "32", "--epochs", "2", "--no-checkpoint"]
CFG = dict(TINY_CFG, batch_size=32, epochs=1, checkpoint=False)


def trained(args: list, nproc: int | None = None, epochs: int = 2, timeout=240, **env):
    """The [METRIC] lines and the [CONFIG] line of a run that must finish (exit 0) with one
    finite-loss line per epoch, whose time breakdown adds up."""
    done, _ = main_on_ranks(args, nproc or 1, timeout=timeout, **env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = metrics_in(done.stdout)
    assert [m["epoch"] for m in lines] == list(range(1, epochs + 1)), done.stdout[-3000:]
    for m in lines:
        assert math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"]), m
        assert_breakdown_holds(m)
    config = config_in(done.stdout)
    return lines, config


def predicted_state_mem(cfg: Config, world_size: int) -> int:
    """cost_model's state_mem for cfg's model at the shape of TINY's synthetic images."""
    return state_mem(cfg, meta_model(cfg.model), world_size)


def losses(lines: list[dict]) -> list[float]:
    return [m[k] for m in lines for k in ("train_loss", "val_loss")]


@pytest.fixture(scope="module")
def reference():
    """One process, DDP, eager, fp32, tensor loader, the course CNN: what the features are
    compared with."""
    lines, config = trained(ARGS)
    return lines, config


# ----------------------------------------------------------------------------- hybrid sharding


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_hybrid_sharding_trains_sharded_within_the_node(reference, strategy):
    """`--sharding hybrid` on one node of 2 ranks really runs hybrid (the `sharding` field, per
    fsdp_utils.effective_sharding, says `hybrid`; it falls back to `no_shard` only at world size
    1), shards inside the node (each rank holds half of DDP's state bytes, as `full` does), and
    trains as one process does on the same global batches (the same losses, to rounding).
    Its state_mem is cost_model's prediction, to the byte."""
    lines, config = trained([*ARGS, "--strategy", strategy, "--sharding", "hybrid"], nproc=2)
    ref_lines, _ = reference
    predicted = predicted_state_mem(Config(strategy=strategy, sharding="hybrid"), world_size=2)
    for m, ref in zip(lines, ref_lines):
        assert (m["sharding"], m["strategy"], m["world_size"], m["nodes"]) == (
            "hybrid",
            strategy,
            2,
            1,
        ), m
        assert 0.49 < m["state_mem"] / ref["state_mem"] < 0.51, (m["state_mem"], ref["state_mem"])
        assert m["state_mem"] == predicted, (m["state_mem"], predicted)
    assert losses(lines) == pytest.approx(losses(ref_lines), abs=2e-4)
    assert config["sharding"] == "hybrid"


# ----------------------------------------------------------------------------- precision


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_end_to_end(reference, precision):
    """`--precision bf16|fp16` runs to the end on the CPU (fp16 with its gradient scaler), says
    so in the `precision` field, and computes in the low precision: finite losses close to
    fp32's yet not fp32's to the printed digits (an ignored option would repeat them exactly)."""
    lines, _ = trained([*ARGS, "--precision", precision])
    ref_lines, _ = reference
    assert all(m["precision"] == precision for m in lines), lines
    assert losses(lines) == pytest.approx(losses(ref_lines), abs=0.02)
    assert losses(lines) != losses(ref_lines), "the same digits as fp32: low precision unused"


# ----------------------------------------------------------------------------- compile


def test_compiled_run_checkpoints_and_resumes(reference, tmp_path):
    """`--compile` with checkpoints: torch.compile really traces the model (dynamo's own log
    names model.py's forward), epoch 1 saves a checkpoint, and a compiled `--resume auto` run
    to 2 epochs resumes from it: it prints epoch 2 only and trains it from the saved weights
    (the training loss of the uninterrupted eager run's epoch 2, to rounding)."""
    folder = tmp_path / "ckpt"
    compiled = [*TINY, "--batch-size", "32", "--compile", "--checkpoint-dir", folder]
    first = run_main([*compiled, "--epochs", "1"], timeout=300, TORCH_LOGS="dynamo")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert "start tracing forward" in first.stderr and "model.py" in first.stderr, (
        "torch.compile did not trace the model"
    )
    assert [m["epoch"] for m in metrics_in(first.stdout)] == [1]
    assert (folder / "ckpt_e0002_s000000").is_dir(), sorted(p.name for p in folder.iterdir())

    second = run_main([*compiled, "--epochs", "2", "--resume", "auto"], timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "[CHECKPOINT] resumed from" in second.stdout and "ckpt_e0002_s000000" in second.stdout
    (resumed,) = metrics_in(second.stdout)
    assert resumed["epoch"] == 2
    straight = reference[0][1]
    assert math.isfinite(resumed["val_loss"])
    assert resumed["train_loss"] == pytest.approx(straight["train_loss"], abs=1e-3)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], abs=1e-3)


# ----------------------------------------------------------------------------- channels_last


def memory_formats(env, *cfgs) -> list[dict]:
    """After one training step of each cfg's trainer (built one after the other): is every 4-d
    conv weight, its gradient and the input batch channels_last?"""
    found, nhwc = [], torch.channels_last
    for cfg in cfgs:
        trainer, _ = build_trainer(cfg, env)
        images, labels = next(iter(trainer.loaders.train))
        trainer.step(images, labels, torch.zeros(()))
        convs = [m.weight for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d)]
        found.append(
            {
                "convs": len(convs),
                "weights": [w.is_contiguous(memory_format=nhwc) for w in convs],
                "grads": [w.grad.is_contiguous(memory_format=nhwc) for w in convs],
                "batch": images.is_contiguous(memory_format=nhwc),
            }
        )
    return found


def test_channels_last_trains_with_nhwc_weights_and_batches(reference):
    """`--channels-last` trains (exit 0, the losses of the default layout to rounding: the same
    math), and really uses NHWC: in the trainer main.py builds, every conv weight, its gradient
    after a step, and the batches are channels_last (without the option, built after it, none
    is)."""
    lines, _ = trained([*ARGS, "--channels-last"])
    assert losses(lines) == pytest.approx(losses(reference[0]), abs=2e-4)
    cfgs = Config(**CFG, channels_last=True), Config(**CFG)
    nhwc, nchw = spawn(memory_formats, 1, *cfgs)[0]
    assert nhwc == {"convs": 3, "weights": [True] * 3, "grads": [True] * 3, "batch": True}
    assert nchw == {"convs": 3, "weights": [False] * 3, "grads": [False] * 3, "batch": False}


# ----------------------------------------------------------------------------- classic loader


def test_classic_loader_trains_like_the_tensor_loader(reference):
    """`--loader classic` (torchvision transforms in 2 DataLoader workers; synthetic data is
    allowed) trains: the same epoch lines, and, without augmentation, the same batches as the
    tensor path, hence its losses to rounding; it keeps no data set on the device
    (data_mem=0)."""
    lines, config = trained([*ARGS, "--loader", "classic"])
    ref_lines, ref_config = reference
    assert len(lines) == len(ref_lines)
    assert config["steps_per_epoch"] == ref_config["steps_per_epoch"] == 256 // 32
    assert losses(lines) == pytest.approx(losses(ref_lines), abs=2e-4)
    assert all(m["data_mem"] == 0 for m in lines) and ref_lines[0]["data_mem"] > 0


# ----------------------------------------------------------------------------- cnn-wide


def test_cnn_wide_trains_with_far_more_state(reference):
    """`--model cnn-wide` (4x the channels) trains, and its state_mem (parameters, gradients and
    Adam's two moments: 16 bytes a parameter, plus Adam's step counters) is that of its own
    parameter count, more than 4x the course CNN's in the same settings: cost_model's
    prediction, to the byte, which its state_pred says.
    Its activations per image (act_per_image) are more than twice the CNN's: 4x the
    convolutions' outputs, the image and the classifier's hidden layer alike (measured on CPU:
    2.3x to 3.2x, the resident set's heap varying from run to run)."""
    lines, config = trained([*ARGS, "--model", "cnn-wide"])
    ref_lines, ref_config = reference
    assert config["parameters"] > 4 * ref_config["parameters"]
    predicted = predicted_state_mem(Config(model="cnn-wide"), world_size=1)
    for m, ref in zip(lines, ref_lines):
        assert 0 <= m["state_mem"] - 16 * config["parameters"] < 1024, m["state_mem"]
        assert m["state_mem"] == m["state_pred"] == predicted, (m, predicted)
        assert m["state_mem"] > 4 * ref["state_mem"], (m["state_mem"], ref["state_mem"])
        assert m["act_per_image"] > 2 * ref["act_per_image"], (m, ref)


# ----------------------------------------------------------------------------- [METRIC] meanings


def test_time_excludes_validation():
    """`time` is the training part of the epoch only: with one training step and 4,096
    validation images, validation takes several times longer than `time` (were it inside the
    timed window, `time` would be at least `val_time`); a factor 2, since a loaded machine
    (make test's two workers) slows the first step most."""
    args = ["--train-samples", "64", "--val-samples", "4096", "--batch-size", "64", "--epochs", "1"]
    ((m,), _) = trained([*ARGS, *args], epochs=1)
    assert m["val_time"] > 0.1, m
    assert m["time"] * 2 < m["val_time"], (m["time"], m["val_time"])


def test_throughput_counts_the_images_of_all_ranks():
    """`throughput` = training images of all ranks / `time`: at 2 ranks, 3,000 images and a
    global batch of 256 train 11 full global batches (the last 184 images are dropped), so
    throughput x time is 2,816, within 1% plus the rounding of the printed time; not one
    rank's 1,408, nor the 3,000 of the data set."""
    args = ["--train-samples", "3000", "--batch-size", "256", "--epochs", "1"]
    (m,), config = trained([*ARGS, *args], nproc=2, epochs=1)
    assert config["steps_per_epoch"] == 3000 // 256 == 11 and config["world_size"] == 2
    images = config["steps_per_epoch"] * config["global_batch"]
    assert m["time"] > 0, m
    tolerance = 0.01 + 0.005 / m["time"]  # time is printed with 2 decimals
    assert tolerance < 0.5 * (3000 - images) / images, f"time {m['time']} s too short to tell"
    assert m["throughput"] * m["time"] == pytest.approx(images, rel=tolerance), m


def peak_with_allocation(env, cfg, extra_mb):
    """One epoch in which this rank also touches extra_mb[rank] MB at its first step (inside
    the window peak_mem measures). Returns the epoch's [METRIC] fields and this rank's own peak
    in MB."""
    trainer, _ = build_trainer(cfg, env)
    original, extra = trainer.step, extra_mb[env.rank]
    allocated = []

    def step(images, labels, mean_loss_sum):
        if not allocated:
            block = torch.ones(extra * 2**20 // 4)  # written, so resident
            allocated.append(float(block[-1]))
            del block
        return original(images, labels, mean_loss_sum)

    trainer.step = step
    _, measured = trainer.run_epoch(Position())
    assert allocated, "the step was not called"
    return {**measured, **trainer.meters.labels}, trainer.meters.memory.training_peak() / 2**20


def test_peak_mem_is_the_maximum_over_ranks():
    """`peak_mem` is the largest rank's own training peak: with rank 0 touching 100 MB and rank
    1 300 MB inside the epoch, both ranks report rank 1's own peak (to a couple of MB), not
    rank 0's (rank 0 alone) nor the two added up (a sum). `act_per_image` is that rank's peak
    beyond its state, per image of its batch: the step's 300 MB temporary counts there, spread
    over 16 images, not over the global batch's 32, and the state is not in it."""
    runs = spawn(peak_with_allocation, 2, Config(**CFG), [100, 300])
    (measured0, own0), (measured1, own1) = runs
    reported0, reported1 = measured0["peak_mem"], measured1["peak_mem"]
    assert own1 - own0 > 150, (own0, own1)
    assert reported0 == reported1, (reported0, reported1)
    assert abs(reported0 - max(own0, own1)) <= 3, (reported0, own0, own1)
    local_batch, state = measured1["local_batch"], measured1["state_mem"]
    assert (local_batch, measured0["act_per_image"]) == (16, measured1["act_per_image"])
    per_image = (own1 * 2**20 - state) / local_batch
    assert abs(measured1["act_per_image"] - per_image) <= 3 * 2**20 / local_batch, per_image


def test_profile_traces_the_scheduled_steps_of_every_rank(reference, repo_copy):
    """--profile: one Chrome trace per rank holding the traced steps and the gradient
    all-reduce, and training unchanged by it (the reference's loss: two ranks train as one
    process does on the same global batches, to rounding, as hybrid sharding's test shows)."""
    import json

    from profiling import PROFILE_SCHEDULE

    done = run_main([*ARGS, "--epochs", "1", "--profile"], nproc=2, cwd=repo_copy)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = sorted((repo_copy / "logs" / "profiles").glob("local-*_rank*.json"))
    assert [t.name[-10:] for t in traces] == ["rank0.json", "rank1.json"], traces
    assert "[PROFILE] steps 4-6 (eager) of each rank traced: logs/profiles/" in done.stdout
    # kineto's own lines (a CPU's "ERROR: ... gpuGetDeviceCount failed", USDT markers) stay out
    assert "gpuGetDeviceCount" not in done.stderr and "USDT:" not in done.stderr, done.stderr
    first, last = (
        PROFILE_SCHEDULE["wait"] + PROFILE_SCHEDULE["warmup"],
        sum(PROFILE_SCHEDULE.values()),
    )
    for trace in traces:
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert {f"ProfilerStep#{s}" for s in range(first, last)} <= names, trace
        assert "gloo:all_reduce" in names, trace
    profiled, straight = metrics_in(done.stdout)[0], reference[0][0]
    assert profiled["train_loss"] == pytest.approx(straight["train_loss"], abs=2e-4)


def test_a_graphed_run_profiles_replays_of_its_graph(tmp_path):
    """--profile with --cuda-graphs traces steps after the eager warm-up and the capture, and
    says so (the trace itself is test_gpu's: a graph runs only on a GPU)."""
    from cuda_graphs import WARMUP_STEPS
    from profiling import StepProfiler, profile_report

    profiler = StepProfiler(tmp_path / "x_rank0.json", torch.device("cpu"), graphed=True)
    assert profiler.traced_steps[0] > WARMUP_STEPS + 1  # the capture's step is not traced
    profiler.saved = True
    assert "(replays of the captured CUDA graph)" in profile_report(profiler)
    eager = StepProfiler(tmp_path / "x_rank0.json", torch.device("cpu"))
    assert list(eager.traced_steps) == [4, 5, 6]
