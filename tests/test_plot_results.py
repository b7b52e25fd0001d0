"""plot_results.py and plot_results.sh: every PNG from a small CSV, the course's CSV too; a bad
CSV is one line of error; the shell script runs collect then plot from any directory."""

import math
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb

import collect_results
import memory_figures
import plot_results
import results_summary
import utils
from conftest import REPO, call_main, clean_environment
from helpers import CNN_PARAMETERS, COURSE_LOGS, GPU_CSV, run_log, runs_frame
from utils import format_comm

pytestmark = pytest.mark.fast  # make test-fast

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The figures of a line per strategy, against the rank count on x.
LINE_PLOTS = ["epoch_time.png", "val_loss_acc.png", "peak_memory.png", "throughput.png"]
TWO_POINTS = {("ddp", 1): [9.0, 8.0], ("ddp", 2): [5.0, 4.0]}  # runs_frame's epoch times
course_csv = COURSE_LOGS / "results_solution.csv"


def cli(capsys, *args) -> tuple[int, str, str]:
    return call_main(plot_results.main, capsys, *args)


def assert_pngs(folder: Path, names) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)  # no temp files left
    for name in names:
        assert (folder / name).read_bytes().startswith(PNG_MAGIC), name


def with_breakdown(results: pd.DataFrame) -> pd.DataFrame:
    """The four parts of each epoch's time, as main.py logs them: they add up to `time`."""
    return results.assign(
        t_compute=results["time"] * 0.5,
        t_data=results["time"] * 0.1,
        t_comm=results["time"] * 0.3,
        t_wait=results["time"] * 0.1,
    )


def comm_frame(world_sizes=(1, 2)) -> pd.DataFrame:
    """comm.csv's rows: a sweep of three sizes for each op and world size."""
    rows = [
        {
            "sweep": "s",
            "log": f"ddp_{n}gpu.log",
            "strategy": "ddp",
            "gpus": n,
            "op": op,
            "label": "sweep",
            "bytes": size,
            "world_size": n,
            "time_us": size / 1e3,
            "algbw_gbps": 1.0,
            "busbw_gbps": 1.0 * (n - 1) / n,
        }
        for n in world_sizes
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for size in (4096, 16384, 65536)
    ]
    return pd.DataFrame(rows)


def with_bubble(results: pd.DataFrame) -> pd.DataFrame:
    """A pipeline's bubble, its textbook value and micro-batches (2 stages, m = 4), empty for
    the other strategies, as the collector writes them."""
    pipeline = results["strategy"] == "pipeline"
    return results.assign(
        bubble=results["time"].where(pipeline) / 10,
        bubble_ideal=pd.Series(0.2, index=results.index).where(pipeline),
        microbatches=pd.Series(4, index=results.index).where(pipeline),
    )


def append_comm_lines(log: Path) -> None:
    """The [COMM] lines --comm-benchmark adds to a 2-rank run's log: comm_frame's, as logged."""
    rows = comm_frame([2]).drop(columns=["sweep", "log", "strategy", "gpus"]).to_dict("records")
    with open(log, "a") as f:
        f.writelines(format_comm(row) + "\n" for row in rows)


def with_memory(results: pd.DataFrame) -> pd.DataFrame:
    """The state one rank keeps (16 bytes a parameter of the CNN, an N-th of it under FSDP),
    predicted as measured, and 64 KiB of activations per image of a rank's batch of 32."""
    state = 16 * CNN_PARAMETERS / results["gpus"].where(results["strategy"] == "fsdp", 1)
    return results.assign(
        state_mem=state,
        state_pred=state,
        parameters=CNN_PARAMETERS,
        act_per_image=2**16,
        local_batch=32,
        optimizer="adam",
        precision="fp32",
    )


