"""collect_results.py: the course's real log and the project's logs parse; bad logs are named
and skipped without leaking into other runs; the summary's arithmetic; the CLI's errors."""

import os
from pathlib import Path

import pandas as pd
import pytest

import collect_results
import results_summary
import utils
from conftest import call_main
from helpers import COURSE_LOGS, GPU_CSV, log_text, metric_fields, run_log, runs_frame, write_log
from utils import format_comm, format_metric

pytestmark = pytest.mark.fast  # make test-fast

COURSE_LOG = "ddp_4gpu_15epochs.train.log"


def collect(folder: Path) -> tuple[pd.DataFrame, list[str]]:
    reports = []
    runs = collect_results.collect([folder], reports.append)
    return collect_results.results_frame(runs), reports


def skip_reason(reports: list[str], name: str) -> str:
    found = [r for r in reports if r.startswith("skipped ") and f"/{name}: " in r]
    assert found, f"{name} not reported as skipped in {reports}"
    return found[0]


# ---- the course's real log ----


def test_course_log_parses_and_sums_up():
    results, reports = collect(COURSE_LOGS)
    run = results[results["log"] == COURSE_LOG].set_index("epoch")
    assert list(run.index) == list(range(1, 16))
    assert set(run["strategy"]) == {"ddp"} and set(run["gpus"]) == {4}
    assert run.loc[1, ["time", "val_loss", "acc", "peak_mem"]].tolist() == [4.09, 1.4294, 47.07, 91]
    assert run.loc[15, ["time", "val_loss", "acc"]].tolist() == [2.20, 0.9722, 71.88]
    # The other fixtures hold no metric lines: named, skipped, not fatal.
    assert "no [METRIC] lines" in skip_reason(reports, "fsdp_1gpu.err")
    assert set(results["log"]) == {COURSE_LOG}
    row = results_summary.summarize(results).iloc[0]
    assert (row["strategy"], row["gpus"], row["epochs"]) == ("ddp", 4, 15)
    assert row["time"] == pytest.approx(2.20)  # epoch 1 (4.09 s, warm-up) left out
    assert (row["val_loss"], row["acc"], row["peak_mem"]) == (0.9722, 71.88, 91)
    assert pd.isna(row["speedup"])  # no 1-GPU run to compare with


# ---- the project's logs ----


def test_project_log_keeps_every_field(tmp_path):
    written = [
        metric_fields(e, strategy="fsdp", world_size=4, nodes=2, job_id="987") for e in (1, 2)
    ]
    write_log(tmp_path / "fsdp_4gpu_987.log", written)
    results, reports = collect(tmp_path)
    assert reports == []
    first = "sweep log model strategy gpus nodes job_id epoch time val_loss acc peak_mem"
    assert list(results.columns[:12]) == first.split()
    for fields, (_, row) in zip(written, results.iterrows()):
        for key, value in fields.items():
            assert row[key] == value, key
        assert (row["log"], row["gpus"]) == ("fsdp_4gpu_987.log", 4)


def test_identity_from_lines_wins_over_the_file_name_which_names_course_logs(tmp_path):
    run_log(tmp_path, "ddp_8gpu_1234.log", world_size=2)
    course_line = "0: \x1b[0m[METRIC] epoch={} time=3.00 val_loss=1.0000 acc=50.00 peak_mem=90MB\n"
    (tmp_path / "fsdp_2gpu_777.log").write_text("".join(course_line.format(e) for e in (1, 2)))
    (tmp_path / "mystery.log").write_text(course_line.format(1))
    results, reports = collect(tmp_path)
    assert set(results[results["strategy"] == "ddp"]["gpus"]) == {2}
    assert any("file name says gpus 8, metric lines say 2" in r for r in reports)
    course = results[results["log"] == "fsdp_2gpu_777.log"]
    assert course[["strategy", "gpus", "job_id"]].drop_duplicates().values.tolist() == [
        ["fsdp", 2, "777"]
    ]
    assert "unknown run" in skip_reason(reports, "mystery.log")


def test_repeated_epoch_keeps_the_last(tmp_path):
    # A preempted job, requeued into the same log (--open-mode=append), starts over.
    first = log_text([metric_fields(e) for e in (1, 2)], expected_epochs=3)
    preempted = "slurmstepd: error: *** JOB 1234 ON nid01 CANCELLED AT 12:00 DUE TO PREEMPTION\n"
    rerun = log_text([metric_fields(e, acc=60.0 + e) for e in (1, 2, 3)])
    (tmp_path / "ddp_1gpu_1234.log").write_text(first + preempted + rerun)
    results, reports = collect(tmp_path)
    assert results["epoch"].tolist() == [1, 2, 3]
    assert results["acc"].tolist() == [61.0, 62.0, 63.0]
    # The preemption came before the rerun's epochs: no crash to report.
    assert len(reports) == 1
    assert "epoch(s) 1, 2 logged more than once" in reports[0] and "kept the last" in reports[0]


