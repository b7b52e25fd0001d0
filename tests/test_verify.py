"""`run_benchmarks.py --verify` (verify.py), the cluster's acceptance test: its parsing and
refusals; its four checks end to end here (torchrun), on a tree with a planted bug (every rank
reads rank 0's shard) that equivalence must call a FAIL and the other checks must pass; on the
loopback SLURM cluster, where a sound tree passes all four: in test_slurm.py, with every test
of the cluster."""

import re
import sys

import pytest

import run_benchmarks
import verify
import verify_job
from conftest import assert_one_line_error, benchmarks, call_main, run

# The fake GPUs of the loopback cluster, and this machine: the CPU (gloo).
CPU = ["--device", "cpu"]

# ----------------------------------------------------------------------------- unit tests

NCCL_LOG = """\
node1:1:1 [0] NCCL INFO Using network IB
node1:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
node1:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC
node1:1:1 [0] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/IB/0/GDRDMA
node2:2:2 [0] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [receive] via NET/AWS Libfabric/0
node2:2:2 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[2] via SHM/direct/direct
"""


@pytest.mark.fast
def test_nccl_transports_are_read_from_nccl_debug_info():
    transports = verify.nccl_transports(NCCL_LOG)
    assert transports == ["network IB", "P2P/IPC", "NET/IB", "NET/AWS Libfabric", "SHM/direct"]
    assert not verify.over_sockets(transports)
    sockets = "x NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0\n"
    assert verify.over_sockets(verify.nccl_transports(sockets))
    assert verify.over_sockets(verify.nccl_transports("x NCCL INFO Using network Socket\n"))
    assert verify.nccl_transports("[COMM] op=all_reduce\n") == []


@pytest.mark.fast
def test_report_rows_read_back_as_written_and_a_fail_is_one_line():
    failed = "the benchmark ended with exit status 1"
    rows = [
        verify_job.Row("equivalence", True, "ddp 1e-08 | fsdp 2e-08", "logs/verify-7/a.log"),
        verify_job.Row("comm", False, failed, "logs/verify-7/c.log"),
    ]
    text = verify_job.report_text(rows, {"nodes": "node1 node2"}, [f"{verify_job.WARNING}sockets"])
    assert verify_job.read_rows(text) == rows
    assert verify_job.warning_lines(text) == [f"{verify_job.WARNING}sockets"]
    assert rows[1].error_line() == (
        "error: verify: comm failed: the benchmark ended with exit status 1; see "
        "logs/verify-7/c.log"
    )


@pytest.mark.fast
@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpus", "2", "4"], "--verify runs one job: give one --gpus count, not 2 4"),
        (["--strategies", "ddp"], "--strategies is the sweep's; --verify runs"),
        (["--repeats", "2"], "--repeats is the sweep's"),
        (["--scaling", "weak"], "--scaling is the sweep's"),
        (["--one-at-a-time"], "--one-at-a-time is the sweep's"),
        (["--", "--epochs", "3"], "--epochs after -- is chosen by verify in every run"),
        (["--", "--optim", "adam"], "--optim after -- is chosen by verify in every run"),
        (["--gpus", "3", "--gpus-per-node", "2"], "3 GPUs do not spread evenly over 2 nodes"),
        (["--gpus", "1"], "--verify needs at least 2 GPUs"),
        (["--", "--nodes", "2"], "--nodes after -- is no option of main.py: the job's size is"),
    ],
)
def test_verify_refuses_what_makes_no_sense_in_one_line(capsys, args, message):
    code, out, err = call_main(run_benchmarks.main, capsys, "--verify", "--dry-run", *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.fast
def test_verify_job_is_two_nodes_of_gpus_per_node_by_default(capsys):
    code, out, err = call_main(
        run_benchmarks.main, capsys, "--verify", "--dry-run", "--gpus-per-node", "2", "--", *CPU
    )
    assert code == 0, err
    assert "--nodes=2" in out and "--ntasks-per-node=2" in out and "--gpus-per-node=2" in out
    assert "verify.py -- --device cpu" in out
    assert "run.sh" not in out  # no requeueing batch shell: verify.py launches run.sh itself


@pytest.mark.fast
def test_verify_loads_no_torch_itself():
    """It runs on a login node's or batch node's Python; torch only in the jobs' (--max-diff)."""
    code = "import sys, verify; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    done = run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


# ----------------------------------------------------------------------------- end to end


def rows_of(report) -> dict:
    return {row.check: row for row in verify_job.read_rows(report.read_text())}


def share_rank_zeros_data(repo):
    """The planted bug: every rank reads rank 0's shard instead of its own."""
    data = repo / "data.py"
    text = data.read_text()
    right = "super().__init__(range(size), world_size, rank, "
    assert right in text
    data.write_text(text.replace(right, "super().__init__(range(size), world_size, 0, "))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_verify_fails_a_planted_bug_and_passes_the_rest(repo_copy):
    """`--verify --local` on a tree where every rank reads rank 0's shard: equivalence is a
    FAIL, with one error line; the three other checks, which the bug leaves alone (a run
    compared with itself, a kill, the collectives), pass: each check stands on its own. Every
    log in the report's folder. (A tree without the bug passes all four: test_slurm.py.)"""
    share_rank_zeros_data(repo_copy)
    done = benchmarks("--verify", "--local", "--gpus", "2", "--", *CPU, cwd=repo_copy, timeout=580)
    line = assert_one_line_error(done, "over tolerance", status=1)
    assert line.startswith("error: verify: equivalence failed: max abs param diff"), line
    checks = len(verify.CHECKS)
    assert f"\nverify: {checks - 1} of {checks} checks passed; failed: equivalence\nreport: " in (
        done.stdout
    )
    report = repo_copy / re.search(r"^report: (\S+)", done.stdout, re.M).group(1)
    rows = rows_of(report)
    assert list(rows) == list(verify.CHECKS)
    assert [check for check, row in rows.items() if not row.passed] == ["equivalence"]
    assert "no NCCL (gloo)" in rows["comm"].figure
    assert "rank 1 killed" in rows["killed-rank"].figure
    for row in rows.values():
        assert (repo_copy / row.log).parent == report.parent


@pytest.mark.fast
@pytest.mark.parametrize("env", [{"SLURM_JOB_ID": "7"}, {"NPROC": "1"}, {"NPROC": "two"}])
def test_verify_refuses_a_world_it_cannot_verify_in_one_line(capsys, monkeypatch, tmp_path, env):
    """Inside a job without SLURM_NTASKS (a job given no --ntasks) or with one rank here."""
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = call_main(verify.main, capsys, "--out", tmp_path / "report")
    assert code == 2 and err.startswith("error: verify runs 2 or more ranks, not "), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "report").exists()


@pytest.mark.fast
def test_verify_refuses_a_folder_an_earlier_verify_wrote(capsys, tmp_path):
    code, out, err = call_main(verify.main, capsys, "--out", tmp_path)
    assert code == 2 and err.strip() == (
        f"error: {tmp_path} exists: an earlier verify wrote there; choose another --out"
    ), err
