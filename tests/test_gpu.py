"""The CUDA/NCCL path, on a machine with at least one GPU: `make test-gpu` (pytest -m gpu).

Skipped, with the reason, where torch sees no CUDA device; CI has none. One GPU suffices:
every run here is one process, as on one GPU of a cluster node.
"""

import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import data
import peer_failures
from config import Config
from conftest import (
    LONG_RUN,
    REPO,
    TINY,
    TINY_CFG,
    assert_breakdown_holds,
    assert_one_line_error,
    config_in,
    metrics_in,
    run,
    run_main,
    start_ranks,
    stop_at_first_progress,
)
from cost_model import rank_state
from cuda_graphs import GraphedStep
from dist_harness import (
    EQUAL_CFG,
    calibration_of,
    max_diff,
    mid_epoch_stop,
    signal_rank_then_train,
    spawn,
    spawn_outcomes,
    steps_cfg,
    stop_mid_epoch_then_resume,
    train_and_gather,
)
from helpers import ARGS, DEAD_S, end_rank1_during_training, meta_model
from measure import state_bytes
from precision import set_deterministic
from session import build_trainer
from session import run as run_session
from utils import parse_comm
from verify import max_param_diffs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

QUICK = [*TINY, "--batch-size", "64", "--no-checkpoint"]


