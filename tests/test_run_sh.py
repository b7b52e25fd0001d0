"""The launchers without SLURM: run.sh's local mode and header, edf.toml, and run_benchmarks.py's
job scripts, checks and errors (its real SLURM runs are in test_slurm.py)."""

import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO, clean_environment
from utils import parse_metric

TINY = ["--dataset", "synthetic", "--train-samples", "128", "--val-samples", "32",
        "--batch-size", "32", "--print-every", "1000"]


def metrics_in(text: str) -> list[dict]:
    return [m for m in map(parse_metric, text.splitlines()) if m]


def run(command: list, cwd=REPO, timeout=30, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], cwd=cwd, env=clean_environment(**env),
                          capture_output=True, text=True, timeout=timeout)


def benchmarks(*args, cwd=REPO, **env) -> subprocess.CompletedProcess:
    return run([sys.executable, cwd / "run_benchmarks.py", *args], cwd=cwd, **env)


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0]


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
    assert hook == {"enabled": "true", "variant": "cuda12"}
    assert set(edf) <= {"image", "mounts", "workdir", "writable", "entrypoint",
                        "base_environment", "env", "annotations"}


def test_edf_says_what_to_change():
    assert "CHANGE" in (REPO / "edf.toml").read_text()


# ----------------------------------------------------------------------------- run.sh

def sbatch_options() -> dict:
    options = {}
    for line in (REPO / "run.sh").read_text().splitlines():
        if line.startswith("#SBATCH "):
            name, _, value = line.split(maxsplit=1)[1].partition("=")
            options[name] = value
    return options


def test_run_sh_is_valid_bash():
    assert run(["bash", "-n", REPO / "run.sh"]).returncode == 0


def test_run_sh_defaults_are_the_course_job():
    options = sbatch_options()
    assert options["--nodes"] == "1"
    assert options["--ntasks-per-node"] == "4"
    assert options["--gpus-per-node"] == "4"
    assert int(options["--cpus-per-task"]) >= 1
    assert re.fullmatch(r"\d+:\d\d:\d\d", options["--time"])
    assert options["--output"] == "train.log" and options["--error"] == "train.err"
    # Whose account and which reservation is the user's business: -A or SBATCH_ACCOUNT.
    assert not {"--account", "-A", "--reservation"} & set(options)


def test_run_sh_sets_what_the_course_points_to():
    text = (REPO / "run.sh").read_text()
    for needle in ("MASTER_ADDR", "MASTER_PORT", "RANK=$SLURM_PROCID", "LOCAL_RANK=$SLURM_LOCALID",
                   "WORLD_SIZE=$SLURM_NTASKS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                   "MPICH_GPU_SUPPORT_ENABLED", "OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK",
                   "--environment="):
        assert needle in text


@pytest.mark.timeout(180)
def test_run_sh_trains_locally_with_torchrun(repo_copy):
    done = run(["bash", "run.sh", *TINY, "--epochs", "2"], cwd=repo_copy, timeout=170, NPROC="2")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = metrics_in(done.stdout)
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert all(m["world_size"] == 2 and m["job_id"] == "local" for m in metrics)


def test_run_sh_rejects_a_bad_nproc():
    done = run(["bash", "run.sh"], NPROC="zero")
    assert_one_line_error(done, "NPROC")


def test_run_sh_needs_main_py(tmp_path):
    shutil.copy(REPO / "run.sh", tmp_path)
    done = run(["bash", "run.sh"], cwd=tmp_path)
    assert_one_line_error(done, "main.py")


# ----------------------------------------------------------------------------- run_benchmarks.py

def test_dry_run_prints_one_script_per_configuration_and_writes_nothing(repo_copy):
    done = benchmarks("--dry-run", "--", "--dataset", "synthetic", cwd=repo_copy)
    assert done.returncode == 0, done.stderr
    scripts = dict(re.findall(r"^# ---- jobs/(\S+)\.sh.*?\n(.*?)(?=^# ---- |\Z)", done.stdout,
                              re.MULTILINE | re.DOTALL))
    names = {f"{s}_{g}gpu" for s in ("ddp", "fsdp") for g in (1, 2, 4, 8)}
    assert set(scripts) == names | {"collect"}
    eight = scripts["fsdp_8gpu"]
    for option in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4",
                   "--output=logs/fsdp_8gpu_%j.log", "--error=logs/fsdp_8gpu_%j.err"):
        assert option in eight
    # One launch recipe: every job submits run.sh, with main.py's arguments after it.
    assert re.search(r"run\.sh --strategy fsdp --epochs \d+ --batch-size 256 .*--dataset synthetic",
                     eight)
    assert "--nodes=1" in scripts["ddp_1gpu"] and "--ntasks-per-node=1" in scripts["ddp_1gpu"]
    assert "plot_results.sh" in scripts["collect"]
    assert not (repo_copy / "jobs").exists()


def test_dry_run_passes_slurm_options_and_the_container(repo_copy):
    done = benchmarks("--dry-run", "--gpus", "2", "--strategies", "ddp", "--account", "acct",
                      "--partition", "normal", "--time", "00:10:00", "--environment", "edf.toml",
                      cwd=repo_copy)
    assert done.returncode == 0, done.stderr
    for option in ("--account=acct", "--partition=normal", "--time=00:10:00",
                   f"export EDF={repo_copy / 'edf.toml'}"):
        assert option in done.stdout


def test_local_dry_run_lists_the_torchrun_sweep():
    done = benchmarks("--local", "--dry-run", "--gpus", "1", "2", "--strategies", "ddp")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "NPROC=1 bash run.sh --strategy ddp --epochs 5 --batch-size 256 --precision fp32",
        "NPROC=2 bash run.sh --strategy ddp --epochs 5 --batch-size 256 --precision fp32",
        "bash plot_results.sh"]


def test_missing_sbatch_is_a_clear_error(tmp_path):
    done = benchmarks("--gpus", "1", PATH=str(tmp_path))  # a PATH without sbatch
    assert_one_line_error(done, "sbatch not found")


@pytest.mark.parametrize("args,fragment", [
    (["--gpus", "5"], "5 GPUs do not spread evenly over 2 nodes"),
    (["--gpus", "8", "--gpus-per-node", "3"], "8 GPUs do not spread evenly over 3 nodes"),
    (["--gpus", "0"], "at least 1"),
    (["--gpus", "4", "--batch-size", "30"], "--batch-size 30"),
    (["--local", "--environment", "edf.toml"], "--environment needs SLURM"),
])
def test_bad_sweeps_are_refused_before_anything_runs(args, fragment):
    assert_one_line_error(benchmarks("--dry-run", *args), fragment)


def test_choices_agree_with_main():
    import main
    import run_benchmarks
    from fsdp_utils import DTYPES
    assert run_benchmarks.STRATEGIES == main.STRATEGIES
    assert set(run_benchmarks.PRECISIONS) == set(DTYPES)


@pytest.mark.timeout(300)
def test_local_sweep_trains_collects_and_plots(repo_copy):
    done = benchmarks("--local", "--gpus", "1", "2", "--strategies", "ddp", "--epochs", "1",
                      "--batch-size", "32", "--", *TINY[:6], "--print-every", "1000",
                      cwd=repo_copy, timeout=290)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    logs = sorted(p.name for p in (repo_copy / "logs").glob("*.log"))
    assert [re.sub(r"_local-[\d-]+", "", name) for name in logs] == ["ddp_1gpu.log",
                                                                     "ddp_2gpu.log"]
    assert (repo_copy / "results.csv").exists()
    assert list((repo_copy / "plots").glob("*.png"))