def test_every_png_from_a_small_csv(tmp_path, capsys):
    csv = tmp_path / "results.csv"
    times = {
        ("ddp", 1): [9.0, 8.0],
        ("ddp", 2): [5.0, 4.0],
        ("fsdp", 1): [10.0, 9.0],
        ("fsdp", 2): [6.0, 5.0],
        ("pipeline", 2): [7.0, 6.0],
    }
    with_memory(with_bubble(with_breakdown(runs_frame(times)))).to_csv(csv, index=False)
    comm_frame().to_csv(tmp_path / "comm.csv", index=False)
    pd.DataFrame(
        {
            "job_id": "7",
            "strategy": "ddp",
            "gpus": 2,
            "host": "node1",
            "gpu": [0, 0],
            "seconds": [0.0, 5.0],
            "mem_mib": [1000, 1200],
            "util_pct": [50, 90],
        }
    ).to_csv(tmp_path / "gpu_timeline.csv", index=False)
    code, out, _ = cli(capsys, "--csv", csv, "--out-dir", tmp_path / "plots")
    assert code == 0
    assert_pngs(tmp_path / "plots", plot_results.FIGURES)
    assert out.split() == [str(tmp_path / "plots" / name) for name in plot_results.FIGURES]


def test_side_files_belong_to_their_results_file(tmp_path, capsys):
    """docs/results.md's OUT=old.csv beside results.csv: each results file has its own side CSVs
    (old_comm.csv, ...; results.csv keeps comm.csv), and plot_results reads its own alone. A
    figure of FIGURES that a CSV cannot support is removed from --out-dir: an earlier sweep's
    PNG of that name would pass for this one's. Other files there stay."""
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir()
    old.mkdir()
    run_log(new, "ddp_2gpu_2.log", world_size=2, job_id="2")  # no [COMM] lines, no samples
    run_log(old, "ddp_2gpu_1.log", world_size=2, job_id="1")
    append_comm_lines(old / "ddp_2gpu_1.log")
    (old / "gpu_1_node1.csv").write_text(GPU_CSV)
    assert collect_results.main(["--logs", str(old), "--out", str(tmp_path / "old.csv")]) == 0
    assert collect_results.main(["--logs", str(new), "--out", str(tmp_path / "results.csv")]) == 0
    assert collect_results.main(["--logs", str(old), "--out", str(tmp_path / "old.csv")]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.csv")) == [
        "old.csv",
        "old_comm.csv",
        "old_gpu_samples.csv",
        "old_gpu_timeline.csv",
        "results.csv",
    ]
    capsys.readouterr()
    plots = tmp_path / "p"
    plots.mkdir()
    for name in ("comm_bandwidth.png", "gpu_timeline.png", "mine.png", "notes.txt"):
        (plots / name).write_bytes(PNG_MAGIC)
    code, out, err = cli(capsys, "--csv", tmp_path / "results.csv", "--out-dir", plots, "--report")
    assert code == 0 and "not written comm_bandwidth.png: no [COMM] lines" in err
    assert "not written gpu_timeline.png" in err
    drawn = [Path(line).name for line in out.split()]
    assert "comm_bandwidth.png" not in drawn and "epoch_time.png" in drawn
    assert sorted(p.name for p in plots.iterdir()) == sorted(
        [*drawn, "report.md", "mine.png", "notes.txt"]
    )
    code, out, err = cli(capsys, "--csv", tmp_path / "old.csv", "--out-dir", tmp_path / "old_p")
    assert code == 0, err
    assert {"comm_bandwidth.png", "gpu_timeline.png"} <= {Path(line).name for line in out.split()}


def test_course_results_csv(tmp_path, capsys):
    # The course's shape: method (not strategy), final epoch only, no throughput.
    code, _, err = cli(capsys, "--csv", course_csv, "--out-dir", tmp_path)
    assert code == 0
    not_drawn = "throughput time_breakdown comm_bandwidth gpu_timeline pipeline_bubble"
    not_drawn += " bytes_per_parameter largest_model"
    assert_pngs(tmp_path, set(plot_results.FIGURES) - {f"{n}.png" for n in not_drawn.split()})
    assert "not written bytes_per_parameter.png: no parameters ([CONFIG] lines)" in err
    assert "not written largest_model.png: no state_mem, parameters, act_per_image" in err
    assert "not written gpu_timeline.png: no GPU samples" in err
    assert "not written pipeline_bubble.png: no pipeline runs (bubble)" in err
    assert "not written throughput.png" in err
    assert "not written comm_bandwidth.png: no [COMM] lines" in err
    summary = results_summary.summarize(plot_results.read_results(course_csv))
    ddp8 = summary.set_index(["strategy", "gpus"]).loc[("ddp", 8)]
    assert ddp8["speedup"] == pytest.approx(7.08 / 1.35)  # ddp,1,10,7.08 and ddp,8,10,1.35
    (ax,) = plot_results.plot_epoch_time(summary).axes  # epoch 10's time: not a median
    assert ax.get_title() == "Training time per epoch (the only epoch logged) vs ideal 1/N"


