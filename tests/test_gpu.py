"""The CUDA/NCCL path, on a machine with at least one GPU: `make test-gpu` (pytest -m gpu).

Skipped, with the reason, where torch sees no CUDA device; CI has none. One GPU suffices:
every run here is one process, as on one GPU of a cluster node.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from config import Config
from conftest import REPO, TINY, TINY_CFG, config_in, metrics_in, run, run_main
from cost_model import rank_state
from dist_harness import spawn, steps_cfg
from model import build_model
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
    """And its state is memory_model's prediction (state_pred) there too."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    config, metrics = run_gpu(
        [
            *QUICK,
            "--strategy",
            strategy,
            "--precision",
            precision,
            "--epochs",
            "3",
            "--train-samples",
            "2048",
        ]
    )
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
    from measure import state_bytes
    from session import build_trainer

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
    """memory_model's prediction under --cpu-offload: the bytes, and where they are: every
    parameter, gradient and optimizer tensor in host memory, none on the GPU."""
    (found,) = spawn(offloaded_state, 1, strategy)
    with torch.device("meta"):
        model = build_model("cnn")
    predicted = rank_state(Config(strategy=strategy, cpu_offload=True), model, 1)
    assert predicted.on_device == 0
    assert found == (predicted.total, predicted.on_device, {"cpu"})


def test_a_cpu_run_on_a_gpu_machine_leaves_the_gpu_alone(tmp_path):
    """--device cpu: no CUDA context is opened, checkpoints included (asking a GPU's random
    state would open one, and fail where GPUs are in exclusive mode)."""
    code = (
        "import sys, torch, main; status = main.main(sys.argv[1:]); "
        "print('cuda initialized:', torch.cuda.is_initialized()); sys.exit(status)"
    )
    done = run(
        [
            sys.executable,
            "-c",
            code,
            *TINY,
            "--batch-size",
            "64",
            "--epochs",
            "1",
            "--device",
            "cpu",
            "--checkpoint-dir",
            tmp_path,
        ],
        timeout=300,
    )
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
    import data
    from dist_harness import steps_cfg
    from session import run as run_session

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
    from dist_harness import spawn

    ((data_wait, steps, per_fetch),) = spawn(fetch_with_device_work, 1, 10_000_000)
    print(f"data_wait {data_wait:.4f} s; the GPU was kept busy {steps * per_fetch:.4f} s")
    assert data_wait >= 0.5 * steps * per_fetch