# ---- bad logs: named, skipped, nothing leaks ----


def test_bad_logs_are_skipped_and_do_not_leak(tmp_path):
    # Sorted names put each bad file right after a good one: the course's collector carried
    # the previous file's line into the next.
    run_log(tmp_path, "a_good_ddp_1gpu.log", acc=11.0, strategy="ddp", world_size=1)
    (tmp_path / "b_no_metrics.log").write_text("[INFO] World size: 4\nsrun: job started\n")
    cut = format_metric(metric_fields(3, acc=33.0))
    write_log(
        tmp_path / "c_truncated.log",
        [metric_fields(e, acc=33.0) for e in (1, 2)],
        tail=cut[: len(cut) // 3],
    )  # killed mid-line
    (tmp_path / "d_garbage.bin").write_bytes(bytes(range(256)) * 4)
    write_log(
        tmp_path / "e_crashed.log",
        [metric_fields(1, acc=55.0)],
        expected_epochs=5,
        tail="Traceback (most recent call last):\nRuntimeError: NCCL timeout\n",
    )
    (tmp_path / "f_empty.log").write_bytes(b"")
    # Cut after the course fields: the course regex matches, but strategy and the rest are gone.
    line = format_metric(metric_fields(1))
    (tmp_path / "f_cut.log").write_text(line[: line.index("strategy=") + len("strategy=d")])
    run_log(tmp_path, "g_good_fsdp_2gpu.log", acc=22.0, strategy="fsdp", world_size=2)

    results, reports = collect(tmp_path)

    assert "no [METRIC] lines" in skip_reason(reports, "b_no_metrics.log")
    assert "truncated" in skip_reason(reports, "c_truncated.log")
    assert "binary" in skip_reason(reports, "d_garbage.bin")
    crashed = skip_reason(reports, "e_crashed.log")
    assert "stopped after epoch 1 of 5 (RuntimeError: NCCL timeout)" in crashed
    assert "empty" in skip_reason(reports, "f_empty.log")
    assert "truncated" in skip_reason(reports, "f_cut.log")
    by_log = results.groupby("log")
    assert set(by_log.groups) == {"a_good_ddp_1gpu.log", "g_good_fsdp_2gpu.log"}
    assert set(by_log.get_group("a_good_ddp_1gpu.log")["acc"]) == {11.0}
    assert set(by_log.get_group("g_good_fsdp_2gpu.log")["acc"]) == {22.0}
    assert by_log.size().tolist() == [3, 3]


def test_stderr_beside_a_log_reports_its_crash(tmp_path):
    run_log(tmp_path, "ddp_1gpu_1.log")
    (tmp_path / "ddp_1gpu_1.err").write_text("UserWarning: fine\n")
    course_line = "[METRIC] epoch=1 time=3.00 val_loss=1.0000 acc=50.00 peak_mem=90MB\n"
    (tmp_path / "ddp_2gpu_2.log").write_text(course_line)  # no [CONFIG]: length unknown
    (tmp_path / "ddp_2gpu_2.err").write_text("srun: error: nid01: task 1: Exited with code 1\n")
    results, reports = collect(tmp_path)
    assert "crashed after epoch 1 (srun: error:" in skip_reason(reports, "ddp_2gpu_2.log")
    assert set(results["log"]) == {"ddp_1gpu_1.log"}
    assert not any("ddp_1gpu_1.err" in r for r in reports)  # a run's stderr, not a run


# ---- summary ----


def test_speedup_and_efficiency():
    summary = results_summary.summarize(
        runs_frame(
            {
                ("ddp", 1): [30.0, 8.0, 7.0, 9.0],  # epoch 1 is warm-up: median(8, 7, 9)
                ("ddp", 4): [12.0, 2.0, 2.0, 2.5],
                ("ddp", 8): [12.0, 2.0, 2.0, 2.0],
                ("fsdp", 2): [9.0, 5.0],  # no 1-GPU fsdp run: no speedup
            }
        )
    ).set_index(["strategy", "gpus"])
    assert summary.loc[("ddp", 1), "time"] == 8.0
    assert summary.loc[("ddp", 4), ["speedup", "efficiency"]].tolist() == [4.0, 100.0]
    assert summary.loc[("ddp", 8), ["speedup", "efficiency"]].tolist() == [4.0, 50.0]
    assert (summary.loc[("ddp", 4), "val_loss"], summary.loc[("ddp", 4), "acc"]) == (0.25, 54.0)
    assert pd.isna(summary.loc[("fsdp", 2), "speedup"])

    table = results_summary.markdown_table(summary.reset_index())
    assert table.splitlines()[1].startswith("|---|--:|---|--:|---|")  # text left, numbers right
    ddp4 = next(line for line in table.splitlines() if line.startswith("| ddp | 4 |"))
    assert "| 2.00 |" in ddp4 and "| 4.00 | 100% |" in ddp4
    fsdp2 = next(line for line in table.splitlines() if line.startswith("| fsdp | 2 |"))
    assert fsdp2.endswith("| n/a | n/a | n/a |")  # no breakdown: no rest, of either kind


def test_what_differs_between_runs_is_joined_once_each_in_order():
    """report.md's context line spaces its `a / b`; the summary's cells are `a/b`."""
    results = runs_frame({("ddp", 1): [9.0], ("fsdp", 2): [9.0]}).assign(device=["cuda", "cpu"])
    assert results_summary.values(results, "device") == "cpu / cuda"
    assert results_summary.values(results, "no_such_column") is None
    assert results_summary.joined(pd.Series([2.0, 1.0, 2.0, None]), ",", "{:.0f}") == "1,2"


def test_one_epoch_run_uses_its_only_epoch_and_repeated_runs_take_medians():
    summary = results_summary.summarize(runs_frame({("ddp", 1): [6.0]}))
    assert summary.loc[0, "time"] == 6.0
    results = runs_frame({("ddp", 1): [9.0, 8.0]})
    again = results.assign(log="ddp_1gpu_again.log", time=[9.0, 10.0])
    summary = results_summary.summarize(pd.concat([results, again]))
    assert summary.loc[0, ["runs", "time", "time_min", "time_max"]].tolist() == [2, 9.0, 8.0, 10.0]
    assert "| 9.00 | 8.00-10.00 |" in results_summary.markdown_table(summary)


# ---- command line ----


def cli(capsys, *args) -> tuple[int, str, str]:
    return call_main(collect_results.main, capsys, *args)


@pytest.mark.parametrize("case", ["missing", "empty", "no_metrics"])
def test_cli_errors_are_one_line(tmp_path, capsys, case):
    logs = tmp_path / "logs"
    if case != "missing":
        logs.mkdir()
        (logs / ".gitkeep").touch()  # hidden files are not logs
    if case == "no_metrics":
        (logs / "ddp_1gpu_1.log").write_text("[INFO] nothing here\n")
    code, out, err = cli(capsys, "--logs", logs, "--out", tmp_path / "r.csv")
    assert code != 0 and out == ""
    assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "r.csv").exists()