@pytest.mark.parametrize(
    "times, steady",
    [
        (TWO_POINTS, "median after epoch 1"),
        ({("ddp", 1): [9.0], ("ddp", 2): [5.0]}, "the only epoch logged"),
        (
            {("ddp", 1): [9.0, 8.0], ("ddp", 2): [5.0]},
            "median after epoch 1, or the only epoch logged",
        ),
    ],
)
def test_time_figures_say_how_an_epoch_time_was_taken(times, steady):
    summary = results_summary.summarize(runs_frame(times))
    epoch_time, throughput = (
        plot_results.plot_epoch_time(summary),
        plot_results.plot_throughput(summary),
    )
    assert epoch_time.axes[0].get_title() == f"Training time per epoch ({steady}) vs ideal 1/N"
    assert throughput.axes[0].get_title() == f"Training throughput ({steady}) vs ideal N x"
    plt.close("all")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"strategy,gpus,epoch,time,val_loss,acc,peak_mem\n", "no rows"),
        (b"a,b\n1,2\n", "no column strategy"),
        (
            b"strategy,gpus,epoch,time,val_loss,acc,peak_mem\nddp,four,1,2.0,1.0,50,90\n",
            "line 2: gpus is not a number",
        ),
        (bytes(range(256)) * 8, "results.csv"),
    ],
)
def test_bad_csv_is_one_line_error(tmp_path, capsys, content, message):
    csv = tmp_path / "results.csv"
    csv.write_bytes(content)
    code, out, err = cli(capsys, "--csv", csv, "--out-dir", tmp_path / "plots")
    assert code != 0 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "plots").exists()


def test_a_missing_csv_an_unwritable_folder_and_no_gpu_memory_size_are_one_line(tmp_path, capsys):
    code, _, err = cli(capsys, "--csv", tmp_path / "nope.csv")
    assert code != 0 and err.startswith("error: no results file")
    blocker = tmp_path / "a_file"  # root ignores permission bits: a file as parent folder
    blocker.write_text("x")
    csv = tmp_path / "results.csv"
    runs_frame(TWO_POINTS).to_csv(csv, index=False)
    code, _, err = cli(capsys, "--csv", csv, "--out-dir", blocker / "plots")
    assert code != 0 and err.strip().splitlines()[-1].startswith("error: cannot write")
    code, _, err = cli(capsys, "--csv", csv, "--gpu-memory", "0")
    assert code == 2 and err.strip() == "error: --gpu-memory must be a positive number of GB, got 0"


# ---- plot_results.sh ----


