"""The command line as users run it: torchrun, the [METRIC] format, and bad input."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from utils import COURSE_METRIC_RE, format_metric, parse_metric

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dataset", "synthetic", "--train-samples", "512", "--val-samples", "256",
        "--batch-size", "64", "--print-every", "1000", "--no-checkpoint"]


def run_cli(args, nproc=None, timeout=240):
    """main.py as a user starts it: plain python, or torchrun with nproc ranks."""
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_"))}
    return subprocess.run([*launcher, "main.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def metrics_of(stdout: str) -> list[dict]:
    return [m for m in map(parse_metric, stdout.splitlines()) if m]


# ----------------------------------------------------------------------------- [METRIC] format

def test_metric_line_round_trips_and_matches_the_course_regex():
    fields = {"epoch": 3, "time": 2.2049, "val_loss": 1.08091, "acc": 61.4321, "peak_mem": 91,
              "strategy": "fsdp", "world_size": 4, "throughput": 22727.5, "job_id": "local"}
    line = format_metric(fields)
    assert line.startswith("[METRIC] epoch=3 time=2.20 val_loss=1.0809 acc=61.43 peak_mem=91MB ")
    assert COURSE_METRIC_RE.match(line).groups() == ("3", "2.20", "1.0809", "61.43", "91")
    parsed = parse_metric(line)
    assert parsed["strategy"] == "fsdp" and parsed["world_size"] == 4
    assert parsed["throughput"] == pytest.approx(22727.5)
    assert parsed["peak_mem"] == 91 and parsed["epoch"] == 3


def test_parser_reads_srun_prefixed_coloured_lines_and_rejects_cut_ones():
    line = "0: \x1b[92m[METRIC] epoch=1 time=4.09 val_loss=1.4294 acc=47.07 peak_mem=91MB\x1b[0m"
    assert parse_metric(line) == {"epoch": 1, "time": 4.09, "val_loss": 1.4294, "acc": 47.07,
                                  "peak_mem": 91}
    assert parse_metric("[METRIC] epoch=1 time=4.09 val_loss=1.42") is None
    assert parse_metric("[INFO] epoch=1") is None


# ----------------------------------------------------------------------------- real runs

def test_torchrun_fsdp_two_ranks_converges_and_reports_every_field():
    result = run_cli(["--strategy", "fsdp", "--epochs", "3", *TINY[:2], "--train-samples",
                      "2048", "--val-samples", "512", "--batch-size", "128", "--print-every",
                      "1000", "--no-checkpoint"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [l for l in result.stdout.splitlines() if l.startswith("[METRIC]")]
    assert len(lines) == 3 and all(COURSE_METRIC_RE.match(l) for l in lines)
    metrics = metrics_of(result.stdout)
    required = ("strategy world_size nodes global_batch local_batch train_loss val_time "
                "throughput data_wait state_mem precision device dataset seed job_id").split()
    assert all(k in metrics[-1] for k in required), set(required) - set(metrics[-1])
    last = metrics[-1]
    assert (last["strategy"], last["world_size"], last["local_batch"]) == ("fsdp", 2, 64)
    assert last["acc"] > 50, "synthetic data is learnable: far above 10% chance"
    assert last["throughput"] > 0 and last["time"] > 0 and last["peak_mem"] > 0
    assert result.stdout.count("[CONFIG]") == 1  # rank 0 alone prints


def test_fsdp_full_holds_half_the_state_of_ddp_per_rank():
    state = {}
    for strategy in ("ddp", "fsdp"):
        result = run_cli(["--strategy", strategy, "--epochs", "1", *TINY], nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        state[strategy] = metrics_of(result.stdout)[-1]["state_mem"]
    ratio = state["fsdp"] / state["ddp"]
    print(f"state bytes per rank: ddp {state['ddp']}, fsdp {state['fsdp']}, ratio {ratio:.4f}")
    assert ratio == pytest.approx(0.5, abs=0.005)


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "63"], "must be a multiple of the world size 2"),
    (["--batch-size", "1"], "must be a multiple of the world size 2"),
    (["--train-samples", "32"], "make no full global batch"),
    (["--epochs", "0"], "--epochs must be at least 1"),
])
def test_bad_input_is_one_line_and_nonzero(args, message):
    result = run_cli([*TINY, *args], nproc=2)
    assert result.returncode != 0
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    # torchrun reports a failed child with a traceback of its own launcher; none may come
    # from the training program.
    assert not re.search(r'File ".*/(main|train|data|distributed_utils)\.py"', result.stderr)


@pytest.mark.parametrize("args", [["--strategy", "zero"], ["--precision", "fp8"],
                                  ["--sharding", "none"]])
def test_unknown_choices_are_refused(args):
    result = run_cli([*TINY, *args])
    assert result.returncode == 2 and "invalid choice" in result.stderr
    assert "Traceback" not in result.stderr


def test_course_flag_names_are_accepted():
    result = run_cli([*TINY, "--method", "ddp", "--batch_size", "32", "--epochs", "1"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert metrics_of(result.stdout)[0]["global_batch"] == 32


def test_help_explains_every_option():
    out = run_cli(["--help"]).stdout
    for flag in ("--strategy", "--epochs", "--batch-size", "--lr", "--optimizer", "--precision",
                 "--sharding", "--dataset", "--data-dir", "--train-samples", "--val-samples",
                 "--seed", "--num-workers", "--print-every", "--loader"):
        assert re.search(rf"{flag}\b.*\n?\s+\S", out), flag


def test_unwritable_checkpoint_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # root ignores permission bits: use a file as parent
    with_checkpoints = [a for a in TINY if a != "--no-checkpoint"]
    result = run_cli([*with_checkpoints, "--epochs", "1", "--checkpoint-dir",
                      str(blocker / "ckpt")], nproc=2)
    errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-2000:]
    assert "is not writable" in errors[0] and "--checkpoint-dir" in errors[0]


def test_precision_the_device_cannot_do_is_refused(monkeypatch):
    import torch

    from main import Config, make_precision
    from utils import UsageError
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(UsageError, match="bf16 is not supported on Tesla V100"):
        make_precision(Config(precision="bf16"), torch.device("cuda", 0))
    with pytest.raises(UsageError, match="--cpu-offload"):
        make_precision(Config(strategy="fsdp", cpu_offload=True), torch.device("cpu"))
