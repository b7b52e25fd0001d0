"""The command line as users run it: torchrun, the [METRIC] format, --check, --help, the exit
statuses, and bad input."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import main
from config import Config
from conftest import (
    LONG_RUN,
    REPO,
    TINY,
    TORCHRUN,
    assert_breakdown_holds,
    assert_one_line_error,
    clean_environment,
    config_in,
    main_on_ranks,
    metrics_in,
    popen,
    run,
    run_main,
    start_ranks,
    stop_at_first_progress,
)
from cost_model import state_mem
from helpers import assert_stopped_mid_epoch_1, meta_model, wait_for_training
from utils import (
    COMM_FIELDS,
    COURSE_METRIC_RE,
    EXIT_STATUS,
    METRIC_FIELDS,
    format_metric,
    parse_comm,
    parse_config,
    parse_metric,
)

BATCH_64 = [*TINY, "--batch-size", "64"]
QUICK = [*BATCH_64, "--no-checkpoint"]
ONE_EPOCH = [*BATCH_64, "--epochs", "1"]


# ----------------------------------------------------------------------------- [METRIC] format


def test_metric_line_round_trips_and_matches_the_course_regex():
    fields = {
        "epoch": 3,
        "time": 2.2049,
        "val_loss": 1.08091,
        "acc": 61.4321,
        "peak_mem": 91,
        "strategy": "fsdp",
        "world_size": 4,
        "throughput": 22727.5,
        "job_id": "local",
    }
    line = format_metric(fields)
    assert line.startswith("[METRIC] epoch=3 time=2.20 val_loss=1.0809 acc=61.43 peak_mem=91MB ")
    assert COURSE_METRIC_RE.match(line).groups() == ("3", "2.20", "1.0809", "61.43", "91")
    parsed = parse_metric(line)
    assert parsed["strategy"] == "fsdp" and parsed["world_size"] == 4
    assert parsed["throughput"] == pytest.approx(22727.5)
    assert parsed["peak_mem"] == 91 and parsed["epoch"] == 3


def test_metric_fields_come_in_the_one_order_whatever_order_they_are_given_in():
    """utils.METRIC_FIELDS is the line's order: training, the collector's fixtures and any other
    writer give the fields in whatever order, the line has the same one."""
    fields = {
        "epoch": 2,
        "time": 1.0,
        "val_loss": 0.5,
        "acc": 50.0,
        "peak_mem": 10,
        **{name: 1 for name in METRIC_FIELDS[5:]},
        "extra": "x",
    }
    backwards = dict(reversed(list(fields.items())))
    line = format_metric(backwards)
    assert line == format_metric(fields)
    assert list(parse_metric(line)) == [*METRIC_FIELDS, "extra"]


def test_parser_reads_srun_prefixed_coloured_lines_and_rejects_cut_ones():
    line = "0: \x1b[92m[METRIC] epoch=1 time=4.09 val_loss=1.4294 acc=47.07 peak_mem=91MB\x1b[0m"
    assert parse_metric(line) == {
        "epoch": 1,
        "time": 4.09,
        "val_loss": 1.4294,
        "acc": 47.07,
        "peak_mem": 91,
    }
    assert parse_metric("[METRIC] epoch=1 time=4.09 val_loss=1.42") is None
    # The other tagged lines the collector reads from srun's logs, the same way.
    assert parse_config("1: \x1b[0m[CONFIG] strategy=ddp world_size=2") == {
        "strategy": "ddp",
        "world_size": 2,
    }
    assert parse_comm("1: [COMM] " + " ".join(f"{k}=1" for k in COMM_FIELDS))["bytes"] == 1
    assert parse_metric("[INFO] epoch=1") is None


# ----------------------------------------------------------------------------- real runs


def test_torchrun_fsdp_two_ranks_converges_and_reports_every_field():
    result = run_main(
        [
            *TINY,
            "--strategy",
            "fsdp",
            "--epochs",
            "3",
            "--train-samples",
            "2048",
            "--val-samples",
            "512",
            "--batch-size",
            "128",
            "--no-checkpoint",
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("[METRIC]")]
    assert len(lines) == 3 and all(COURSE_METRIC_RE.match(line) for line in lines)
    metrics = metrics_in(result.stdout)
    required = (
        "strategy world_size nodes global_batch local_batch train_loss val_time "
        "throughput data_wait state_mem precision device dataset seed job_id"
    ).split()
    assert all(k in metrics[-1] for k in required), set(required) - set(metrics[-1])
    assert list(metrics[-1]) == list(METRIC_FIELDS)  # every field, in the one order
    last = metrics[-1]
    assert (last["strategy"], last["world_size"], last["local_batch"]) == ("fsdp", 2, 64)
    assert last["sharding"] == "full"
    for m in metrics:
        assert_breakdown_holds(m)
    assert last["acc"] > 50, "synthetic data is learnable: far above 10% chance"
    assert last["throughput"] > 0 and last["time"] > 0 and last["peak_mem"] > 0
    assert result.stdout.count("[CONFIG]") == 1  # rank 0 alone prints
    config = config_in(result.stdout)
    assert config["rendezvous"].startswith(("127.0.0.1:", "localhost:"))
    assert config["threads"] >= 1
    assert "gpu_memory" not in config  # a CPU's memory is no GPU's to project onto


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_config_and_metric_read_every_field_they_share_alike(strategy):
    """DDP's [CONFIG] once said sharding=full microbatches=None (--sharding's default, unused)
    where its [METRIC] said sharding=replicate microbatches=na; FSDP at one rank falls back to
    no_shard (a 1-GPU FSDP baseline is DDP-like), and says so. The state predicted
    (cost_model, in both lines) is the state measured, to the byte; the time breakdown adds
    up."""
    done = run_main([*QUICK, "--epochs", "1", "--strategy", strategy])
    config, (metric,) = config_in(done.stdout), metrics_in(done.stdout)
    assert metric["sharding"] == {"ddp": "replicate", "fsdp": "no_shard"}[strategy]
    assert_breakdown_holds(metric)
    shared = sorted(set(config) & set(metric))
    assert {"sharding", "microbatches", "strategy", "world_size", "state_pred"} <= set(shared)
    assert [config[k] for k in shared] == [metric[k] for k in shared], shared
    assert metric["state_pred"] == metric["state_mem"], metric


@pytest.mark.parametrize("strategy, precision", [("fsdp", "fp32"), ("fsdp2", "bf16")])
def test_fsdp_full_holds_half_the_state_of_ddp_per_rank(strategy, precision):
    """Half of DDP's state a rank (cost_model's, which DDP's measured state is: the test
    above), and the same in bf16: the shards, their gradients and Adam's state stay fp32. Read
    when training ends: validation's forward leaves FSDP2's root unsharded (bf16 once read
    4,380,984 bytes for 4,428,152). Each line's state_pred (cost_model) is its state_mem."""
    args = ["--strategy", strategy, "--precision", precision, "--epochs", "1", *QUICK]
    result = main_on_ranks(args, 2)[0]
    assert result.returncode == 0, result.stderr[-3000:]
    metric = metrics_in(result.stdout)[-1]
    assert metric["state_pred"] == metric["state_mem"], metric
    ddp = state_mem(Config(strategy="ddp"), meta_model("cnn"), 2)
    assert metric["state_mem"] / ddp == pytest.approx(0.5, abs=0.005), (metric["state_mem"], ddp)


