"""The launchers without SLURM: run.sh's local mode and header, edf.toml, and run_benchmarks.py's
job scripts, checks and errors (its real SLURM runs are in test_slurm.py)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import tomllib

import samples
from config import option_flag
from conftest import (
    LONG_RUN,
    REPO,
    TINY,
    assert_one_line_error,
    benchmarks,
    config_in,
    copy_repo,
    metrics_in,
    run,
)
from helpers import on_path, run_log, start_batch_script, wait_for
from layout import SWEEP_OUTCOME
from utils import parse_comm

# ----------------------------------------------------------------------------- edf.toml


def test_edf_is_a_cscs_environment_definition():
    with open(REPO / "edf.toml", "rb") as f:
        edf = tomllib.load(f)
    assert isinstance(edf["image"], str) and edf["image"]
    assert edf["mounts"] and all(isinstance(m, str) for m in edf["mounts"])
    assert isinstance(edf["workdir"], str) and edf["workdir"]
    assert edf["writable"] is True
    # The Container Engine takes only strings in [env] and [annotations].
    assert all(isinstance(v, str) for v in edf["env"].values())
    assert edf["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert edf["env"]["MPICH_GPU_SUPPORT_ENABLED"] == "0"
    hook = edf["annotations"]["com"]["hooks"]["aws_ofi_nccl"]
    # The plugin that loads the image's own CUDA runtime: no CUDA version to keep in step.
    assert hook == {"enabled": "true", "variant": "cuda-dl"}
    # An NGC PyTorch image (nvcr.io#nvidia/pytorch:YY.MM-py3) of 25.12 or later: 25.10 and
    # before carry a torch older than distributed_utils.OLDEST_TORCH.
    tag = re.fullmatch(r"nvcr\.io#nvidia/pytorch:(\d\d)\.(\d\d)-py3", edf["image"])
    assert tag and (int(tag[1]), int(tag[2])) >= (25, 12), edf["image"]
    known = "image mounts workdir writable entrypoint base_environment env annotations"
    assert set(edf) <= set(known.split())
    assert "CHANGE" in (REPO / "edf.toml").read_text()  # says what to change


# ----------------------------------------------------------------------------- run.sh


def sbatch_options() -> dict:
    options = {}
    for line in (REPO / "run.sh").read_text().splitlines():
        if line.startswith("#SBATCH "):
            name, _, value = line.split(maxsplit=1)[1].partition("=")
            options[name] = value
    return options


def test_run_sh_defaults_are_the_course_job():
    options = sbatch_options()
    assert options["--nodes"] == "1"
    assert options["--ntasks-per-node"] == "4"
    assert options["--gpus-per-node"] == "4"
    assert int(options["--cpus-per-task"]) >= 1
    assert re.fullmatch(r"\d+:\d\d:\d\d", options["--time"])
    # A pair of files per job: an earlier job's error line is never read as this one's.
    assert options["--output"] == "train_%j.log" and options["--error"] == "train_%j.err"
    # Whose account and which reservation is the user's business: -A or SBATCH_ACCOUNT.
    assert not {"--account", "-A", "--reservation"} & set(options)


FAKE_BIN = REPO / "tests" / "fake-bin"


def test_run_sh_trains_locally_with_torchrun_and_samples_its_ranks(tmp_path):
    """One run.sh launch without SLURM: two ranks through torchrun, each forking DataLoader
    workers (--loader classic), sampled every second, with a fake nvidia-smi on PATH. What
    run.sh decides, seen in what the ranks used: torchrun's world and rendezvous, and the
    cores shared between the processes (OMP_NUM_THREADS, main.py's `threads`)."""
    repo = copy_repo(tmp_path)
    # This launch's own copy of the fake nvidia-smi: a concurrent test's (make test runs two
    # workers) is no sampler left running by this run.
    fake_bin = shutil.copytree(FAKE_BIN, tmp_path / "fake-bin")
    loader = ["--loader", "classic", "--num-workers", "2"]
    done = run(
        ["bash", "run.sh", *LONG_RUN, "--train-samples", "2048", *loader, "--device", "cpu"]
        + ["--no-checkpoint"],
        cwd=repo,
        timeout=170,
        NPROC="2",
        OMP_NUM_THREADS="",
        SAMPLE_EVERY="1",
        SAMPLES_DIR=str(tmp_path / "samples"),
        PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = metrics_in(done.stdout)
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert all(m["world_size"] == 2 and m["job_id"] == "local" for m in metrics)
    config = config_in(done.stdout)
    assert (config["world_size"], config["nodes"]) == (2, 1)
    assert re.fullmatch(r"[\w.-]+:\d+", config["rendezvous"]), config["rendezvous"]
    assert config["threads"] == max(1, os.cpu_count() // 2)
    assert config["cpus"] == os.cpu_count()  # what the collector weighs the threads against
    assert done.stdout.startswith("check: ok: strategy=ddp world sizes 2")

    # The samplers: GPUs and ranks, then stopped.
    files = samples.sample_files(tmp_path / "samples")
    assert sorted(kind for kind, *_ in files) == ["cpu", "gpu"], files
    assert {job for _, job, _, _ in files} == {files[0][1]} and files[0][1].startswith("local-")
    gpus, processes = samples.summarize([tmp_path / "samples"])
    assert list(gpus["gpu"]) == [0, 1]
    assert (gpus["samples"] >= 2).all() and (gpus["peak_mem_mib"] >= 1100).all()
    assert list(gpus["mean_util_pct"]) == [50, 60]
    # The two ranks, not torchrun's agent nor the DataLoader workers each rank forked with its
    # own command line and environment; each sampled at least twice (a CPU share needs two).
    assert len(processes) == 2, processes
    assert (processes["peak_rss_mb"] > 50).all() and (processes["mean_cpu_pct"] > 0).all()
    # Nothing keeps sampling after the job: no fake nvidia-smi, no sampler loop.
    left = subprocess.run(["pgrep", "-f", str(fake_bin)], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def test_run_sh_refuses_bad_input_before_starting_ranks(repo_copy):
    t0 = time.monotonic()
    done = run(["bash", "run.sh", "--batch-size", "3"], cwd=repo_copy, NPROC="2")
    elapsed = time.monotonic() - t0
    assert_one_line_error(done, "global batch size 3 must be a multiple of the world size 2")
    assert "torchrun" not in done.stdout + done.stderr
    assert not (repo_copy / "logs" / "torchrun").exists()  # no rank was started
    assert elapsed < 30, elapsed  # about 8 s on the 2-core development machine
    assert_one_line_error(run(["bash", "run.sh"], cwd=repo_copy, NPROC="zero"), "NPROC")
    (repo_copy / "main.py").unlink()
    assert_one_line_error(run(["bash", "run.sh"], cwd=repo_copy), "main.py")


@pytest.mark.timeout(120)
def test_a_rank_failing_at_run_time_ends_with_its_own_line_and_status(repo_copy, tmp_path):
    """No internet: rank 0's download fails. The user sees its one line last and its exit
    status 2, not torchrun's report and status 1; the report is kept in a file."""
    done = run(
        ["bash", "run.sh", "--data-dir", tmp_path, "--epochs", "1"],
        cwd=repo_copy,
        timeout=110,
        NPROC="2",
        PYTHONPATH=str(REPO / "tests" / "offline"),
    )
    line = assert_one_line_error(done, "downloading CIFAR-10", "--dataset synthetic")
    assert done.stderr.strip().splitlines()[-1] == line
    assert "ChildFailedError" not in done.stdout + done.stderr
    [report] = (repo_copy / "logs" / "torchrun").glob("*/torchrun.log")
    assert "Root Cause" in report.read_text()
    assert str(report.parent.relative_to(repo_copy)) in done.stderr


# What SLURM's binaries would do, for run.sh's batch path: the sampler's srun waits to be
# ended; the tasks' srun "trains" until SIGUSR1 (the warning, passed on by run.sh), then exits
# with $TASKS_STATUS; scontrol writes down what it was asked. The Python that checks the
# arguments takes as long as the test wants: until it creates $CALLS.checked.
SLURM_STAND_INS = {
    "srun": """if [[ " $* " == *" --overlap "* ]]; then exec sleep 600; fi
trap 'exit "$TASKS_STATUS"' USR1
touch "$CALLS.started"
while true; do sleep 0.1; done""",
    "scontrol": 'echo "scontrol $*" >>"$CALLS"',
    "python": """touch "$CALLS.checking"
until [ -e "$CALLS.checked" ]; do sleep 0.1; done""",
}


def warned_batch_job(
    repo_copy: Path,
    tmp_path: Path,
    tasks_status: int,
    restarts: int,
    warned_while: str = "training",
):
    """run.sh as SLURM's batch script, given the time-limit warning while its tasks train, or
    while it checks the arguments, before any task started."""
    script, calls = start_batch_script(repo_copy, tmp_path, SLURM_STAND_INS, tasks_status, restarts)
    try:
        wait_for(Path(f"{calls}.checking"), script)
        if warned_while == "checking":
            script.send_signal(signal.SIGUSR1)
            time.sleep(0.5)  # bash takes it now, runs the trap once the check ends
        Path(f"{calls}.checked").touch()
        if warned_while == "training":
            wait_for(Path(f"{calls}.started"), script)
            script.send_signal(signal.SIGUSR1)
        out, err = script.communicate(timeout=30)
    finally:
        script.kill()
    requeues = calls.read_text().splitlines() if calls.exists() else []
    return subprocess.CompletedProcess(script.args, script.returncode, out, err), requeues


@pytest.mark.parametrize(
    "tasks_status, restarts, requeued",
    [
        (3, 0, True),  # stopped on the warning with a checkpoint: go on in a requeued job
        (138, 2, True),  # killed by the warning during start-up: likewise
        (0, 0, False),  # finished anyway: nothing left to do
        (3, 10, False),  # the tenth requeue was the last (MAX_REQUEUES): not forever
    ],
)
def test_the_time_limit_warning_requeues_only_a_job_with_work_left(
    repo_copy, tmp_path, tasks_status, restarts, requeued
):
    done, requeues = warned_batch_job(repo_copy, tmp_path, tasks_status, restarts)
    assert done.returncode == tasks_status, done.stdout + done.stderr
    assert requeues == (["scontrol requeue 4242"] if requeued else []), done.stdout + done.stderr
    if tasks_status == 0:
        assert "finished before its time limit; not requeued" in done.stdout
    if requeued:
        assert f"requeueing it ({restarts + 1} of at most 10)" in done.stdout
    if not requeued and tasks_status:
        assert_one_line_error(
            done, "requeued 10 times already (MAX_REQUEUES=10): not again", status=tasks_status
        )


def test_a_warning_before_the_tasks_start_requeues_the_job(repo_copy, tmp_path):
    """A short time limit can be warned of while run.sh still checks the arguments: no task
    has trained, so the job must requeue, not end as COMPLETED with nothing done."""
    done, requeues = warned_batch_job(repo_copy, tmp_path, 0, 0, warned_while="checking")
    assert requeues == ["scontrol requeue 4242"], done.stdout + done.stderr
    assert "warned of its time limit before its tasks started" in done.stdout
    assert not (tmp_path / "calls.started").exists()  # and no task was started after it


def loopback_commands() -> list[list[str]]:
    """The commands suggested for the loopback cluster, as written: start.sh's header and the
    shell block of slurm.md's section on it, continuation lines joined."""
    header = (REPO / ".ci" / "slurm" / "start.sh").read_text().split("set -euo")[0]
    section = (REPO / "docs" / "slurm.md").read_text().split("## Trying it without a cluster")[1]
    lines = [line[1:].strip() for line in header.splitlines() if line.startswith("#     ")]
    lines += section.split("```bash")[1].split("```")[0].splitlines()
    commands = re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()
    return [c.split() for c in commands if re.match(r"(sbatch|\S*python) .*run", c)]


def test_the_loopback_cluster_commands_run_on_its_fake_gpus():
    """Every command suggested for the loopback cluster gives main.py arguments that pass its
    check where SLURM hands out GPUs torch cannot see, as run.sh checks them in the job."""
    commands = loopback_commands()
    assert len(commands) >= 2
    for words in commands:
        after = "--" if "--" in words else next(w for w in words if w.endswith("run.sh"))
        main_args = words[words.index(after) + 1 :]
        done = run(
            [sys.executable, "main.py", *main_args, "--check", "4"],
            CUDA_VISIBLE_DEVICES="0,1,2,3",
        )
        assert done.returncode == 0, f"{' '.join(words)}\n{done.stderr}"


# ----------------------------------------------------------------------------- run_benchmarks.py


def test_dry_run_prints_one_script_per_configuration_and_writes_nothing(repo_copy):
    done = benchmarks("--dry-run", "--", "--dataset", "synthetic", cwd=repo_copy)
    assert done.returncode == 0, done.stderr
    sweep = re.search(r"^# ---- jobs/(sweep-[\d-]+)/", done.stdout, re.MULTILINE).group(1)
    scripts = dict(
        re.findall(
            rf"^# ---- jobs/{sweep}/(\S+)\.sh.*?\n(.*?)(?=^# ---- |\Z)",
            done.stdout,
            re.MULTILINE | re.DOTALL,
        )
    )
    names = {f"{s}_{g}gpu" for s in ("ddp", "fsdp") for g in (1, 2, 4, 8)}
    assert set(scripts) == names | {"collect"}
    eight = scripts["fsdp_8gpu"]
    for option in (
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        f"--output=logs/{sweep}/fsdp_8gpu_%j.log",
        f"--error=logs/{sweep}/fsdp_8gpu_%j.err",
    ):
        assert option in eight
    # One launch recipe: every job submits run.sh, with main.py's arguments after it.
    assert re.search(
        r"run\.sh --strategy fsdp --model cnn --epochs \d+ --batch-size 256 .*--dataset synthetic",
        eight,
    )
    assert "--nodes=1" in scripts["ddp_1gpu"] and "--ntasks-per-node=1" in scripts["ddp_1gpu"]
    assert f"LOGS=logs/{sweep} bash plot_results.sh" in scripts["collect"]
    assert not (repo_copy / "jobs").exists() and not list((repo_copy / "logs").iterdir())


def collect_job(repo_copy: Path, *options: str) -> tuple[str, Path, str]:
    """The sweep's name, its collect job's script as a dry run writes it, and what it printed."""
    done = benchmarks("--dry-run", "--gpus", "1", "--strategies", "ddp", *options, cwd=repo_copy)
    assert done.returncode == 0, done.stderr
    sweep, collect = re.search(
        r"^# ---- jobs/(sweep-[\d-]+)/collect\.sh.*?\n(.*)", done.stdout, re.MULTILINE | re.DOTALL
    ).groups()
    job = repo_copy / "jobs" / sweep / "collect.sh"
    job.parent.mkdir(parents=True)
    job.write_text(collect)
    return sweep, job, done.stdout


def test_the_jobs_take_slurm_options_and_the_collect_job_its_sweep_in_the_container(
    repo_copy, tmp_path
):
    """A dry run's jobs carry SLURM's options and the container. The collect job's command, run
    by stand-ins for sbatch (runs --wrap) and srun (drops its options, shows what it would
    start and with which LOGS)."""
    slurm = {"--account": "acct", "--partition": "normal", "--time": "00:10:00"}
    options = [*(w for pair in slurm.items() for w in pair), "--environment", "edf.toml"]
    sweep, job, printed = collect_job(repo_copy, *options)
    for option, value in slurm.items():
        assert f"{option}={value}" in printed
    assert f"export EDF={repo_copy / 'edf.toml'}" in printed
    path = on_path(
        tmp_path / "bin",
        sbatch='while [ "$1" != --wrap ]; do shift; done; exec bash -c "$2"',
        srun='while [[ "$1" == --* ]]; do shift; done; echo "LOGS=$LOGS starts: $*"',
    )
    ran = run(["bash", job], cwd=repo_copy, PATH=path)
    assert f"LOGS=logs/{sweep} starts: bash plot_results.sh" in ran.stdout, ran.stdout + ran.stderr


# sbatch as SLURM runs a --wrap job: SLURM_JOB_ID set, its output into --output (%j its id).
SBATCH_RUNS_THE_JOB = """while [ "$1" != --wrap ]; do
    case $1 in --output=*) out=${1#--output=} ;; esac
    shift
done
export SLURM_JOB_ID=77
bash -c "$2" > "${out//%j/77}" 2>&1"""


def test_a_failed_collect_job_says_so_in_its_status_and_the_sweeps_folder(repo_copy, tmp_path):
    """Every job of the sweep died (a log without metrics): the collect job exits non-zero, the
    status sacct shows, and its outcome in the sweep's folder says so with the error line;
    once a log with metrics is there, it exits 0 and the outcome file is read as no log."""
    sweep, job, _ = collect_job(repo_copy)
    logs = repo_copy / "logs" / sweep
    logs.mkdir()
    (logs / "ddp_1gpu_5.log").write_text("error: rank 0 died\n")
    path = on_path(tmp_path / "bin", sbatch=SBATCH_RUNS_THE_JOB)
    failed = run(["bash", job], cwd=repo_copy, PATH=path, timeout=120)
    outcome = (logs / SWEEP_OUTCOME).read_text().splitlines()
    assert failed.returncode != 0
    assert outcome[0].startswith(f"collect job 77: exit status {failed.returncode} "), outcome
    assert outcome[0].endswith(f"log jobs/{sweep}/collect_77.log")
    assert outcome[1].startswith("error: no usable [METRIC] lines"), outcome
    (logs / "ddp_1gpu_5.log").unlink()
    run_log(logs, "ddp_1gpu_6.log", world_size=1, job_id="6")
    done = run(["bash", job], cwd=repo_copy, PATH=path, timeout=120)
    log = (repo_copy / "jobs" / sweep / "collect_77.log").read_text()
    assert done.returncode == 0, log
    assert (logs / SWEEP_OUTCOME).read_text().startswith("collect job 77: exit status 0 ")
    assert SWEEP_OUTCOME not in log  # not reported as a log without metrics


def test_a_sweep_not_waited_for_says_where_to_learn_its_outcome(repo_copy, tmp_path):
    """Without --wait: the last line names the outcome file the collect job will write and the
    sacct command that shows every job's state, with every job id submitted."""
    ids = tmp_path / "last_job_id"
    path = on_path(
        tmp_path / "bin",
        sbatch=f"n=$(($(cat {ids} 2>/dev/null || echo 100) + 1)); echo $n >{ids}; echo $n",
    )
    done = benchmarks(
        "--gpus", "1", "2", "--strategies", "ddp", "--", "--device", "cpu", cwd=repo_copy, PATH=path
    )
    assert done.returncode == 0, done.stderr
    (sweep,) = [p.name for p in (repo_copy / "logs").iterdir()]
    last = done.stdout.splitlines()[-1]
    assert f"logs/{sweep}/{SWEEP_OUTCOME} says whether collecting gave results" in last, last
    assert "sacct -X -j 101,102,103 " in last, last


def test_a_sweep_runs_the_pipeline_where_the_model_cuts_and_says_so_once():
    """1, 2, 4, 8 GPUs x ddp, pipeline: the CNN's 4 units make 2 or 4 stages, so the pipeline
    runs at 2 and 4 only; one note names the counts skipped, no error; ddp runs at all four."""
    done = benchmarks(
        "--local", "--dry-run", "--strategies", "ddp", "pipeline", "--", "--dataset", "synthetic"
    )
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "pipeline" in line]
    assert notes == [
        "note: pipeline skipped at GPU counts 1, 8: --strategy pipeline cuts --model cnn's 4 "
        "units into one stage per rank, the same number each: world size 2 or 4"
    ]
    runs = re.findall(r"^NPROC=(\d) bash run.sh --strategy (\w+)", done.stdout, re.M)
    assert [" ".join(r) for r in runs] == "1 ddp,2 ddp,2 pipeline,4 ddp,4 pipeline,8 ddp".split(",")
    alone = benchmarks("--local", "--dry-run", "--strategies", "pipeline", "--gpus", "1", "8")
    assert_one_line_error(alone, "nothing to run: --strategy pipeline cuts --model cnn's 4 units")


def test_local_dry_run_lists_the_torchrun_sweep():
    """The CNN alone by default; --models gives each model its own runs, one model after the
    other."""
    done = benchmarks("--local", "--dry-run", "--gpus", "1", "2", "--strategies", "ddp")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == [
        "NPROC=1 bash run.sh --strategy ddp --model cnn --epochs 5 --batch-size 256 "
        "--precision fp32 --comm-benchmark",
        "NPROC=2 bash run.sh --strategy ddp --model cnn --epochs 5 --batch-size 256 "
        "--precision fp32 --comm-benchmark",
    ]
    assert re.fullmatch(r"LOGS=logs/sweep-[\d-]+ bash plot_results\.sh", lines[2]), lines
    both = benchmarks(
        *("--local", "--dry-run", "--gpus", "1", "2", "--strategies", "ddp"),
        *("--models", "cnn", "cnn-wide"),
        timeout=120,  # a check per model: on a loaded machine, seconds each
    )
    runs = re.findall(r"^NPROC=(\d) bash run.sh --strategy ddp --model ([\w-]+)", both.stdout, re.M)
    assert runs == [("1", "cnn"), ("2", "cnn"), ("1", "cnn-wide"), ("2", "cnn-wide")], both.stderr


def test_weak_scaling_keeps_the_batch_per_gpu_and_repeats_repeat():
    weak = "--gpus 1 2 4 --strategies ddp --scaling weak --batch-size 32 --repeats 2"
    done = benchmarks("--local", "--dry-run", *weak.split())
    assert done.returncode == 0, done.stderr
    runs = [
        line.split()[0] + " " + line.split("--batch-size ")[1].split()[0]
        for line in done.stdout.splitlines()[:-1]
    ]
    assert runs == [f"NPROC={n} {32 * n}" for n in (1, 2, 4) for _ in range(2)]


@pytest.mark.parametrize(
    "gpus,strategies",
    [("2", ["ddp", "fsdp", "fsdp2"]), ("1", ["ddp", "fsdp", "fsdp2", "dp", "single"])],
)
def test_the_sweep_takes_every_strategy(gpus, strategies, repo_copy):
    """Each is checked by main.py --check (nothing submitted on a dry run) and gets its job."""
    sweep = ["--gpus", gpus, "--strategies", *strategies, "--", "--dataset", "synthetic"]
    done = benchmarks("--dry-run", *sweep, cwd=repo_copy)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^# ---- jobs/sweep-[\d-]+/(\w+)\.sh$", done.stdout, re.M) == [
        f"{s}_{gpus}gpu" for s in strategies
    ]


# A sweep that main.py's check refuses: each rank's 128 images a step do not split into 3.
REFUSED_BY_THE_CHECK = ["--gpus", "2", "--", "--dataset", "synthetic", "--grad-accum", "3"]


def test_missing_sbatch_is_a_clear_error(tmp_path):
    """Bad input, status 2, said at once: before main.py --check runs (seconds in vain). The
    second sweep would fail that check; it is sbatch that is named."""
    done = benchmarks("--gpus", "1", PATH=str(tmp_path))  # a PATH without sbatch
    assert_one_line_error(done, "sbatch not found", status=2)
    done = benchmarks(*REFUSED_BY_THE_CHECK, PATH=str(tmp_path))
    assert_one_line_error(done, "sbatch not found", status=2)
    assert "main.py" not in done.stdout + done.stderr  # the check's error, had it run


SWEEP_CHOICE = "is the sweep's choice: use run_benchmarks.py"


@pytest.mark.parametrize(
    "args,fragment",
    [
        ("--gpus 5", "5 GPUs do not spread evenly over 2 nodes"),
        ("--gpus 8 --gpus-per-node 3", "8 GPUs do not spread evenly over 3 nodes"),
        ("--gpus 0", "at least 1"),
        ("--gpus 4 --batch-size 30", "--batch-size 30"),
        ("--local --environment edf.toml", "--environment needs SLURM"),
        ("--repeats 0", "--repeats must be at least 1"),
        (
            "--gpus 1 2 --scaling weak --batch-size 6 -- --dataset synthetic --grad-accum 4",
            "main.py --strategy ddp: each rank's 6 images per step do not split into "
            "--grad-accum 4",
        ),
        ("--gpus 1 2 --strategies ddp single", "single run one process"),
        (
            "--gpus 1 --dataset synthetic",
            "--dataset is an option of main.py: put main.py's options after --",
        ),
        (
            "--gpus 1 --strategy fsdp",
            f"--strategy is an option of main.py that {SWEEP_CHOICE} --strategies",
        ),
        ("--gpus 1 -- --method=fsdp", f"--method after -- {SWEEP_CHOICE} --strategies"),
        ("--gpus 1 -- --batch 64", f"--batch after -- {SWEEP_CHOICE} --batch-size"),
        ("--gpus 1 -- --gpus 4", f"--gpus after -- {SWEEP_CHOICE} --gpus and --gpus-per-node"),
        ("--gpus 1 -- --nodes=2", f"--nodes after -- {SWEEP_CHOICE} --gpus and --gpus-per-node"),
        (
            " ".join(REFUSED_BY_THE_CHECK),
            "main.py --strategy ddp: each rank's 128 images per step do not split into "
            "--grad-accum 3",
        ),
        (
            "--gpus 2 -- --dataset synthetic --modle cnn",
            "unrecognized option --modle; did you mean --model?",
        ),
    ],
)
def test_bad_sweeps_are_refused_before_anything_runs(args, fragment, repo_copy):
    """Our own options, and main.py's through main.py --check for every configuration: one
    line, exit status 2, and no job script or log folder written."""
    assert_one_line_error(benchmarks("--dry-run", *args.split(), cwd=repo_copy), fragment)
    assert not (repo_copy / "jobs").exists() and not list((repo_copy / "logs").iterdir())


def test_every_main_py_option_the_sweep_sets_is_refused_after_the_double_dash(repo_copy):
    """main.py takes the last of two: given again after --, a job named ddp_1gpu would train
    what came after it. The options refused are exactly those each job's command line sets."""
    import run_benchmarks

    args = run_benchmarks.parse_args(["--gpus", "1"])
    job = run_benchmarks.main_args(run_benchmarks.plan(args)[0], [])
    set_with_a_value = {
        flag: value
        for flag, value in zip(job, job[1:])
        if flag.startswith("--") and not value.startswith("--")
    }
    assert set(set_with_a_value) == {option_flag(d) for d in run_benchmarks.SWEEP_OPTION}
    for dest, ours in run_benchmarks.SWEEP_OPTION.items():
        flag = option_flag(dest)
        assert_one_line_error(
            benchmarks(
                "--dry-run", "--gpus", "1", "--", flag, set_with_a_value[flag], cwd=repo_copy
            ),
            f"{flag} after -- {SWEEP_CHOICE} {ours}",
        )
    assert not (repo_copy / "jobs").exists()


def test_a_sweep_started_by_a_python_without_torch_checks_with_the_jobs_python(repo_copy):
    """`python run_benchmarks.py` from a shell whose python has no torch: the configurations
    are still checked, with the Python run.sh will give the jobs (pick_python.sh's choice)."""
    sweep = [repo_copy / "run_benchmarks.py", "--dry-run", *REFUSED_BY_THE_CHECK]
    done = run([sys.executable, "-S", *sweep], cwd=repo_copy, PYTHON=sys.executable)
    assert_one_line_error(done, "each rank's 128 images per step do not split into --grad-accum 3")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_sweep_of_two_models_trains_collects_and_plots(tmp_path):
    """One tiny local sweep (each run costs seconds of torchrun): the issue's two models x fsdp
    x 1, 2 CPU ranks, one epoch. Both models' rows (each its own parameter count, from its
    [CONFIG] line), the figures, and report.md's projection, re-derived by hand from one run's
    epoch lines."""
    from model import build_model, count_parameters

    repo = copy_repo(tmp_path)
    done = benchmarks(
        *("--local", "--models", "cnn", "cnn-wide", "--gpus", "1", "2", "--strategies", "fsdp"),
        *("--epochs", "1", "--batch-size", "32", "--", *TINY, "--no-checkpoint"),
        cwd=repo,
        timeout=550,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (sweep,) = (repo / "logs").glob("sweep-*")  # the sweep's own folder
    # The ranks named after the device main.py --check found, as the tables name them.
    said = [line.split(" here: ")[0] for line in done.stdout.splitlines() if " here: log " in line]
    ranks = ("1 CPU rank", "2 CPU ranks")
    assert said == [f"{m} fsdp on {n}" for m in ("cnn", "cnn-wide") for n in ranks], said
    assert "strong scaling: global batch 32 at every CPU rank count" in done.stderr
    assert "| model | strategy | CPU ranks |" in done.stdout
    logs = sorted(re.sub(r"_local-[\d-]+", "", p.name) for p in sweep.glob("*.log"))
    assert logs == sorted(f"fsdp_{g}gpu{m}.log" for m in ("", "_cnn-wide") for g in (1, 2))
    # Every job measured its collectives first (--comm-benchmark): comm.csv, the figures (the
    # bandwidth one from the multi-rank jobs) and the report.
    for log in sweep.glob("*.log"):
        assert any(parse_comm(line) for line in log.read_text().splitlines()), log.name
    assert set(pd.read_csv(repo / "comm.csv")["world_size"]) == {1, 2}
    figures = ["time_breakdown.png", "comm_bandwidth.png", "peak_memory.png", "report.md"]
    for name in [*figures, "bytes_per_parameter.png"]:
        assert (repo / "plots" / name).stat().st_size > 0, name
    report = (repo / "plots" / "report.md").read_text()
    assert "comm at measured bw s" in report

    results = pd.read_csv(repo / "results.csv")
    points = results.groupby("model")["gpus"].nunique()
    assert points.to_dict() == {"cnn": 2, "cnn-wide": 2}
    for model, parameters in results.groupby("model")["parameters"].unique().items():
        assert list(parameters) == [count_parameters(build_model(model))], model
    section = report.split("## The largest model that fits")[1]
    (log,) = sweep.glob("fsdp_2gpu_cnn-wide_*.log")
    config, epochs = config_in(log.read_text()), metrics_in(log.read_text())
    assert [e["state_pred"] for e in epochs] == [e["state_mem"] for e in epochs]
    state = max(e["state_mem"] for e in epochs)
    activations = max(e["act_per_image"] for e in epochs) * epochs[-1]["local_batch"]
    largest = (80 * 2**30 - activations) / (state / config["parameters"])
    assert f"| cnn-wide | {config['parameters']:,} | fsdp | 2 |" in section
    assert f"| {largest / 1e6:,.1f} M |" in section, section