def test_logs_of_a_local_run_alone_say_how_to_get_something_to_plot(tmp_path, capsys):
    """What `make run` leaves in logs/: its sampler's CSV and torchrun's folder, no run log
    (rank 0 prints to the terminal). The error says what to run first: the README's sweep."""
    logs = tmp_path / "logs"
    (logs / "torchrun" / "20261123-101500-42").mkdir(parents=True)
    (logs / "cpu_local-20261123-101500-42_host.csv").write_text("time_s,pid,cpu_s,rss_mb\n")
    code, out, err = cli(capsys, "--logs", logs, "--out", tmp_path / "r.csv")
    assert code != 0 and out == ""
    assert err.splitlines()[-1] == (
        f"error: no log files in {logs}: nothing to plot yet; run a sweep first, on this "
        "machine: python run_benchmarks.py --local --gpus 1 2 --epochs 3 -- --dataset "
        "synthetic --train-samples 2048 --val-samples 512 --no-checkpoint (README.md, From "
        "the quickstart to a study); on SLURM: python run_benchmarks.py, or sbatch run.sh"
    )


def test_cli_writes_csv_and_prints_summary(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    run_log(logs, "ddp_1gpu_1.log", world_size=1, time=8.0)
    run_log(logs, "ddp_4gpu_2.log", world_size=4, time=2.0)
    out_csv = tmp_path / "out" / "results.csv"
    code, out, err = cli(capsys, "--logs", logs, "--out", out_csv)
    assert code == 0
    assert len(pd.read_csv(out_csv)) == 6
    assert [p.name for p in out_csv.parent.iterdir()] == ["results.csv"]  # no temp file left
    assert "| ddp | 4 | 1 | 1 | n/a | 3 |" in out and "| 4.00 | 100% |" in out
    assert "wrote" in err


def test_csv_write_is_atomic_and_an_unwritable_one_one_line(tmp_path, capsys):
    target = tmp_path / "results.csv"
    target.write_text("old\n")

    def crash(temp: Path) -> None:
        temp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        utils.write_atomically(target, crash)
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["results.csv"]
    logs = tmp_path / "logs"
    logs.mkdir()
    run_log(logs, "ddp_1gpu_1.log", epochs=1)
    blocker = tmp_path / "a_file"  # root ignores permission bits: a file as parent folder
    blocker.write_text("x")
    code, _, err = cli(capsys, "--logs", logs, "--out", blocker / "r.csv")
    assert code != 0 and err.splitlines()[-1].startswith("error: cannot write")


# ---- sweeps ----


def sweep(logs: Path, name: str, time_1gpu: float) -> Path:
    folder = logs / f"sweep-{name}"
    folder.mkdir(parents=True)
    run_log(folder, "ddp_1gpu_1.log", world_size=1, time=time_1gpu)
    return folder


def test_the_newest_sweep_is_read_unless_all_are_asked_for(tmp_path, capsys):
    """Two sweeps of the same configuration never mix silently: by default the newest alone,
    with --all-sweeps both, with a warning that the configuration's median mixes them."""
    logs = tmp_path / "logs"
    sweep(logs, "20261122-100000", time_1gpu=11.5)
    sweep(logs, "20261122-120000", time_1gpu=2.5)
    (logs / "torchrun").mkdir()  # run.sh's torchrun reports: not a sweep
    out_csv = tmp_path / "r.csv"
    code, out, err = cli(capsys, "--logs", logs, "--out", out_csv)
    assert code == 0, err
    assert f"reading {logs / 'sweep-20261122-120000'}, the newest of 2" in err
    results = pd.read_csv(out_csv, dtype={"sweep": str})
    assert set(results["sweep"]) == {"20261122-120000"} and set(results["time"]) == {2.5}
    assert "warning" not in err

    code, out, err = cli(capsys, "--logs", logs, "--all-sweeps", "--out", out_csv)
    assert code == 0, err
    assert "merging 2 folders" in err
    assert (
        "warning: cnn ddp on 1 GPU(s) has runs from 2 sweeps (20261122-100000, 20261122-120000)"
        in err
    )
    results = pd.read_csv(out_csv, dtype={"sweep": str})
    assert sorted(set(results["sweep"])) == ["20261122-100000", "20261122-120000"]


def test_a_job_stopped_and_requeued_is_no_crash(tmp_path):
    """A job warned before its time limit saves, exits 3 (srun reports it in the .err), is
    requeued and finishes in the same log: a complete run, each epoch once."""
    first = [metric_fields(1)]
    log = write_log(tmp_path / "ddp_1gpu_77.log", first, expected_epochs=2)
    with open(log, "a") as f:
        f.write(log_text([metric_fields(2)], expected_epochs=2))
    (tmp_path / "ddp_1gpu_77.err").write_text(
        "srun: error: node1: tasks 0-1: Exited with exit code 3\n"
    )
    results, reports = collect(tmp_path)
    assert list(results["epoch"]) == [1, 2], reports
    assert not any("fail" in r or "skipped" in r for r in reports), reports


def test_gpu_samples_stand_next_to_their_runs(tmp_path, capsys):
    """run.sh's sampler CSVs in the logs' folder: per GPU, with the run's strategy, GPU count
    and in-process peak_mem, in gpu_samples.csv and a table after the summary."""
    run_log(tmp_path, "ddp_2gpu_4242.log", world_size=2, job_id="4242", peak_mem=84)
    run_log(tmp_path, "ddp_1gpu_4241.log", job_id="4241")
    (tmp_path / "gpu_4242_nid001.csv").write_text(GPU_CSV)
    (tmp_path / "cpu_4242_nid001.csv").write_text(
        "time_s,pid,cpu_s,rss_mb\n0.0,11,1.0,500.0\n5.0,11,6.0,600.0\n"
    )
    # They are samples.py's to read: neither read for metrics nor reported as skipped files.
    results, reports = collect(tmp_path)
    assert reports == [] and set(results["log"]) == {"ddp_2gpu_4242.log", "ddp_1gpu_4241.log"}
    out = tmp_path / "results.csv"
    assert collect_results.main(["--logs", str(tmp_path), "--out", str(out)]) == 0
    gpus = pd.read_csv(tmp_path / "gpu_samples.csv")
    assert gpus[
        ["strategy", "gpus", "job_id", "gpu", "peak_mem", "peak_mem_mib", "mean_util_pct"]
    ].values.tolist() == [["ddp", 2, 4242, 0, 84, 1500, 80.0], ["ddp", 2, 4242, 1, 84, 1600, 70.0]]
    cpu = pd.read_csv(tmp_path / "cpu_samples.csv")
    assert cpu[["job_id", "pid", "mean_cpu_pct", "peak_rss_mb"]].values.tolist() == [
        [4242, 11, 100.0, 600.0]
    ]
    printed = capsys.readouterr().out
    assert "GPU memory and use (nvidia-smi" in printed
    assert "| ddp | 2 | 4242 | nid001 | 1 | 84 | 1600 |" in printed


def test_the_study_is_named_strong_or_weak_scaling():
    strong = runs_frame({("ddp", 1): [9.0], ("ddp", 2): [5.0]}).assign(
        global_batch=256, local_batch=[256, 128]
    )
    assert results_summary.scaling(strong) == (
        "strong scaling: global batch 256 at every GPU count"
    )
    weak = strong.assign(global_batch=[64, 128], local_batch=64)
    assert results_summary.scaling(weak) == "weak scaling: 64 images per GPU per step"
    mixed = strong.assign(global_batch=[64, 256], local_batch=[64, 128])
    assert results_summary.scaling(mixed) is None
    assert results_summary.scaling(strong.drop(columns="local_batch")) is None

    assert results_summary.context(weak) == "weak scaling: 64 images per GPU per step · 1 epochs"
    assert results_summary.context(strong) == "strong scaling: global batch 256 · 1 epochs"
    # Named after the ranks' device: a CPU sweep's once said "at every GPU count" above a table
    # of "CPU ranks".
    on_cpu, weak_on_cpu = strong.assign(device="cpu"), weak.assign(device="cpu")
    said = "strong scaling: global batch 256 at every CPU rank count"
    assert results_summary.scaling(on_cpu) == said
    assert results_summary.scaling(weak_on_cpu) == "weak scaling: 64 images per CPU rank per step"
    assert results_summary.rank_unit(on_cpu) == ("CPU rank", "CPU ranks")


# ---- [COMM] lines: comm.csv and the modelled communication time ----


def comm_line(op: str, label: str, time_us: float, world_size: int = 2) -> str:
    return format_comm(
        {
            "op": op,
            "label": label,
            "bytes": 1000,
            "world_size": world_size,
            "time_us": time_us,
            "algbw_gbps": 1.0,
            "busbw_gbps": 1.0,
        }
    )


def test_comm_lines_go_to_comm_csv_and_model_each_configuration(tmp_path, capsys):
    # 512 images per epoch at global batch 256: 2 steps per epoch.
    breakdown = dict(t_compute=1.5, t_data=0.25, t_comm=0.5, t_wait=0.25)  # logged before t_other
    two_steps = dict(world_size=2, train_images=512, **breakdown)
    ddp = [
        comm_line("all_reduce", "grad", 3500),
        comm_line("all_reduce", "bucket0", 1000),
        comm_line("all_reduce", "bucket1", 3000),
        comm_line("all_reduce", "sweep", 9e6),
    ]
    fsdp = [
        comm_line("all_gather", "unit_a", 1000),
        comm_line("reduce_scatter", "unit_a", 2000),
        comm_line("all_gather", "unit_root", 500),
        comm_line("reduce_scatter", "unit_root", 500),
    ]
    for name, strategy, lines in (
        ("ddp_2gpu_1.log", "ddp", ddp),
        ("fsdp_2gpu_2.log", "fsdp", fsdp),
    ):
        metrics = [
            metric_fields(
                e, strategy, sharding="full" if strategy == "fsdp" else "replicate", **two_steps
            )
            for e in (1, 2)
        ]
        (tmp_path / name).write_text("\n".join(lines) + "\n" + log_text(metrics))
    out = tmp_path / "out" / "results.csv"
    code, table, _ = cli(capsys, "--logs", tmp_path, "--out", out)
    assert code == 0
    comm = pd.read_csv(out.with_name("comm.csv"))
    assert list(comm.columns[:11]) == [
        *results_summary.RUN_COLUMNS,
        "op",
        "label",
        "bytes",
        "world_size",
    ]
    assert len(comm) == 8 and set(comm["strategy"]) == {"ddp", "fsdp"}
    # DDP: 2 steps x (1 + 3 ms) of buckets. FSDP, full sharding: 2 steps x (2 gathers x 1 ms of
    # unit_a + 1 gather x 0.5 ms of the root, kept from forward to backward, + 2.5 ms of
    # reduce-scatters).
    summary = results_summary.summarize(pd.read_csv(out), comm).set_index("strategy")
    assert summary.loc["ddp", "comm_model"] == pytest.approx(0.008)
    assert summary.loc["fsdp", "comm_model"] == pytest.approx(0.010)
    assert summary.loc["ddp", "t_comm"] == 0.5
    ddp_row = next(line for line in table.splitlines() if line.startswith("| ddp |"))
    assert ddp_row.endswith("| 0.500 | 0.008 | 0.000 |")  # two ranks: the rest is t_comm


def test_no_comm_lines_and_no_samples_no_side_files(tmp_path, capsys):
    run_log(tmp_path, "ddp_1gpu_1.log")
    out = tmp_path / "results.csv"
    out.with_name("comm.csv").write_text("stale\n")  # an older collection's
    code, printed, _ = cli(capsys, "--logs", tmp_path, "--out", out)
    assert code == 0 and "nvidia-smi" not in printed
    assert not out.with_name("comm.csv").exists() and not list(tmp_path.glob("*_samples.csv"))
    assert results_summary.summarize(pd.read_csv(out))["comm_model"].isna().all()


@pytest.mark.parametrize("cpus", [2, 4])
def test_ranks_that_outnumber_their_cores_are_said_so(tmp_path, capsys, cpus):
    """Four one-thread ranks on one node, as the [CONFIG] line says: on 2 cores they took turns
    (the collector warns, naming the configuration), on 4 they did not."""
    config = {"world_size": 4, "nodes": 1, "threads": 1, "cpus": cpus}
    (tmp_path / "ddp_4gpu_7.log").write_text(
        log_text([metric_fields(e, world_size=4) for e in (1, 2)], **config)
    )
    results, _ = collect(tmp_path)
    assert results["threads_per_core"].tolist() == [4 / cpus] * 2
    warning = results_summary.cores_outnumbered(results)
    if cpus == 2:
        assert warning.startswith(
            "warning: the ranks outnumbered the CPU cores of their node in ddp on 4 CPU ranks: "
        )
    else:
        assert warning is None
    code, _, err = cli(capsys, "--logs", tmp_path, "--out", tmp_path / "r.csv")
    assert code == 0 and (warning in err.splitlines() if warning else "warning" not in err)
    read_back = pd.read_csv(tmp_path / "r.csv")  # the CSV keeps what the plots need to say so
    assert results_summary.cores_outnumbered(read_back) == warning


# ---- a pipeline's runs ----


def test_pipeline_runs_scale_against_ddps_one_gpu_and_give_the_bubble_by_microbatches(tmp_path):
    """A pipeline has no 1-GPU run: its speedup is against DDP's 1-GPU time (the model on one
    GPU). Its bubble is tabled by stages and micro-batches; the other strategies have none."""
    na = dict(bubble="na", bubble_ideal="na", microbatches="na")
    run_log(tmp_path, "ddp_1gpu_1.log", time=8.0, **na)
    run_log(tmp_path, "ddp_2gpu_2.log", world_size=2, time=5.0, **na)
    for job, (m, measured, ideal) in enumerate([(4, 0.5, 0.2), (8, 0.25, 1 / 9)], 3):
        run_log(
            tmp_path,
            f"pipeline_2gpu_{job}.log",
            strategy="pipeline",
            world_size=2,
            time=4.0,
            bubble=measured,
            bubble_ideal=ideal,
            microbatches=m,
        )
    results, _ = collect(tmp_path)
    summary = results_summary.summarize(results).set_index(["strategy", "gpus"])
    assert summary.loc[("pipeline", 2), "speedup"] == 8.0 / 4.0
    assert summary.loc[("ddp", 2), "speedup"] == 8.0 / 5.0
    assert pd.isna(summary.loc[("ddp", 2), "bubble"])
    table = results_summary.bubble_table(results)
    assert table[["gpus", "microbatches", "runs"]].values.tolist() == [[2, 4, 1], [2, 8, 1]]
    assert table["bubble"].tolist() == [0.5, 0.25]
    assert table["bubble_ideal"].tolist() == pytest.approx([0.2, 1 / 9], rel=1e-5)
    text = results_summary.bubble_markdown(table)
    assert "| 2 | 8 | 1 | 0.250 | 0.111 |" in text.splitlines()


# ---- the time breakdown ----


def test_unreliable_epochs_are_left_out_of_the_breakdown_and_said_in_the_report(tmp_path):
    """An epoch whose compute calibration could not tell compute from the rest (breakdown=
    unreliable, t_compute and t_comm na) gives no parts: the point's parts come from its
    reliable epochs, all from the same ones, and report.md's sentence counts those left out; a
    point with none left says so."""

    ok = dict(t_compute=1.0, t_data=0.1, t_comm=0.3, t_wait=0.0, breakdown="ok")
    bad = dict(t_compute="na", t_data=0.1, t_comm="na", t_wait=0.0, breakdown="unreliable")
    epochs = [ok, {**ok, "t_compute": 1.2, "t_comm": 0.2}, bad]
    write_log(
        tmp_path / "ddp_1gpu_1.log",
        [metric_fields(e, job_id="1", **parts) for e, parts in enumerate(epochs, 1)],
    )
    write_log(
        tmp_path / "ddp_2gpu_2.log",
        [metric_fields(e, world_size=2, job_id="2", **bad) for e in (1, 2)],
    )
    results, _ = collect(tmp_path)
    summary = results_summary.summarize(results).set_index("gpus")
    one, two = summary.loc[1], summary.loc[2]
    assert (one["t_compute"], one["t_comm"], one["unreliable_epochs"]) == (1.2, 0.2, 1)
    assert pd.isna(two["t_compute"]) and two["unreliable_epochs"] == 1
    sentences = results_summary.largest_costs(summary.reset_index())
    assert "1 epoch(s) left out" in sentences[0] and "compute, 1.200 s" in sentences[0]
    assert "no reliable breakdown" in sentences[1], sentences


def test_the_breakdown_is_one_epochs_the_reliable_one_of_median_time(tmp_path):
    """A point's parts are those of one epoch, so that they add up to its time (medians taken
    part by part, each from another epoch, would not): of the reliable epochs after the first,
    the one of median time; report.md's shares are of that epoch."""

    def epoch(time: float, compute: float, breakdown: str = "ok") -> dict:
        parts = dict(t_compute=compute, t_data=0.0, t_comm=time - compute, t_wait=0.0)
        return dict(time=time, breakdown=breakdown, **parts, t_other=0.0)

    epochs = [epoch(9.0, 1.0), epoch(2.0, 1.5), epoch(3.0, 1.0), epoch(2.5, 2.0), epoch(1.0, 0.5)]
    epochs[-1]["breakdown"] = "unreliable"
    write_log(
        tmp_path / "ddp_2gpu_1.log",
        [metric_fields(e, world_size=2, **fields) for e, fields in enumerate(epochs, 1)],
    )
    results, _ = collect(tmp_path)
    summary = results_summary.summarize(results)
    row = summary.iloc[0]
    assert (row["t_compute"], row["t_comm"], row["unreliable_epochs"]) == (2.0, 0.5, 1)
    assert results_summary.largest_costs(summary)[0].startswith(
        "- ddp on 2 CPU ranks: the largest cost is compute, 2.000 s of 2.50 s per epoch (80%)"
    )


def test_a_one_rank_points_rest_is_unexplained_and_an_older_logs_still_adds_up(tmp_path):
    """One rank sends nothing: its rest is t_other, which report.md names as what the step's
    model does not explain, with no word of communication beside its modelled messages (none).
    A log written before t_other (its rest in t_comm at every world size) keeps parts that add
    up to its epoch: t_other 0."""

    alone = dict(t_compute=1.5, t_data=0.25, t_comm=0.0, t_wait=0.0, t_other=0.75)
    older = dict(t_compute=1.5, t_data=0.25, t_comm=0.75, t_wait=0.0)
    write_log(tmp_path / "ddp_1gpu_1.log", [metric_fields(e, job_id="1", **alone) for e in (1, 2)])
    write_log(
        tmp_path / "ddp_2gpu_2.log",
        [metric_fields(e, world_size=2, job_id="2", **older) for e in (1, 2)],
    )
    results, _ = collect(tmp_path)
    summary = results_summary.summarize(results).assign(comm_model=[0.0, 0.5])
    one, two = summary.set_index("gpus").loc[1], summary.set_index("gpus").loc[2]
    assert (one["t_comm"], one["t_other"], two["t_comm"], two["t_other"]) == (0, 0.75, 0.75, 0)
    for row in (one, two):
        assert sum(row[t] for t in utils.TIME_PARTS) == row["time"]
    sentences = results_summary.largest_costs(summary)
    assert sentences[0] == (
        "- ddp on 1 CPU rank: the largest cost is compute, 1.500 s of 2.50 s per epoch (60%); "
        "0.750 s (30%) the step's model does not explain."
    )
    assert "0.500 s at the measured bandwidth, against 0.750 s of communication" in sentences[1]


def test_each_point_says_whether_its_step_was_one_cuda_graph_and_a_mix_warns(tmp_path, capsys):
    """The [CONFIG] line's cuda_graphs: the table's step column per point, the figures' legend,
    and a warning where one strategy's points mix graphed and eager steps (two clocks)."""
    import plot_style

    for gpus, graphed in ((1, True), (2, False)):
        metrics = [metric_fields(e, world_size=gpus, job_id=str(gpus)) for e in (1, 2)]
        (tmp_path / f"ddp_{gpus}gpu_{gpus}.log").write_text(log_text(metrics, cuda_graphs=graphed))
    results, _ = collect(tmp_path)
    summary = results_summary.summarize(results).set_index("gpus")
    assert (summary.loc[1, "step"], summary.loc[2, "step"]) == ("graph", "eager")
    header, _, *rows = results_summary.markdown_table(summary.reset_index()).splitlines()
    assert "| step |" in header and "| graph |" in rows[0] and "| eager |" in rows[1], rows
    (warning,) = results_summary.mixed_steps(results)
    assert "ddp's points mix graphed and eager steps (eager at 2; graph at 1" in warning
    assert plot_style.step_mark(summary.reset_index()) == " (eager/CUDA graph)"


def test_gpu_busy_is_a_column_of_the_results_and_the_summary(tmp_path):
    """gpu_busy as logged: a number on a GPU, `na` (an empty cell) on a CPU; the summary takes
    the median after epoch 1, as the times, and its table shows it, n/a where unknown."""
    gpu = [
        metric_fields(e, device="cuda", job_id="1", gpu_busy=b)
        for e, b in [(1, 0.5), (2, 0.2), (3, 0.3)]
    ]
    write_log(tmp_path / "ddp_1gpu_1.log", gpu)
    write_log(
        tmp_path / "ddp_2gpu_2.log",
        [metric_fields(e, world_size=2, job_id="2", gpu_busy="na") for e in (1, 2)],
    )
    results, _ = collect(tmp_path)
    assert results["gpu_busy"].tolist()[:3] == [0.5, 0.2, 0.3]
    assert results["gpu_busy"].iloc[3:].isna().all()
    summary = results_summary.summarize(results).set_index("gpus")
    assert summary.loc[1, "gpu_busy"] == pytest.approx(0.25)
    assert pd.isna(summary.loc[2, "gpu_busy"])
    header, _, one, two = results_summary.markdown_table(summary.reset_index()).splitlines()
    column = header.split(" | ").index("GPU busy")
    assert (one.split(" | ")[column], two.split(" | ")[column]) == ("0.25", "n/a")


def test_a_runs_name_carries_its_model_and_still_its_job_id():
    """layout.configuration_name names a model other than the default; the name still gives the
    job id (SLURM's, or none for a local run's `local-<time>`, which is no model)."""
    import layout

    name = layout.configuration_name("ddp", 4, "cnn-wide")
    assert name == "ddp_4gpu_cnn-wide" and layout.configuration_name("ddp", 4) == "ddp_4gpu"
    said = layout.name_identity(layout.log_stem(name, "1234") + ".log")
    assert said == {"strategy": "ddp", "gpus": 4, "model": "cnn-wide", "job_id": "1234"}
    local = layout.name_identity(layout.log_stem(name, "local-20261127-100000") + ".log")
    assert local == {"strategy": "ddp", "gpus": 4, "model": "cnn-wide"}
    assert "model" not in layout.name_identity("ddp_4gpu_local-20261127-100000.log")


def test_each_run_gets_its_model_from_its_config_line_and_the_summary_keeps_them_apart(tmp_path):
    """Two models at the same strategy and GPU count: two rows, each its own speedup; a log
    without model= in its [CONFIG] line (older than the model axis) is the CNN, said so."""
    for model, gpus, time in (("cnn", 1, 4.0), ("cnn", 2, 2.0), ("cnn-wide", 1, 9.0)):
        metrics = [metric_fields(e, world_size=gpus, time=time) for e in (1, 2)]
        (tmp_path / f"ddp_{gpus}gpu_{model}.log").write_text(log_text(metrics, model=model))
    metrics = [metric_fields(e, world_size=2, time=3.0) for e in (1, 2)]
    old = log_text(metrics).replace(" model=cnn", "")
    (tmp_path / "ddp_2gpu_old.log").write_text(old)
    results, reports = collect(tmp_path)
    assert any("ddp_2gpu_old.log: no model in a [CONFIG] line: taken as cnn" in r for r in reports)
    summary = results_summary.summarize(results).set_index(["model", "gpus"])
    assert set(summary.index) == {("cnn", 1), ("cnn", 2), ("cnn-wide", 1)}
    assert summary.loc[("cnn", 2), "runs"] == 2  # the old log's run is the CNN's
    assert summary.loc[("cnn-wide", 1), "speedup"] == 1.0
    header = results_summary.markdown_table(summary.reset_index()).splitlines()[0]
    assert header.startswith("| model | strategy |")