def test_course_flag_names_are_accepted():
    result = run_main([*QUICK, "--method", "fsdp", "--batch_size", "32", "--epochs", "1"])
    assert result.returncode == 0, result.stderr[-2000:]
    metric = metrics_in(result.stdout)[0]
    assert (metric["strategy"], metric["global_batch"]) == ("fsdp", 32)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args,message,torchrun",
    [
        (["--batch-size", "63"], "must be a multiple of the world size 2", False),
        (["--train-samples", "32"], "make no full global batch", False),
        (["--epochs", "0"], "--epochs must be at least 1", True),
    ],
)
def test_bad_input_on_two_ranks_is_one_line_from_rank_0(args, message, torchrun):
    """Found before torch loads (--epochs 0) or once the world size (--batch-size 63) or the
    data (--train-samples 32) is known: one line, from rank 0 alone. Under torchrun where
    rank 1 waits for its launcher to end it (found before the ranks met; torchrun's report of
    a failed rank is the same whatever failed it), else ranks started directly."""
    result = (
        run_main([*QUICK, *args], nproc=2) if torchrun else main_on_ranks([*QUICK, *args], 2)[0]
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    # torchrun reports a failed child with a traceback of its own launcher; none may come
    # from the training program.
    assert not re.search(rf'File "{re.escape(str(REPO))}/\w+\.py"', result.stderr)


def catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_a_rank_other_than_0_with_a_bad_command_line_outlives_rank_0_until_ended():
    """Rank 1 says nothing and waits (main.PEER_EXIT_WAIT_S at most) for its launcher's SIGTERM,
    sent once rank 0 has exited with the error: exiting first, it would get rank 0 killed
    before rank 0 said why. (Errors found after the ranks met end every rank at once:
    test_faults.py's one-line checkpoint errors.)"""
    rank1 = popen(
        [sys.executable, "main.py", *QUICK, "--epochs", "0"],
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
    )
    try:
        # Signalled only once it catches SIGTERM (/proc's SigCgt mask), as it would be when
        # rank 0 exits; still alive a second later.
        deadline = time.monotonic() + 60
        while (
            rank1.poll() is None and not catches_sigterm(rank1.pid) and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        time.sleep(1)
        assert rank1.poll() is None, "rank 1 exited before its launcher ended it"
        rank1.send_signal(signal.SIGTERM)
        out, err = rank1.communicate(timeout=30)
    finally:
        rank1.kill()
    assert (rank1.returncode, out, err) == (EXIT_STATUS["usage"], "", "")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lr", "nan"], "--lr must be a positive number, got nan"),
        (["--lr", "inf"], "--lr must be a positive number, got inf"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--pg-timeout", "0"], "--pg-timeout must be a positive number"),
        (["--num-workers", "-1"], "--num-workers must be at least 0"),
        (["--val-samples", "0"], "--val-samples must be at least 1"),
    ],
)
def test_numbers_no_run_can_use_are_refused(args, message):
    assert_one_line_error(run_main([*QUICK, *args]), message)


@pytest.mark.parametrize(
    "args",
    [["--strategy", "zero"], ["--precision", "fp8"], ["--sharding", "none"], ["--epochs", "two"]],
)
def test_unknown_choices_are_refused(args):
    result = run_main([*QUICK, *args])
    assert result.returncode == 2 and "invalid" in result.stderr
    assert "Traceback" not in result.stderr


# main.py as `python main.py ARGS` runs it, then whether torch was loaded by the time it ended.
RUN_MAIN_THEN_ASK_FOR_TORCH = """
import runpy, sys
sys.argv = ["main.py", *sys.argv[1:]]
try:
    runpy.run_path("main.py", run_name="__main__")
except SystemExit as e:
    status = e.code
print("torch loaded:", "torch" in sys.modules)
sys.exit(status)
"""


def test_a_mistyped_option_is_answered_before_torch_loads_with_what_was_meant():
    done = run([sys.executable, "-c", RUN_MAIN_THEN_ASK_FOR_TORCH, "--stratgy", "ddp"])
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[-1] == "error: unrecognized option --stratgy; did you mean --strategy?", lines
    assert len(lines) <= 2 and all(line.startswith("usage:") for line in lines[:-1]), lines
    assert "torch loaded: False" in done.stdout
    unlike = run([sys.executable, "main.py", "--frobnicate"]).stderr.splitlines()[-1]
    assert unlike == "error: unrecognized option --frobnicate", unlike  # nothing is close


@pytest.mark.parametrize("option", ["--gpus", "--nproc_per_node", "--nodes", "--ntasks-per-node"])
def test_a_rank_count_option_says_the_launcher_sets_it(option):
    done = run_main([option, "4", *QUICK], timeout=60)
    line = assert_one_line_error(
        done,
        f"main.py has no {option}",
        "the launcher sets the number of ranks",
        "torchrun --nproc_per_node",
        "srun/sbatch --ntasks",
        "python run_benchmarks.py --gpus",
    )
    assert done.stderr.splitlines()[-1] == line


def test_the_modules_that_read_the_options_load_no_torch():
    """main.py parses before torch loads: what it imports first, and config.py that the sweep
    tool reads on a login node, import no torch."""
    code = (
        "import sys, config, utils, stopping, main, run_benchmarks; "
        "print(sorted(m for m in ('torch', 'numpy', 'pandas') if m in sys.modules))"
    )
    done = run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_unwritable_checkpoint_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # root ignores permission bits: use a file as parent
    result, _ = main_on_ranks([*ONE_EPOCH, "--checkpoint-dir", str(blocker / "ckpt")], 2)
    assert_one_line_error(result, "is not writable", "choose another with --checkpoint-dir")


def test_what_cannot_run_here_is_refused_for_its_first_reason(monkeypatch):
    """feasibility.refusal, which --check and every rank ask: the world's reasons (at each world
    size, in the order asked) before the device's, the device's precision before its options,
    and those before --cuda-graphs."""
    import torch

    from config import Config
    from feasibility import refusal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    bf16 = Config(precision="bf16", batch_size=64)
    assert refusal(bf16, [1, 2], 64, gpu) == (
        "bf16 is not supported on Tesla V100; use --precision fp16 or fp32"
    )
    assert refusal(bf16, [1, 3], 32, gpu) == "32 training images make no full global batch of 64"
    assert refusal(bf16, [3, 1], 32, gpu).startswith("global batch size 64 must be a multiple")
    offload = Config(strategy="fsdp", cpu_offload=True, cuda_graphs=True, batch_size=64)
    assert refusal(offload, [2], 64, cpu).startswith("--cpu-offload moves FSDP's shards")
    graphs = Config(cuda_graphs=True, batch_size=64)
    assert refusal(graphs, [2], 64, cpu).startswith("--cuda-graphs: a CUDA graph records")
    assert refusal(Config(batch_size=64), [1, 2, 4], 64, cpu) is None


def test_offline_first_run_says_how_to_run_without_the_download(tmp_path):
    """No internet: the one line names both ways out, fetching elsewhere and synthetic data."""
    result = run_main(
        ["--data-dir", str(tmp_path), "--epochs", "1"], PYTHONPATH=str(REPO / "tests" / "offline")
    )
    line = assert_one_line_error(
        result, "downloading CIFAR-10", "--dataset synthetic", "python data.py --download"
    )
    assert "no route to host" in line.lower()
    fetch = run(
        [sys.executable, "data.py", "--download", "--data-dir", tmp_path],
        PYTHONPATH=str(REPO / "tests" / "offline"),
    )
    line = assert_one_line_error(fetch, "downloading CIFAR-10", "--dataset synthetic")
    assert "python data.py --download" not in line  # it would tell you to run itself


MISMATCHED_TORCHVISION = str(REPO / "tests" / "mismatched-torchvision")


def install_check() -> list[str]:
    """The Makefile's last step of an install: main.py's arguments."""
    makefile = (REPO / "Makefile").read_text()
    (command,) = re.findall(r"^INSTALL_CHECK := main\.py (.*?) >/dev/null$", makefile, re.M)
    return command.split()


def test_a_torchvision_built_for_another_torch_is_named_not_the_network(tmp_path):
    """A torchvision from another package index than torch's installs without a word and fails
    at import. make install's check (a ResNet's), the classic loader and a download (checked
    and run) each end with one line that names it, not the network: every place that loads it
    (utils.require_torchvision's callers), on --check's path and on a run's."""
    for args in (
        install_check(),
        [*QUICK, "--loader", "classic"],
        ["--data-dir", str(tmp_path), "--check"],
        ["--data-dir", str(tmp_path), "--epochs", "1"],
    ):
        done = run_main(args, PYTHONPATH=MISMATCHED_TORCHVISION)
        line = assert_one_line_error(
            done, "needs torchvision, which fails to load", "nms does not exist", "package index"
        )
        assert "internet" not in line, args


# ----------------------------------------------------------------------------- --check


def test_check_validates_every_world_size_without_training():
    done = run_main(["--check", "1", "2", "4", *BATCH_64], timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("check: ok: strategy=ddp world sizes 1 2 4")
    assert "[CONFIG]" not in done.stdout and "[METRIC]" not in done.stdout
    bad = run_main(["--check", "1", "2", "3", *BATCH_64], timeout=60)
    assert_one_line_error(bad, "global batch size 64 must be a multiple of the world size 3")


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--dataset", "cifar10", "--no-download", "--data-dir", "{tmp}/none"],
            "CIFAR-10 not found in",
        ),
        (["--train-samples", "32", "--batch-size", "64"], "make no full global batch of 64"),
        (["--resume", "{tmp}/none"], "no checkpoint there"),
        (["--lr", "0"], "--lr must be a positive number"),
    ],
)
def test_check_finds_what_the_run_would_fail_on(tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert_one_line_error(run_main(["--check", *TINY, *args], timeout=60), message)


def test_an_earlier_runs_checkpoint_is_refused_where_it_does_not_fit(tmp_path):
    """One DDP run of one epoch: its save line says where training resumes (the checkpoint after
    epoch 1 is named for epoch 2). Then, each in one line (the bad-input table's), a fresh run
    into its folder is refused, and so is resuming it with FSDP, by --check (which reads the
    checkpoint's meta.pt; named by its folder or found by auto) as by the run."""
    done = run_main([*ONE_EPOCH, "--checkpoint-dir", tmp_path])
    saved = f"[CHECKPOINT] saved {tmp_path}/ckpt_e0002_s000000 (after epoch 1: resumes at epoch 2)"
    assert saved in done.stdout.splitlines(), done.stdout[-2000:]
    args = [*BATCH_64, "--epochs", "2", "--checkpoint-dir", tmp_path]
    another = f"checkpoint {tmp_path}/ckpt_e0002_s000000 was written by strategy=ddp"
    for resume in (["--resume", tmp_path], ["--resume", "auto"]):
        check = run_main(["--check", "1", "2", *args, "--strategy", "fsdp", *resume])
        assert_one_line_error(check, another)
    earlier = "already holds checkpoints of an earlier run: continue it with --resume auto"
    assert_one_line_error(run_main(args), earlier)
    assert_one_line_error(run_main([*args, "--strategy", "fsdp", "--resume", "auto"]), another)


def test_check_takes_the_launchers_world_size():
    done = run_main(["--check", *BATCH_64], timeout=60, RANK="0", LOCAL_RANK="0", WORLD_SIZE="3")
    assert_one_line_error(done, "multiple of the world size 3")


# ----------------------------------------------------------------------------- --help


def test_help_explains_every_option():
    parser = main.build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[0]
        assert action.help and len(action.help.split()) >= 3, f"{flag} has no real help"
        assert action.help.count("default") <= 1, f"{flag} states its default twice"
    text = run_main(["--help"]).stdout
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "exit status: 0 finished" in text


# ----------------------------------------------------------------------------- stop and resume


def test_stopped_run_exits_3_and_prints_the_command_that_resumes_it(repo_copy):
    """SIGUSR1 from outside: checkpoint, exit status 3, and a continue command that works (run
    to the end of epoch 1 here: test_resume's resumed runs go on to the run's end)."""
    stopped = stop_at_first_progress(LONG_RUN, repo_copy)
    out, err = stopped.stdout, stopped.stderr
    assert stopped.returncode == 3, err[-2000:]
    stop = next(line for line in out.splitlines() if "stopped on SIGUSR1" in line)
    command = stop.split("continue with: ", 1)[1]
    assert command.startswith("main.py ") and "--resume checkpoints/local-" in command
    resumed = run([sys.executable, *command.split(), "--epochs", "1"], cwd=repo_copy, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "[CHECKPOINT] resumed from checkpoints/local-" in resumed.stdout
    assert [m["epoch"] for m in metrics_in(resumed.stdout)] == [1]


# main.py as its script, slowed where a stop's end races: rank 0 prunes the old checkpoints for
# 3 s (srun --kill-on-bad-exit would end it mid-prune if rank 1 left first), and rank 1 takes 3 s
# to leave the interpreter once main() has returned (as torch's teardown may); each writes down
# when it did.
SLOW_STOP = """
import atexit, os, runpy, time
import checkpoint
rank = os.environ["RANK"]
prune = checkpoint.prune
def slow_prune(*args, **kwargs):
    if rank == "0":
        time.sleep(3)
        open("pruned", "w").write(repr(time.time()))
    return prune(*args, **kwargs)
checkpoint.prune = slow_prune
if rank == "1":
    atexit.register(time.sleep, 3)
atexit.register(lambda: open(f"exit_rank{rank}", "w").write(repr(time.time())))
runpy.run_path("main.py", run_name="__main__")
"""


def test_a_signal_to_one_rank_stops_both_and_none_leaves_before_rank_0_is_done(repo_copy):
    """SLURM's warning (SIGUSR1) to rank 1 alone, the ranks started directly: both agree on a
    step, save one checkpoint mid-epoch and exit 3 (resuming it: test_resume's mid-epoch stops;
    the printed command: test_stopped_run_exits_3_...). Under srun --kill-on-bad-exit the first
    rank to exit non-zero ends the others: rank 1 leaves only once rank 0 has pruned the old
    checkpoints and printed how to continue; and srun's (or torchrun's) SIGTERM to a rank still
    on its way out is one more stop: it exits 3 too."""
    (repo_copy / "slow_stop_main.py").write_text(SLOW_STOP)
    args = [*LONG_RUN, "--checkpoint-dir", str(repo_copy / "ckpt"), "--pg-timeout", "60"]
    ranks = start_ranks(args, 2, cwd=repo_copy, program="slow_stop_main.py")
    try:
        wait_for_training(ranks[0])
        ranks[1].send_signal(signal.SIGUSR1)
        out, err = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode == 3, err[-2000:]
        while ranks[1].poll() is None:  # what srun does, until rank 1 is gone
            ranks[1].send_signal(signal.SIGTERM)
            time.sleep(0.1)
    finally:
        for rank in ranks:
            rank.kill()
    assert ranks[1].returncode == 3, ranks[1].stderr.read()[-2000:]
    assert "stopped on a signal to another rank at epoch 1 step" in out
    assert "continue with: main.py" in out
    pruned = float((repo_copy / "pruned").read_text())
    assert float((repo_copy / "exit_rank1").read_text()) >= pruned
    assert_stopped_mid_epoch_1(repo_copy / "ckpt")


def test_a_resume_from_nowhere_is_refused_before_anything_is_made(tmp_path):
    """A mistyped --resume PATH: the one line --check gives, and no folder made at PATH (where
    the run's checkpoints would have gone)."""
    missing = tmp_path / "does-not-exist"
    done = run_main([*ONE_EPOCH, "--resume", missing])
    assert_one_line_error(done, f"--resume {missing}: no checkpoint there")
    assert not missing.exists()


# ----------------------------------------------------------------------------- Ctrl-C


def interrupted_at_first_progress(command: list, cwd: Path) -> subprocess.CompletedProcess:
    """command started as a terminal starts it (a process group of its own) and sent SIGINT as
    Ctrl-C sends it, to the whole group, once training is under way; it runs to its end."""
    proc = subprocess.Popen(
        [str(c) for c in command],
        cwd=cwd,
        env=clean_environment(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("epoch 1 step"):
                os.killpg(proc.pid, signal.SIGINT)
                break
        out, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(seen) + out)


CTRL_C_LAUNCHERS = {
    "python": [sys.executable, "main.py"],
    "torchrun": [*TORCHRUN, "--nproc_per_node=2", "main.py"],
    "run.sh": ["bash", "run.sh"],  # torchrun's 2 ranks, as make run starts them
}


@pytest.mark.parametrize("launcher", CTRL_C_LAUNCHERS)
def test_ctrl_c_stops_every_rank_with_a_checkpoint_as_sigterm_does(repo_copy, launcher):
    """SIGINT to the terminal's whole process group: the ranks stop together with a checkpoint,
    say so once, and exit 3, no KeyboardInterrupt. Under torchrun a rank may get a second
    SIGINT within milliseconds, torchrun's own passed on (where Python has not yet run the
    handler, the two are one): the same Ctrl-C, not the one that ends at once (the rule itself:
    the test below). torchrun then ends with its own report (exit 1); run.sh keeps it out."""
    folder = repo_copy / "ckpt"
    done = interrupted_at_first_progress(
        [*CTRL_C_LAUNCHERS[launcher], *LONG_RUN, "--checkpoint-dir", folder], repo_copy
    )
    out = done.stdout
    assert out.count("[STOP] Ctrl-C: every rank stops") == 1, out[-3000:]
    assert "stopped on SIGINT at epoch 1 step" in out, out[-3000:]
    assert "[STOP] Ctrl-C again: ending now" not in out, out[-3000:]
    assert "KeyboardInterrupt" not in out, out[-3000:]
    assert_stopped_mid_epoch_1(folder)
    if launcher != "torchrun":
        assert done.returncode == EXIT_STATUS["stopped"], out[-3000:]
        assert "Traceback" not in out, out[-3000:]


@pytest.mark.fast
def test_a_second_ctrl_c_ends_at_once_but_the_same_one_passed_on_does_not():
    """Two SIGINTs within stopping.INTERRUPT_AGAIN_S are one Ctrl-C (a launcher passing the
    terminal's on); one after it ends the process by SIGINT, saying so, without waiting."""
    code = """
import os, signal, time
import stopping
stopping.take_stop_signals()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.1)
print("after the same Ctrl-C twice:", stopping.stop_signal(), flush=True)
time.sleep(stopping.INTERRUPT_AGAIN_S)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
print("still running")
"""
    done = run([sys.executable, "-c", code], timeout=20)
    assert "after the same Ctrl-C twice: SIGINT" in done.stdout, done.stderr[-2000:]
    assert done.stdout.count("[STOP] Ctrl-C: every rank stops") == 1
    assert "[STOP] Ctrl-C again: ending now, without a checkpoint" in done.stdout
    assert "still running" not in done.stdout and done.returncode == -signal.SIGINT
    assert "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- the user's view


def corrupt_cifar_dir(tmp_path) -> list[str]:
    from helpers import write_cifar_dir

    folder = write_cifar_dir(tmp_path / "data")
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    return ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data")]


def missing_cifar_dir(tmp_path) -> list[str]:
    return ["--dataset", "cifar10", "--no-download", "--data-dir", str(tmp_path / "none")]


@pytest.mark.parametrize(
    "setup,message",
    [
        (corrupt_cifar_dir, "data_batch_3 is not a CIFAR-10 python batch"),
        (missing_cifar_dir, "CIFAR-10 not found in"),
        (lambda tmp_path: ["--strategy", "fsdp", "--cpu-offload"], "--cpu-offload moves"),
    ],
)
def test_bad_input_table_as_the_user_sees_it(tmp_path, setup, message):
    """Each row of the bad-input table (docs/troubleshooting.md): one `error:` line, exit
    status 2, no traceback."""
    args = setup(tmp_path)
    assert_one_line_error(run_main([*BATCH_64, "--epochs", "2", *args]), message)