def test_checkpoint_and_resume_on_cuda_and_across_devices(tmp_path):
    args = [*TINY, "--batch-size", "64", "--checkpoint-dir", str(tmp_path)]
    run_gpu([*args, "--epochs", "1"])
    config, metrics = run_gpu([*args, "--epochs", "2", "--resume", "auto"])
    assert [m["epoch"] for m in metrics] == [2]
    # The same checkpoint folder resumed on the CPU: fresh random streams, no traceback.
    done = run_main([*args, "--epochs", "3", "--resume", "auto"], CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "written on another device type" in done.stdout


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_cpu_checkpoint_resumes_on_cuda(tmp_path, strategy):
    """The other direction, for DDP's one file and FSDP's shards: written on the CPU (no GPU
    visible), resumed on the GPU, with fresh random streams."""
    args = [*TINY, "--batch-size", "64", "--strategy", strategy, "--checkpoint-dir", str(tmp_path)]
    done = run_main([*args, "--epochs", "1"], CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_main([*args, "--epochs", "2", "--resume", "auto"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "written on another device type" in done.stdout
    metrics = metrics_in(done.stdout)
    assert [m["epoch"] for m in metrics] == [2] and metrics[0]["device"] == "cuda"


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

    def trained_weights(folder):
        run_gpu(
            [
                *TINY,
                "--batch-size",
                "64",
                "--epochs",
                "2",
                "--deterministic",
                "--checkpoint-dir",
                str(folder),
            ]
        )
        return torch.load(folder / "ckpt_e0003_s000000" / "state.pt", map_location="cpu")["model"]

    first, second = trained_weights(tmp_path / "a"), trained_weights(tmp_path / "b")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_two_ranks_on_one_gpu_are_refused_in_one_line():
    """Both ranks see one GPU as their local rank 0 (e.g. LOCAL_RANK lost, more tasks than
    GPUs): one clear line before NCCL's "Duplicate GPU detected", exit status 2."""
    from conftest import assert_one_line_error, start_ranks

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
    import signal

    from helpers import ARGS, DEAD_S, end_rank1_during_training

    error, status, elapsed = end_rank1_during_training([*ARGS, "--device", "cuda"], signal.SIGKILL)
    assert error.startswith("error: rank 0: rank(s) 1 died or hung"), error
    assert status == 1
    assert elapsed < DEAD_S, elapsed


def test_a_one_gpu_run_prints_nothing_on_stderr():
    """Eager and graphed: no deprecated NCCL setting (TORCH_FR_BUFFER_SIZE is the name torch
    reads), no stream mismatch warning from a graph's warm-up."""
    for extra in (["--no-cuda-graphs"], []):  # eager, and graphed (the default)
        done = run_main([*QUICK, "--epochs", "1", *extra])
        assert done.returncode == 0 and done.stderr == "", (extra, done.stderr[-3000:])


@pytest.mark.parametrize("batch", [32, 256])
@pytest.mark.parametrize("extra", [["--no-cuda-graphs"], []])
def test_the_time_breakdown_on_cuda_is_never_negative(batch, extra):
    """As on a CPU (test_numbers): parts that are never negative and add up, or the epoch
    said to be unreliable; the graphed run calibrated with a graph."""
    from conftest import assert_breakdown_holds

    _, metrics = run_gpu(
        [
            *TINY,
            "--train-samples",
            "4096",
            "--batch-size",
            str(batch),
            "--epochs",
            "3",
            "--no-checkpoint",
            "--augment",
            *extra,
        ]
    )
    for m in metrics:
        assert_breakdown_holds(m)


def test_gpu_busy_is_a_share_and_higher_graphed_than_eager():
    """gpu_busy, from a kernel trace of the calibration's step: a share of the epoch in every
    epoch (above 1 only by the trace's and the clock's error), and at a small local batch,
    where the eager step is host-bound, higher graphed, which launches one graph a step."""
    args = [*TINY, "--train-samples", "4096", "--batch-size", "32", "--epochs", "2"]
    busy = {}
    for extra in ("--no-cuda-graphs", "--cuda-graphs"):
        _, metrics = run_gpu([*args, "--no-checkpoint", extra])
        busy[extra] = [m["gpu_busy"] for m in metrics]
    print("gpu_busy", busy)
    for shares in busy.values():
        assert all(isinstance(s, float) and 0 < s <= 1.05 for s in shares), busy
    assert busy["--cuda-graphs"][-1] > busy["--no-cuda-graphs"][-1], busy


def test_a_graphed_runs_calibration_replays_a_graph():
    from config import Config
    from dist_harness import calibration_of, spawn

    facts = spawn(calibration_of, 1, Config(dataset="synthetic", cuda_graphs=True))[0]
    assert facts["graphed"] and facts["captured"], facts


def test_a_graphed_runs_peak_mem_is_an_eager_runs():
    """The graph's private memory, which its replays reuse and the allocator no longer counts,
    is added back: graphed and eager report the same training memory (to the pool's rounding),
    not 10x (the H200's first run: 824-856 MB against 76 MB)."""
    args = [
        *TINY,
        "--train-samples",
        "4096",
        "--batch-size",
        "256",
        "--epochs",
        "2",
        "--no-checkpoint",
    ]
    _, eager = run_gpu([*args, "--no-cuda-graphs"])
    _, graphed = run_gpu([*args, "--cuda-graphs"])
    print(
        "peak_mem eager",
        [m["peak_mem"] for m in eager],
        "graphed",
        [m["peak_mem"] for m in graphed],
    )
    for e, g in zip(eager, graphed, strict=True):
        assert 0.8 * e["peak_mem"] <= g["peak_mem"] <= 1.25 * e["peak_mem"] + 8, (e, g)


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
    import shutil

    for path in REPO.glob("*.py"):
        shutil.copy2(path, folder / path.name)
    args = [*QUICK, "--epochs", "1", "--train-samples", "2048", "--profile", *extra]
    done = run_main(args, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    (trace,) = (folder / "logs" / "profiles").glob("*_rank0.json")
    line = next(line for line in done.stdout.splitlines() if line.startswith("[PROFILE]"))
    return line, json.loads(trace.read_text())["traceEvents"]


def test_profile_records_cuda_kernels(tmp_path):
    """--profile on a GPU: the trace holds the device's kernels, not only the CPU's operators."""
    line, events = profiled_events(tmp_path, "--no-cuda-graphs")
    assert "steps 4-6 (eager)" in line, line
    categories = {e.get("cat") for e in events}
    assert "kernel" in categories, categories


def test_a_graphed_profile_traces_the_graphs_replays(tmp_path):
    """With --cuda-graphs the traced steps come after the capture: each is one graph launch
    (the H200's first traces held eager warm-up steps only)."""
    line, events = profiled_events(tmp_path, "--cuda-graphs")
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
    from cuda_graphs import GraphedStep
    from precision import set_deterministic
    from session import run as run_session

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
    from config import Config
    from dist_harness import spawn

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
    config, _ = run_gpu([*QUICK, "--epochs", "1"])
    assert config["cuda_graphs"] == "True"
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
    from conftest import LONG_RUN, stop_at_first_progress

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
    from config import Config
    from dist_harness import EQUAL_CFG, max_diff, spawn, train_and_gather

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
    from config import Config
    from dist_harness import EQUAL_CFG, mid_epoch_stop, stop_mid_epoch_then_resume

    cfg = Config(**{**EQUAL_CFG, "strategy": "ddp", "deterministic": True, "epochs": 2})
    reached, difference = stop_mid_epoch_then_resume(tmp_path, cfg, share_gpu=True)
    assert reached == mid_epoch_stop(cfg.train_samples // cfg.batch_size)[1]
    assert difference <= 1e-4


def kill_rank1_mid_training(env, cfg) -> str | None:
    """Rank 1 dies at its 5th step; rank 0 returns the line it would end with."""
    import peer_failures
    import stopping
    from session import run as run_session

    if env.rank == 1:
        poll, calls = stopping.StopRequest.poll, []

        def poll_then_die(self):
            calls.append(1)
            if len(calls) == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return poll(self)

        stopping.StopRequest.poll = poll_then_die
    try:
        run_session(cfg, env)
    except Exception as e:
        if peer_failures.is_peer_failure(e):
            return peer_failures.describe_peer_failure(e)
        raise
    return None


def test_a_rank_killed_on_the_gpu_ends_the_other_with_its_line():
    from config import Config
    from dist_harness import EQUAL_CFG, spawn_outcomes

    cfg = Config(**EQUAL_CFG, strategy="ddp")
    outcomes = spawn_outcomes(kill_rank1_mid_training, 2, cfg, pg_timeout_s=30, share_gpu=True)
    status, line = outcomes[0]
    assert status == "ok" and line.startswith("rank 0: rank(s) 1 died or hung"), outcomes[0]
    assert outcomes[1] == ("died", -signal.SIGKILL), outcomes[1]