def run_script(cwd: Path, **env) -> subprocess.CompletedProcess:
    """plot_results.sh with the tests' Python (PYTHON), wherever the repository's .venv is."""
    environment = {k: v for k, v in clean_environment().items() if k != "DISPLAY"}  # no windows
    return subprocess.run(
        ["bash", str(REPO / "plot_results.sh")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, **env},
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_script_collects_then_plots_from_another_directory(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "ddp_1gpu_1.log").write_text("no metrics\n")  # all the script has, at first
    done = run_script(tmp_path, LOGS="logs", OUT="r.csv", PLOTS="plots")
    assert done.returncode != 0
    assert done.stderr.splitlines()[-1].startswith("error: ") and "Traceback" not in done.stderr
    assert not (tmp_path / "plots").exists()
    breakdown = dict(t_compute=1.5, t_data=0.25, t_comm=0.5, t_wait=0.25, train_images=512)
    breakdown.update(state_pred=8856264, act_per_image=2**16)  # [METRIC]'s memory fields
    run_log(logs, "ddp_1gpu_1.log", world_size=1, job_id="1", **breakdown)
    run_log(logs, "ddp_2gpu_2.log", world_size=2, job_id="2", **breakdown)
    pipeline = dict(strategy="pipeline", bubble=0.375, bubble_ideal=0.2, microbatches=4)
    run_log(logs, "pipeline_2gpu_3.log", world_size=2, job_id="3", **pipeline, **breakdown)
    append_comm_lines(logs / "ddp_2gpu_2.log")
    (logs / "gpu_2_node1.csv").write_text(GPU_CSV)  # run.sh's GPU sampler, job 2
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Relative paths are the caller's: ../logs from elsewhere/.
    done = run_script(elsewhere, LOGS="../logs", OUT="../results.csv", PLOTS="../plots")
    assert done.returncode == 0, done.stderr
    assert len(pd.read_csv(tmp_path / "results.csv")) == 9
    (tmp_path / "plots" / "report.md").rename(tmp_path / "report.md")  # the PNGs, then the rest
    assert_pngs(tmp_path / "plots", plot_results.FIGURES)
    assert "| ddp | 2 |" in done.stdout
    assert "results: ../results.csv" in done.stdout and "../plots/epoch_time.png" in done.stdout
    assert len(pd.read_csv(tmp_path / "comm.csv")) == 9
    timeline = pd.read_csv(tmp_path / "gpu_timeline.csv")
    assert timeline[["strategy", "gpus", "gpu", "seconds", "mem_mib"]].values.tolist() == [
        ["ddp", 2, 0, 0.0, 1500],
        ["ddp", 2, 1, 0.0, 1400],
        ["ddp", 2, 0, 5.5, 1500],
        ["ddp", 2, 1, 5.5, 1600],
    ]
    report = (tmp_path / "report.md").read_text()
    assert "| ddp | 2 |" in report
    assert all(f"]({name})" in report for name in plot_results.FIGURES)
    assert "| 2 | 4 | 1 | 0.375 | 0.200 |" in report.split("## Pipeline bubble")[1]
    # The largest part of 2.5 s: compute, 1.5 s.
    assert (
        "- ddp on 2 CPU ranks: the largest cost is compute, 1.500 s of 2.50 s per epoch (60%)"
        in report
    )


def test_figures_say_what_ran_and_what_memory_was_measured():
    """The subtitle of every figure comes from the CSV (device, data set and size, batch,
    epochs, sweep); the memory axis names what peak_mem measured on that device."""
    results = runs_frame({("ddp", 1): [9.0, 8.0], ("fsdp", 2): [6.0, 5.0]}).assign(
        device="cpu",
        dataset="synthetic",
        train_images=2048,
        global_batch=256,
        sweep="20261122-141500",
        state_mem=[8e6, 8e6, 4e6, 4e6],
    )
    assert results_summary.context(results) == (
        "device cpu · synthetic (2,048 images/epoch) · global batch 256 · 2 epochs · "
        "sweep 20261122-141500"
    )
    fig = memory_figures.plot_peak_memory(results_summary.summarize(results))
    memory, state = fig.axes
    assert memory.get_ylabel() == memory_figures.PEAK_MEMORY_LABEL["cpu"]
    assert "optimizer state" in state.get_ylabel()
    assert [line.get_ydata()[0] for line in state.get_lines()] == [8e6 / 2**20, 4e6 / 2**20]
    # The course's CSV says nothing of device or state: one panel, labelled as logged.
    course = results_summary.summarize(plot_results.read_results(course_csv))
    (ax,) = memory_figures.plot_peak_memory(course).axes
    assert "as logged" in ax.get_ylabel()
    assert results_summary.context(plot_results.read_results(course_csv)) == "10 epochs"


def test_quality_axes_do_not_magnify_a_difference_within_noise():
    """Final losses of 1.2710 and 1.2720 at 1 and 2 ranks, one run each: on a loss axis from 0
    the difference is under 1% of the panel's height, accuracy spans 0-100%, and the titles
    say no run-to-run spread was measured; with a repeated run they no longer say it. Both
    panels have legends and show their values (no offset)."""
    results = runs_frame(TWO_POINTS).assign(val_loss=[2.0, 1.2710, 2.0, 1.2720])
    fig = plot_results.plot_quality(results_summary.summarize(results))
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_legend() is not None
        assert ax.yaxis.get_major_formatter().get_offset() == ""
    loss, acc = fig.axes
    low, high = loss.get_ylim()
    assert low == 0 and 0.001 / (high - low) < 0.01, (low, high)
    assert acc.get_ylim() == (0, 100)
    assert all("no run-to-run spread measured" in ax.get_title() for ax in (loss, acc))
    again = results[results["gpus"] == 1].assign(log="ddp_1gpu_again.log")
    repeated = plot_results.plot_quality(results_summary.summarize(pd.concat([results, again])))
    assert not any("spread" in ax.get_title() for ax in repeated.axes)
    plt.close("all")


def test_figures_and_report_name_the_ranks_and_their_device():
    """What the `gpus` column counts is named after the device the runs trained on: CPU ranks
    on a CPU, GPUs on CUDA, in every axis, tick and sentence that counts them."""
    results = with_breakdown(runs_frame(TWO_POINTS))
    for device, one, many in (("cpu", "CPU rank", "CPU ranks"), ("cuda", "GPU", "GPUs")):
        ran = results.assign(device=device)
        summary = results_summary.summarize(ran)
        for name in LINE_PLOTS:
            assert {ax.get_xlabel() for ax in plot_results.FIGURES[name](summary).axes} == {many}
        speed, _ = plot_results.plot_speedup(summary).axes
        assert speed.get_ylabel().startswith(f"speedup over 1 {one} ")
        (bars,) = plot_results.plot_time_breakdown(summary).axes
        ticks = [t.get_text() for t in bars.get_xticklabels()]
        assert ticks == [f"ddp\n1 {one}", f"ddp\n2 {many}"]
        report = results_summary.report_text(ran, None, [])
        assert f"- ddp on 1 {one}: " in report and f"| strategy | {many} |" in report
        assert device == "cuda" or "GPU" not in report, report
        plt.close("all")


def test_repeated_runs_draw_min_max_bars():
    """--repeats: epoch time is the median over runs, with a bar from the fastest to the
    slowest; a configuration run once has no bar."""
    results = runs_frame(TWO_POINTS)
    again = runs_frame({("ddp", 1): [9.0, 10.0]}).assign(log="ddp_1gpu_again.log")
    summary = results_summary.summarize(pd.concat([results, again]))
    (ax,) = plot_results.plot_epoch_time(summary).axes
    (bars,) = [c for c in ax.collections if len(c.get_segments())]
    one_gpu, two_gpus = bars.get_segments()  # each [[x, low], [x, high]]
    assert one_gpu.tolist() == [[1, 8.0], [1, 10.0]]
    assert two_gpus[0][1] == two_gpus[1][1] == 4.0  # ran once: a bar of no length
    once = plot_results.plot_epoch_time(results_summary.summarize(results)).axes[0]
    assert not [c for c in once.collections if len(c.get_segments())]


def labelled_ticks(ax) -> list[float]:
    """The y values of the ticks drawn with a label, within the axis' view."""
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    ticks = [*ax.yaxis.get_majorticklabels(), *ax.yaxis.get_minorticklabels()]
    return [
        t.get_position()[1] for t in ticks if t.get_text() and low <= t.get_position()[1] <= high
    ]


def test_every_epoch_time_has_a_labelled_tick_near_it():
    """A CPU sweep's epoch times (issue 46's) span under a decade with the one-rank points at
    its top, 0.74-0.77 s, where the log axis once labelled nothing above 0.5. Every point, the
    ideal lines' too, now has a labelled tick within a factor of 1.42 (1 2 3 5 7's widest gap
    is 1 to 2: sqrt(2) from either)."""
    results = runs_frame(
        {
            ("ddp", 1): [0.80, 0.74],
            ("ddp", 2): [0.50, 0.45],
            ("ddp", 4): [0.42, 0.40],
            ("fsdp", 1): [0.80, 0.77],
            ("fsdp", 2): [0.55, 0.52],
            ("fsdp", 4): [0.50, 0.47],
        }
    )
    (ax,) = plot_results.plot_epoch_time(results_summary.summarize(results)).axes
    labelled = labelled_ticks(ax)
    for line in ax.get_lines():
        for y in line.get_ydata():
            assert min(max(y / t, t / y) for t in labelled) <= 1.42, (line.get_label(), y, labelled)
    plt.close("all")


def test_the_subtitle_fits_the_figure_above_the_panels(tmp_path):
    """A subtitle longer than a 720-px figure is wide is wrapped onto lines that lie within the
    figure, and the panels' titles below them."""
    results = runs_frame(TWO_POINTS).assign(
        device="cpu",
        dataset="synthetic",
        train_images=2048,
        global_batch=256,
        sweep=["20261122-141500", "20261123-093000"] * 2,
    )
    summary, subtitle = results_summary.summarize(results), results_summary.context(results)
    for name in ("epoch_time.png", "throughput.png", "val_loss_acc.png"):
        fig = plot_results.FIGURES[name](summary)
        plot_results.save_png(fig, tmp_path / name, subtitle)
        renderer = FigureCanvasAgg(fig).get_renderer()  # save_png closed the figure's own
        (title,) = fig.texts
        box = title.get_window_extent(renderer)
        assert title.get_text().replace("\n", " ") == subtitle
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, name
        for ax in fig.axes:
            assert ax.title.get_window_extent(renderer).y1 <= box.y0, name


def test_strategies_that_draw_the_same_curve_both_stay_visible():
    """ddp and fsdp compute the same, so their quality curves coincide: each strategy has its
    own marker and line style, a little transparent, in every per-strategy line plot."""
    same = {
        ("ddp", 1): [9.0, 8.0],
        ("ddp", 2): [5.0, 4.0],
        ("fsdp", 1): [9.0, 8.0],
        ("fsdp", 2): [5.0, 4.0],
    }
    summary = results_summary.summarize(runs_frame(same))
    for name in LINE_PLOTS + ["speedup_efficiency.png"]:
        fig = plot_results.FIGURES[name](summary)
        for ax in fig.axes:
            lines = {line.get_label(): line for line in ax.get_lines()}
            ddp, fsdp = lines["ddp"], lines["fsdp"]
            assert ddp.get_marker() != fsdp.get_marker(), name
            assert ddp.get_linestyle() != fsdp.get_linestyle(), name
            assert ddp.get_alpha() < 1 and fsdp.get_alpha() < 1, name
        plot_results.plt.close(fig)


def test_figures_and_report_say_when_ranks_outnumbered_their_cores():
    """The 4-"GPU" runs shared 2 cores: the subtitle of every figure and the report say so,
    and the report's largest cost of that configuration is not offered as a finding."""
    results = with_breakdown(runs_frame({("ddp", 1): [9.0, 8.0], ("ddp", 4): [6.0, 5.0]}))
    results["threads_per_core"] = results["gpus"] / 2
    warning = results_summary.cores_outnumbered(results).removeprefix("warning: ")
    assert results_summary.context(results).endswith(warning)
    report = results_summary.report_text(results, None, [])
    costs = [line for line in report.splitlines() if line.startswith("- ddp on ")]
    assert [line.endswith("too few cores for this to be a finding.") for line in costs] == [
        False,
        True,
    ]


def test_speedups_below_one_are_readable():
    """A strategy slower on more GPUs: the log axis has ticks below 1 down to its lowest
    speedup, and every point is labelled with its value."""
    results = runs_frame(
        {("fsdp", 1): [9.0, 9.0], ("fsdp", 2): [12.0, 12.0], ("fsdp", 4): [23.0, 23.0]}
    )
    (speed_ax, _) = plot_results.plot_speedup(results_summary.summarize(results)).axes
    ticks = [t for t in speed_ax.get_yticks() if speed_ax.get_ylim()[0] <= t]
    assert min(ticks) <= 9 / 23 and {0.5, 1.0} <= set(ticks)
    assert [t.get_text() for t in speed_ax.texts] == ["1.00", "0.75", "0.39"]


def test_the_breakdown_draws_every_part_also_from_logs_older_than_some():
    """A bar per point of all the parts, t_other's ("unexplained") too; from logs written before
    t_other (with_breakdown's four parts), drawn as 0 there: the bars still reach the epoch."""
    summary = results_summary.summarize(
        with_breakdown(runs_frame({("ddp", 1): [9.0, 8.0], ("ddp", 2): [6.0, 5.0]}))
    )
    (bars,) = plot_results.plot_time_breakdown(summary).axes
    labels = [t.get_text() for t in bars.get_legend().get_texts()]
    parts = [label for label in labels if not label.startswith("ideal")]
    assert parts == [utils.LABEL[t] for t in utils.TIME_PARTS] and "unexplained" in parts
    tops = [max(p.get_y() + p.get_height() for p in c) for c in bars.containers]
    assert tops[-1] == pytest.approx(max(summary["time"]))
    # Every legend entry stands clear of its label.
    bars.figure.canvas.draw()
    renderer = bars.figure.canvas.get_renderer()
    legend = bars.get_legend()
    for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
        drawn = handle.get_window_extent(renderer)  # a scatter's marker has no finite extent
        assert math.isfinite(drawn.x0) and drawn.x1 < text.get_window_extent(renderer).x0, (
            text.get_text()
        )
    plt.close("all")


def test_the_models_own_messages_sit_on_the_bandwidth_curves():
    """Each of the model's messages measured at a world size above 1 is a star on its
    collective's panel, at its size and measured bandwidth, in the colour of its world size's
    curve; the whole-gradient all-reduce (no message either strategy sends) and a single rank's
    messages are not drawn."""
    own = [
        ("all_reduce", "bucket0", 2_000_000, 2, 0.4),
        ("all_reduce", "grad", 2_214_056, 2, 0.45),
        ("all_gather", "unit_conv1", 1_792, 2, 0.01),
        ("reduce_scatter", "unit_conv1", 1_792, 2, 0.02),
        ("all_reduce", "bucket0", 2_000_000, 1, 0.0),
    ]
    rows = [
        {"op": op, "label": label, "bytes": size, "world_size": n, "busbw_gbps": bw}
        for op, label, size, n, bw in own
    ]
    comm = pd.concat([comm_frame(), pd.DataFrame(rows).assign(sweep="s")], ignore_index=True)
    fig = plot_results.plot_comm_bandwidth(comm)
    stars = {
        ax.get_title(): [tuple(p) for c in ax.collections for p in c.get_offsets()]
        for ax in fig.axes
    }
    assert stars == {
        "all_gather": [(1792, 0.01)],
        "all_reduce": [(2_000_000, 0.4)],
        "reduce_scatter": [(1792, 0.02)],
    }
    for ax in fig.axes:
        (curve,) = ax.lines
        assert (ax.collections[0].get_facecolor()[0][:3] == to_rgb(curve.get_color())).all()


def test_a_point_whose_gpu_idled_more_than_it_worked_is_called_host_bound():
    """report.md and the time-breakdown bars: a point whose GPU ran kernels under half the
    epoch is host-bound (0.3), one above is not (0.8), with each share; CPU runs, whose
    gpu_busy is na, say nothing of it."""
    results = with_breakdown(runs_frame(TWO_POINTS))
    on_gpu = results.assign(device="cuda", gpu_busy=results["gpus"].map({1: 0.3, 2: 0.8}))
    costs = results_summary.largest_costs(results_summary.summarize(on_gpu))
    assert costs[0].startswith("- ddp on 1 GPU: ") and costs[0].endswith(
        "; GPU busy 30%, host-bound."
    )
    assert costs[1].startswith("- ddp on 2 GPUs: ") and costs[1].endswith("; GPU busy 80%.")
    assert "below 50%" in costs[2], costs
    (bars,) = plot_results.plot_time_breakdown(results_summary.summarize(on_gpu)).axes
    assert [t.get_text() for t in bars.texts] == ["GPU busy 30%\nhost-bound", "GPU busy 80%"]
    on_cpu = results.assign(device="cpu", gpu_busy=math.nan)
    assert "busy" not in results_summary.report_text(on_cpu, None, [])
    (bars,) = plot_results.plot_time_breakdown(results_summary.summarize(on_cpu)).axes
    assert not bars.texts
    assert results_summary.host_bound(0.49) and not results_summary.host_bound(0.5)
    plt.close("all")


# ----------------------------------------------------------------------------- memory


def two_models() -> pd.DataFrame:
    """ddp and fsdp on 1, 2, 4 ranks of two models (the second 4x the CNN's parameters and 2x
    its activations per image), each rank's batch 32 of a global 32 x N."""
    frames = []
    for model, scale in (("cnn", 1), ("cnn-wide", 4)):
        runs = runs_frame({(s, g): [2.0, 1.0] for s in ("ddp", "fsdp") for g in (1, 2, 4)})
        memory = with_memory(runs.assign(model=model, device="cpu"))
        frames.append(
            memory.assign(
                log=memory["log"] + model,
                state_mem=memory["state_mem"] * scale,
                state_pred=memory["state_pred"] * scale,
                parameters=CNN_PARAMETERS * scale,
                act_per_image=2**16 * (1 + (scale > 1)),
            )
        )
    return pd.concat(frames, ignore_index=True)


def test_the_projection_is_the_gpu_less_the_activations_over_the_state_per_parameter():
    """report.md's largest model, re-derived by hand: fsdp on 4 ranks keeps 16 / 4 bytes a
    parameter and 64 KiB x 32 images of activations; onto 80 GB on CPU runs (said so), or
    --gpu-memory's."""
    results = two_models()
    report = results_summary.report_text(results, None, [])
    section = report.split("## The largest model that fits")[1].split("## Figures")[0]
    assert "Onto a GPU of 80 GB (the runs trained on CPU ranks;" in section
    largest = (80 * 2**30 - 2**16 * 32) / (16 / 4)
    row = (
        f"| cnn | 553,514 | fsdp | 4 | 32 | 4.00 | 4.00 | 2.0 | {largest / 1e6:,.1f} M | "
        f"{largest / CNN_PARAMETERS:,.0f} |"
    )
    assert row in section, section
    wide = (80 * 2**30 - 2**17 * 32) / 16  # ddp keeps all 16 at any rank count
    assert (
        f"| cnn-wide | 2,214,056 | ddp | 2 | 32 | 16.00 | 16.00 | 4.0 | {wide / 1e6:,.1f} M"
        in section
    )
    assert "grows with the largest unit, not with the shard" in section
    assert "reserved_mem" in section  # the allocator's caveat
    smaller = results_summary.report_text(results, None, [], gpu_memory=40)
    assert "Onto a GPU of 40 GB (--gpu-memory)" in smaller
    assert f"{(40 * 2**30 - 2**16 * 32) / 4 / 1e6:,.1f} M" in smaller


def test_without_act_per_image_the_projection_says_it_cannot_be_made(tmp_path, capsys):
    """Logs older than the [METRIC] line's act_per_image: no guess, in report.md or a figure."""
    results = two_models().drop(columns=["act_per_image"])
    report = results_summary.report_text(results, None, [])
    assert "Cannot be made: the logs have no act_per_image" in report
    assert "| cnn | 553,514 |" not in report
    csv = tmp_path / "results.csv"
    results.to_csv(csv, index=False)
    code, _, err = cli(capsys, "--csv", csv, "--out-dir", tmp_path / "plots")
    assert code == 0 and "not written largest_model.png: no act_per_image" in err
    assert (tmp_path / "plots" / "bytes_per_parameter.png").exists()


def test_state_per_parameter_has_the_zero_papers_lines_from_the_cost_model():
    """16 bytes a parameter replicated and 16 / N sharded, for Adam in fp32 (cost_model's
    count, named on the line); one line per model and strategy, one colour per strategy."""
    fig = memory_figures.plot_bytes_per_parameter(results_summary.summarize(two_models()))
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    whole = lines["replicated: 16 B (adam, fp32 state)"]
    assert list(whole.get_ydata()) == [16, 16, 16]
    assert list(lines["sharded: 16 B / N"].get_ydata()) == [16, 8, 4]
    assert list(lines["fsdp, cnn-wide"].get_ydata()) == [16, 8, 4]
    assert list(lines["ddp, cnn"].get_ydata()) == [16, 16, 16]
    color = lines["fsdp, cnn"].get_color()
    assert lines["fsdp, cnn-wide"].get_color() == color != lines["ddp, cnn"].get_color()
    assert lines["fsdp, cnn"].get_marker() != lines["fsdp, cnn-wide"].get_marker()


def test_memory_per_rank_is_drawn_on_log_axes_one_line_per_model_and_strategy():
    fig = memory_figures.plot_peak_memory(results_summary.summarize(two_models()))
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
        labels = {line.get_label() for line in ax.get_lines()}
        assert labels == {f"{s}, {m}" for s in ("ddp", "fsdp") for m in ("cnn", "cnn-wide")}


def test_without_torch_the_state_per_parameter_is_left_out_in_one_line(monkeypatch):
    """plot_results.sh asks for pandas and matplotlib alone: where cost_model (torch) cannot
    load, that figure is not written, and the others are."""
    monkeypatch.setitem(sys.modules, "cost_model", None)  # import cost_model: ImportError
    summary = results_summary.summarize(two_models())
    with pytest.raises(plot_results.NotPlottable, match="cost_model.py's, which needs torch"):
        memory_figures.plot_bytes_per_parameter(summary)