def run_gpu(args: list, timeout: int = 300):
    done = run_main(args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    config = config_in(done.stdout)
    return config, metrics_in(done.stdout)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_one_gpu_trains_at_every_precision(strategy, precision):
    """And its state is cost_model's prediction (state_pred) there too."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    args = [*QUICK, "--strategy", strategy, "--precision", precision]
    config, metrics = run_gpu([*args, *"--epochs 3 --train-samples 2048".split()])
    assert config["backend"] == "nccl" and metrics[-1]["device"] == "cuda"
    assert config["gpu_memory"] == torch.cuda.get_device_properties(0).total_memory
    assert config["fp32_math"] == ("tf32" if precision == "tf32" else "ieee")
    assert metrics[-1]["acc"] > 30, "synthetic data is learnable: far above 10% chance"
    assert metrics[-1]["sharding"] == ("no_shard" if strategy == "fsdp" else "replicate")
    assert metrics[-1]["state_pred"] == metrics[-1]["state_mem"], metrics[-1]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("flag", ["--channels-last", "--compile"])
def test_one_gpu_memory_format_and_compile(flag):
    _, metrics = run_gpu([*QUICK, flag, "--epochs", "3", "--train-samples", "2048"], timeout=800)
    assert metrics[-1]["acc"] > 30


def test_sync_batchnorm_trains_a_resnet():
    """--sync-bn converts the ResNet's BatchNorm layers and trains on a GPU. Not proved here: the
    gathering of statistics over ranks, since at world size 1 torch's SyncBatchNorm runs as a
    plain BatchNorm; that needs two GPUs."""
    config, metrics = run_gpu(
        [*QUICK, "--model", "resnet18", "--sync-bn", "--epochs", "3", "--train-samples", "2048"]
    )
    assert config["sync_bn"] == "True"
    assert metrics[-1]["acc"] > 30, "synthetic data is learnable: far above 10% chance"


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("extra", [["--clip-grad", "1"], ["--precision", "fp16"]])
def test_cpu_offload_with_clipping_and_fp16(strategy, extra):
    """Offloaded shards with clipping and with fp16 train on a GPU. Not proved here: the gloo
    collectives on CPU tensors (the global norm, fp16's inf check) that the `cpu:gloo` half of
    the process group exists for, since at world size 1 FSDP reduces nothing; that needs two
    GPUs."""
    _, metrics = run_gpu([*QUICK, "--strategy", strategy, "--cpu-offload", *extra, "--epochs", "1"])
    assert metrics[-1]["device"] == "cuda"


def offloaded_state(env, strategy: str) -> tuple[int, int, set[str]]:
    """One step of an FSDP run with --cpu-offload on this GPU: the bytes of state the rank keeps
    (measure.state_bytes), those of it on the GPU (which act_per_image takes from the GPU's
    peak), and the devices its parameters, gradients and optimizer state are on."""
    trainer, _ = build_trainer(steps_cfg(8, 1, strategy=strategy, cpu_offload=True), env)
    images = torch.randn(8, 3, 32, 32, device=env.device)
    trainer.step(images, torch.randint(0, 10, (8,), device=env.device), trainer.loss_sum)
    model, optimizer = trainer.model, trainer.optimizer
    grads = [p.grad for p in model.parameters()]
    state = [v for s in optimizer.state.values() for v in s.values()]
    held = [t for t in (*model.parameters(), *grads, *state) if torch.is_tensor(t)]
    on_gpu = state_bytes(model, optimizer, env.device)
    return state_bytes(model, optimizer), on_gpu, {t.device.type for t in held}


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_cpu_offload_keeps_the_predicted_state_in_host_memory(strategy):
    """cost_model's prediction under --cpu-offload: the bytes, and where they are: every
    parameter, gradient and optimizer tensor in host memory, none on the GPU."""
    (found,) = spawn(offloaded_state, 1, strategy)
    predicted = rank_state(Config(strategy=strategy, cpu_offload=True), meta_model(), 1)
    assert predicted.on_device == 0
    assert found == (predicted.total, predicted.on_device, {"cpu"})


def test_a_cpu_run_on_a_gpu_machine_leaves_the_gpu_alone(tmp_path):
    """--device cpu: no CUDA context is opened, checkpoints included (asking a GPU's random
    state would open one, and fail where GPUs are in exclusive mode)."""
    code = (
        "import sys, torch, main; status = main.main(sys.argv[1:]); "
        "print('cuda initialized:', torch.cuda.is_initialized()); sys.exit(status)"
    )
    args = [*TINY, *"--batch-size 64 --epochs 1 --device cpu --checkpoint-dir".split(), tmp_path]
    done = run([sys.executable, "-c", code, *args], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cuda initialized: False" in done.stdout


def test_peak_memory_counts_training_not_the_data_set():
    """On CUDA the data set lives on the GPU: peak_mem must leave it out, data_mem holds it."""
    _, small = run_gpu([*QUICK, "--epochs", "1", "--train-samples", "2048"])
    _, large = run_gpu([*QUICK, "--epochs", "1", "--train-samples", "16384"])
    assert large[-1]["data_mem"] - small[-1]["data_mem"] >= 40
    assert abs(large[-1]["peak_mem"] - small[-1]["peak_mem"]) <= 2
    assert large[-1]["reserved_mem"] >= large[-1]["peak_mem"]


def sleep_seconds(cycles: int) -> float:
    """The GPU time of one kernel spinning `cycles` clock cycles: the fastest of a few (another
    process sharing the GPU only ever lengthens it; the first waits for the clocks to rise)."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return min(times)


def fetch_with_device_work(env, cycles: int) -> tuple[float, int, float]:
    """An epoch whose every fetch also keeps the GPU busy for `cycles` clock cycles, work that
    the host only launches: (the last epoch's data_wait, its steps, one fetch's kernel time
    measured in this process right after)."""
    normalize = data.Normalize.__call__

    def busy_normalize(self, images):
        torch.cuda._sleep(cycles)
        return normalize(self, images)

    data.Normalize.__call__ = busy_normalize
    data_wait = run_session(steps_cfg(64, 32, epochs=2), env).history[-1]["data_wait"]
    return data_wait, 32, sleep_seconds(cycles)


def test_data_wait_is_device_time():
    """A fetch that launches a kernel spinning the GPU for a few ms: data_wait (CUDA events
    around the fetch) holds them, where a host clock would see only their launch
    (microseconds). The kernel's own time is measured in the same process, its fastest: on a
    GPU that other tests share, time-slicing stretches it (0.567 s expected against 0.163 s
    measured, H200 -n 8). Half of it still tells milliseconds from microseconds."""
    ((data_wait, steps, per_fetch),) = spawn(fetch_with_device_work, 1, 10_000_000)
    print(f"data_wait {data_wait:.4f} s; the GPU was kept busy {steps * per_fetch:.4f} s")
    assert data_wait >= 0.5 * steps * per_fetch


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoints_resume_on_cuda_and_across_devices(tmp_path, strategy):
    """DDP's one file and FSDP's shards: written on the CPU (no GPU visible), resumed on the
    GPU, then on the GPU again, then on the CPU: across devices with fresh random streams and
    no traceback."""
    args = [*TINY, "--batch-size", "64", "--strategy", strategy, "--checkpoint-dir", str(tmp_path)]
    written_on = None
    for epochs, device in enumerate(("cpu", "cuda", "cuda", "cpu"), 1):
        hidden = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
        done = run_main([*args, "--epochs", str(epochs), "--resume", "auto"], **hidden)
        assert done.returncode == 0, done.stderr[-3000:]
        across = written_on not in (None, device)
        assert ("written on another device type" in done.stdout) == across, done.stdout[-3000:]
        metrics = metrics_in(done.stdout)
        assert [(m["epoch"], m["device"]) for m in metrics] == [(epochs, device)]
        written_on = device


def test_comm_benchmark_times_nccl_on_the_gpu():
    """The process group also holds gloo (for CPU tensors): the [COMM] lines name the backend
    that carried the measured GPU buffers."""
    done = run_main([*QUICK, "--epochs", "1", "--comm-benchmark"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [row for row in map(parse_comm, done.stdout.splitlines()) if row]
    assert rows and {(r["backend"], r["device"]) for r in rows} == {("nccl", "cuda")}


@pytest.mark.timeout(960)
def test_benchmark_runs_and_reports_the_one_gpu_epoch():
    done = run([sys.executable, "benchmark.py", "--quick"], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "One epoch of" in done.stdout and "on one GPU" in done.stdout
    print(done.stdout)


def test_deterministic_runs_repeat_to_the_bit(tmp_path):
    """Two runs end with the same weights to the bit (the printed losses have too few digits
    to show a difference in the last bits)."""
    args = [*TINY, *"--batch-size 64 --epochs 2 --deterministic --checkpoint-dir".split()]
    for folder in ("a", "b"):
        run_gpu([*args, tmp_path / folder])
    assert list(max_param_diffs(tmp_path / "a", tmp_path / "b")) == [0]


def test_two_ranks_on_one_gpu_are_refused_in_one_line():
    """Both ranks see one GPU as their local rank 0 (e.g. LOCAL_RANK lost, more tasks than
    GPUs): one clear line before NCCL's "Duplicate GPU detected", exit status 2."""
    ranks = start_ranks([*QUICK, "--epochs", "1"], 2, CUDA_VISIBLE_DEVICES="0", LOCAL_RANK="0")
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    rank0 = subprocess.CompletedProcess([], ranks[0].returncode, *outputs[0])
    assert_one_line_error(rank0, "ranks 0, 1 would share one GPU")
    assert ranks[1].returncode == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.timeout(180)
def test_a_dead_peer_on_nccl_ends_rank_0_with_one_line_and_status_1():
    """On NCCL too: the stop agreement's gloo all-reduce notices, rank 0 aborts its NCCL
    communicator (destroying it would wait for the dead peer's work) and exits."""
    error, status, elapsed = end_rank1_during_training([*ARGS, "--device", "cuda"], signal.SIGKILL)
    assert error.startswith("error: rank 0: rank(s) 1 died or hung"), error
    assert status == 1
    assert elapsed < DEAD_S, elapsed


@pytest.mark.timeout(900)
def test_eager_and_graphed_runs_time_and_measure_their_epochs_alike():
    """At a local batch of 32 (a host-bound eager step) and of 256, eager and graphed, on CUDA:
    - the time breakdown, as on a CPU (test_numbers): parts that are never negative and add up,
      or the epoch said to be unreliable; the graphed run calibrated with a graph;
    - gpu_busy (a kernel trace of the calibration's step): a share of the epoch in every epoch
      (above 1 only by the trace's and the clock's error), higher graphed at batch 32, where
      the graphed step launches one graph;
    - peak_mem: the graph's private memory, which its replays reuse and the allocator no longer
      counts, is added back: graphed and eager report the same training memory (to the pool's
      rounding), not 10x (the H200's first run: 824-856 MB against 76 MB)."""
    args = [*TINY, *"--train-samples 4096 --epochs 3 --no-checkpoint --augment".split()]
    runs = {
        (batch, mode): run_gpu([*args, "--batch-size", str(batch), f"--{mode}"])[1]
        for batch in (32, 256)
        for mode in ("no-cuda-graphs", "cuda-graphs")
    }
    busy = {key: [m["gpu_busy"] for m in metrics] for key, metrics in runs.items()}
    print("gpu_busy", busy, "peak_mem", {k: [m["peak_mem"] for m in ms] for k, ms in runs.items()})
    for metrics in runs.values():
        for m in metrics:
            assert_breakdown_holds(m)
            assert isinstance(m["gpu_busy"], float) and 0 < m["gpu_busy"] <= 1.05, busy
    assert busy[32, "cuda-graphs"][-1] > busy[32, "no-cuda-graphs"][-1], busy
    for e, g in zip(runs[256, "no-cuda-graphs"], runs[256, "cuda-graphs"], strict=True):
        assert 0.8 * e["peak_mem"] <= g["peak_mem"] <= 1.25 * e["peak_mem"] + 8, (e, g)


def test_a_graphed_runs_calibration_replays_a_graph():
    facts = spawn(calibration_of, 1, Config(dataset="synthetic", cuda_graphs=True))[0]
    assert facts["graphed"] and facts["captured"], facts


# MemoryMeter.set_aside on CUDA, in a process of its own: 64 MB allocated and freed in the
# epoch, 256 MB within the work set aside (the compute calibration's round), 16 MB after it.
SET_ASIDE_ON_CUDA = """
import contextlib, torch, measure
cuda, mb = torch.device("cuda"), 2**20
meter = measure.MemoryMeter(cuda)
meter.reset()
for size, aside in ((64, False), (256, True), (16, False)):
    with meter.set_aside() if aside else contextlib.nullcontext():
        torch.empty(size * mb, dtype=torch.uint8, device=cuda)  # made and freed
print(meter.training_peak() // mb, meter.reserved_peak() // mb, torch.cuda.memory_reserved() // mb)
"""


def test_the_calibrations_rounds_are_left_out_of_peak_mem_on_cuda():
    """The work set aside within an epoch (the calibration's rounds beside its steps) is left out
    of the epoch's allocated peak: what came before it stays in, what comes after counts again.
    The allocator's cache is not emptied (the epoch's next steps reuse it): what the round left
    reserved is in the reserved peak, as the process held it."""
    done = run([sys.executable, "-c", SET_ASIDE_ON_CUDA])
    assert done.returncode == 0, done.stderr[-3000:]
    peak, reserved, cached = map(int, done.stdout.split())
    assert 64 <= peak < 128, peak
    assert cached >= 256 and reserved >= cached, (reserved, cached)


def profiled_events(folder, *extra: str) -> tuple[str, list[dict]]:
    """--profile of 32 steps in a copy of the repository: the [PROFILE] line, the trace's events."""
    for path in REPO.glob("*.py"):
        shutil.copy2(path, folder / path.name)
    args = [*QUICK, "--epochs", "1", "--train-samples", "2048", "--profile", *extra]
    done = run_main(args, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    (trace,) = (folder / "logs" / "profiles").glob("*_rank0.json")
    line = next(line for line in done.stdout.splitlines() if line.startswith("[PROFILE]"))
    return line, json.loads(trace.read_text())["traceEvents"]


def test_profile_traces_the_gpus_kernels_and_the_graphs_replays(tmp_path):
    """--profile on a GPU: eager, the trace holds the device's kernels, not only the CPU's
    operators; graphed, the traced steps come after the capture, each one graph launch (the
    H200's first traces held eager warm-up steps only)."""
    (tmp_path / "eager").mkdir()
    line, events = profiled_events(tmp_path / "eager", "--no-cuda-graphs")
    assert "steps 4-6 (eager)" in line, line
    assert "kernel" in {e.get("cat") for e in events}, {e.get("cat") for e in events}
    (tmp_path / "graphed").mkdir()
    line, events = profiled_events(tmp_path / "graphed", "--cuda-graphs")
    assert "(replays of the captured CUDA graph)" in line, line
    launches = [e for e in events if str(e.get("name")).startswith("cudaGraphLaunch")]
    assert len(launches) >= 3, sorted({e.get("name") for e in events})[:40]


# ----------------------------------------------------------------------------- --cuda-graphs

# 32 steps of 64 images an epoch: the 11 eager warm-up steps, the capture, and 20 replays in
# the first epoch; replays only after it. IEEE fp32 and deterministic kernels, so that eager
# and graphed runs can agree to the bit.
GRAPHED = [*TINY, "--batch-size", "64", "--train-samples", "2048", "--deterministic"]


@pytest.mark.parametrize(
    "strategy,precision", [("single", "fp32"), ("ddp", "fp32"), ("fsdp2", "fp32"), ("ddp", "fp16")]
)
def test_a_graphed_run_trains_as_the_eager_one(tmp_path, strategy, precision):
    """The same steps replayed from one graph end with the eager run's parameters: to the bit
    is what a capture of the same kernels should give; the test allows 1e-6 and prints it.
    FSDP2's step (its gathers and reduce-scatters on streams of its own) and fp16's scaler
    inside the graph (the fused Adam takes its inf check as a device tensor and skips an
    overflowing step on the device, the scale updated there too: test_cuda_graphs.py shows no
    host read on a CPU; the 11 eager warm-up steps start from a scale of 65536, so the skipping
    is exercised) have not yet run captured on a GPU: this is their first proof."""
    args = [*GRAPHED, "--strategy", strategy, "--precision", precision, "--epochs", "2"]
    run_gpu([*args, "--no-cuda-graphs", "--checkpoint-dir", str(tmp_path / "eager")])
    config, metrics = run_gpu([*args, "--cuda-graphs", "--checkpoint-dir", str(tmp_path / "g")])
    assert config["cuda_graphs"] == "True" and metrics[-1]["device"] == "cuda"
    assert metrics[-1]["precision"] == precision
    (difference,) = max_param_diffs(tmp_path / "eager", tmp_path / "g")
    print(
        f"{strategy} {precision}: largest parameter difference, graphed vs eager: {difference:.3g}"
    )
    assert difference <= 1e-6


def validations(env, cfg) -> tuple[list[tuple[float, float]], bool]:
    """(val_loss, acc) of each epoch of a run of cfg, to the last bit, and whether its step was
    captured."""
    set_deterministic(cfg.deterministic)  # as main.py does: session.run does not
    outcome = run_session(cfg, env)
    step = outcome.trainer.train_step
    captured = isinstance(step, GraphedStep) and step.graph is not None
    return [(m["val_loss"], m["acc"]) for m in outcome.history], captured


def test_a_graphed_fsdp2_run_validates_as_the_eager_one():
    """FSDP2 at world size 1, 3 epochs without checkpoints (a checkpoint's state dict would
    reshard every unit, hiding what this proves): each validation of the graphed run reads the
    weights its replays trained, as the eager run's does (1e-6, as the parameters above).
    Validation left the root gathered, and replays run no FSDP2 hook, so from epoch 2 on the
    graphed run evaluated the root's convolutions with the previous validation's weights, until
    train.Trainer.evaluate resharded every unit."""
    fields = dict(TINY_CFG, train_samples=2048, batch_size=64, deterministic=True, epochs=3)
    fields.update(strategy="fsdp2", checkpoint=False)  # as --no-checkpoint
    ((eager, eager_captured),) = spawn(validations, 1, Config(**fields, cuda_graphs=False))
    ((graphed, captured),) = spawn(validations, 1, Config(**fields, cuda_graphs=True))
    print("fsdp2 (val_loss, acc) eager", eager, "graphed", graphed)
    assert captured and not eager_captured
    assert len({loss for loss, _ in eager}) == 3, "the weights must move between validations"
    for (loss, acc), (graphed_loss, graphed_acc) in zip(eager, graphed, strict=True):
        assert graphed_loss == pytest.approx(loss, abs=1e-6)
        assert graphed_acc == pytest.approx(acc, abs=1e-6)


def test_graphs_are_the_default_on_a_gpu_and_an_eager_run_says_why():
    """And a one-GPU run, graphed or eager, prints nothing on stderr: no deprecated NCCL setting
    (TORCH_FR_BUFFER_SIZE is the name torch reads), no stream mismatch warning from a graph's
    warm-up."""
    for extra, graphed in (([], "True"), (["--no-cuda-graphs"], "False")):
        done = run_main([*QUICK, "--epochs", "1", *extra])
        assert done.returncode == 0 and done.stderr == "", (extra, done.stderr[-3000:])
        assert config_in(done.stdout)["cuda_graphs"] == graphed
    done = run_main([*QUICK, "--epochs", "1", "--precision", "fp16"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[CONFIG] note: the step runs eager, not as one CUDA graph: fp16" in done.stdout
    done = run_main([*QUICK, "--epochs", "1", "--strategy", "fsdp2"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "graph: --strategy fsdp2 has not yet run captured" in done.stdout
    # Its pin-memory thread would call CUDA during a capture: eager by default, not refused.
    done = run_main([*QUICK, "--epochs", "1", "--loader", "classic"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "graph: --loader classic pins batches" in done.stdout


def test_a_graphed_run_resumes_exactly(tmp_path):
    """1 epoch, then resumed for a second (a new capture after the resume's warm-up), ends as
    2 straight graphed epochs, to the bit."""
    args = [*GRAPHED, "--cuda-graphs"]
    run_gpu([*args, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "straight")])
    run_gpu([*args, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "split")])
    run_gpu(
        [*args, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "split"), "--resume", "auto"]
    )
    assert list(max_param_diffs(tmp_path / "straight", tmp_path / "split")) == [0]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_eager_cpu_checkpoint_resumes_graphed_on_its_schedule(tmp_path, optimizer):
    """Written eager on the CPU (no GPU visible) in a schedule's warm-up epoch, resumed graphed
    on the GPU (captured 11 steps into epoch 2, then replayed) for the schedule's cosine: it
    captures, though the checkpoint's Adam was not capturable, and (SGD) ends with the weights
    of the same checkpoint resumed eager, which a rate frozen at the capture would not give.
    Adam turns last-bit differences into steps of up to lr (test_cuda_graphs' schedule test):
    its weights are not compared."""
    args = [*GRAPHED, "--optimizer", optimizer, "--lr-schedule", "cosine", "--warmup-epochs", "1"]
    written = tmp_path / "cpu"
    done = run_main(
        [*args, "--epochs", "1", "--checkpoint-dir", str(written)], CUDA_VISIBLE_DEVICES=""
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = [*args, "--epochs", "3", "--resume", str(written)]
    for mode in ("cuda-graphs", "no-cuda-graphs") if optimizer == "sgd" else ("cuda-graphs",):
        config, metrics = run_gpu([*resumed, f"--{mode}", "--checkpoint-dir", str(tmp_path / mode)])
        assert config["cuda_graphs"] == str(mode == "cuda-graphs")
        assert [m["epoch"] for m in metrics] == [2, 3] and metrics[-1]["device"] == "cuda"
    if optimizer == "sgd":
        (difference,) = max_param_diffs(tmp_path / "no-cuda-graphs", tmp_path / "cuda-graphs")
        print(f"resumed graphed vs eager on the schedule: largest difference {difference:.3g}")
        assert difference <= 1e-6


def test_a_graphed_run_stops_at_a_step_on_sigusr1_and_finishes_after_resume(repo_copy):
    # Progress at step 40: past the capture (after step 11), replaying.
    stopped = stop_at_first_progress([*LONG_RUN, "--cuda-graphs", "--print-every", "40"], repo_copy)
    assert stopped.returncode == 3, stopped.stderr[-2000:]
    stop = next(line for line in stopped.stdout.splitlines() if "stopped on SIGUSR1" in line)
    assert "at epoch 1 step" in stop
    command = stop.split("continue with: ", 1)[1].split()
    resumed = run([sys.executable, *command], cwd=repo_copy, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [m["epoch"] for m in metrics_in(resumed.stdout)] == [1, 2]


# ----------------------------------------------------------------------------- two ranks, one GPU
# Both ranks on GPU 0, gloo carrying the CUDA tensors (dist_harness's share_gpu: a switch only
# tests set; NCCL refuses two ranks on one GPU). What these prove: the metric all-reduces,
# barriers, the stop agreement, the checkpoints and the peer-failure path with CUDA tensors at
# world size 2. What they do not: NCCL itself (its kernels, its bandwidth, its failure path),
# and anything across GPUs or nodes.


def test_two_ranks_on_one_gpu_train_as_one_process_and_report_global_numbers():
    """DDP at world size 2 ends with one process's parameters (IEEE fp32; cuDNN's kernels may
    sum in another order: 1e-4 allowed) and reports the same global losses and accuracy."""
    cfg = Config(**EQUAL_CFG, strategy="ddp", deterministic=True)
    one_state, one_history = spawn(train_and_gather, 1, cfg)[0]
    two_state, two_history = spawn(train_and_gather, 2, cfg, share_gpu=True)[0]
    difference = max_diff(one_state, two_state)
    print(f"two ranks on one GPU vs one process: largest parameter difference {difference:.3g}")
    assert difference <= 1e-4
    for one, two in zip(one_history, two_history, strict=True):
        assert two["world_size"] == 2 and two["device"] == "cuda"
        assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-4)
        assert two["acc"] == pytest.approx(one["acc"], abs=1e-6)


def test_a_signal_to_one_rank_on_the_gpu_stops_both_and_the_resume_continues(tmp_path):
    """SIGUSR1 to rank 1 alone: both stop at one step mid-epoch with a checkpoint; resumed, the
    run ends as an uninterrupted one (1e-4, as above). test_resume runs the same on a CPU."""
    cfg = Config(**{**EQUAL_CFG, "strategy": "ddp", "deterministic": True, "epochs": 2})
    reached, difference = stop_mid_epoch_then_resume(tmp_path, cfg, share_gpu=True)
    assert reached == mid_epoch_stop(cfg.train_samples // cfg.batch_size)[1]
    assert difference <= 1e-4


def line_of_a_peer_failure(env, cfg) -> str | None:
    """The line this rank ends with where a peer fails under it (None: the run finished)."""
    try:
        run_session(cfg, env)
    except Exception as e:
        if peer_failures.is_peer_failure(e):
            return peer_failures.describe_peer_failure(e)
        raise
    return None


def test_a_rank_killed_on_the_gpu_ends_the_other_with_its_line():
    """Rank 1 killed at its 5th step."""
    cfg = Config(**EQUAL_CFG, strategy="ddp")
    killed = (5, 1, line_of_a_peer_failure, signal.SIGKILL)
    options = dict(pg_timeout_s=30, share_gpu=True)
    outcomes = spawn_outcomes(signal_rank_then_train, 2, cfg, *killed, **options)
    status, line = outcomes[0]
    assert status == "ok" and line.startswith("rank 0: rank(s) 1 died or hung"), outcomes[0]
    assert outcomes[1] == ("died", -signal.SIGKILL), outcomes[1]
