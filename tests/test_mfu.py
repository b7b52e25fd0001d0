"""How close to the hardware (cost_model.py's FLOPs): the model's training FLOPs counted by
torch agree with a count by hand, the peak table names the right device, each epoch's tflops and
mfu follow from its other fields, an MFU above 100% is said, and the collector and the plots
carry them."""

import pandas as pd
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

import collect_results
import cost_model
import plot_results
import results_summary
from conftest import TINY, config_in, main_on_ranks, metrics_in
from helpers import metric_fields, write_log

pytestmark = pytest.mark.fast  # make test-fast


def conv(c_in: int, c_out: int, h: int, w: int) -> int:
    """A 3x3 'same' convolution's multiply-adds, two FLOPs each."""
    return 2 * c_in * c_out * 9 * h * w


def cnn_forward_flops(width: int, classes: int, h: int, w: int) -> tuple[int, int]:
    """(the whole forward's FLOPs, the first convolution's): model.CNN by hand. Each block's
    convolution runs at its input's resolution, the pooling after it halves it."""
    c1, c2, c3 = width, 2 * width, 4 * width
    first = conv(3, c1, h, w)
    convs = first + conv(c1, c2, h // 2, w // 2) + conv(c2, c3, h // 4, w // 4)
    linear = 2 * (c3 * (h // 8) * (w // 8)) * 512 + 2 * 512 * classes
    return convs + linear, first


@pytest.mark.parametrize(
    "name, width, classes, shape",
    [
        ("cnn", 16, 10, (3, 32, 32)),
        ("cnn-wide", 64, 10, (3, 32, 32)),
        ("cnn", 16, 200, (3, 64, 64)),
    ],
)
def test_training_flops_of_the_cnn_are_three_forwards_less_one_input_gradient(
    name, width, classes, shape
):
    """Backward computes each layer's weight gradient and its input gradient, each as costly as
    the forward: 3x the forward, less the input gradient of the first convolution, whose input
    (the images) needs none."""
    forward, first = cnn_forward_flops(width, classes, *shape[1:])
    counted = cost_model.training_flops_per_image(name, classes, shape)
    assert counted == 3 * forward - first, (counted, 3 * forward - first)


def test_the_count_draws_no_random_numbers():
    before = torch.random.get_rng_state()
    cost_model.training_flops_per_image("cnn", 10, (3, 32, 32))
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize(
    "device_name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),  # SXM
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
        ("NVIDIA H100 PCIe", "fp16", 756.5),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA GH200 120GB", "tf32", 494.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("Tesla V100-SXM2-32GB", "fp16", None),
    ],
)
def test_the_peak_of_a_device_by_its_name_and_the_precision(device_name, precision, peak):
    assert cost_model.peak_for_name(device_name, precision) == peak


def test_a_cpu_has_no_peak_and_its_mfu_is_unknown():
    assert cost_model.device_peak_tflops(torch.device("cpu"), "fp32") is None
    fields = cost_model.ModelFlops(per_image=10**9, devices=2, peak_tflops=None).fields(4000.0)
    assert fields == {"tflops": 2.0, "mfu": cost_model.UNKNOWN}


@pytest.mark.timeout(240)
def test_tflops_and_mfu_follow_from_the_other_fields_and_an_impossible_mfu_is_said():
    """Two ranks (tflops is per device) told a peak far below what the CPU does: mfu is
    tflops over the peak, and each epoch's MFU above 100% is a warning beside its line."""
    peak = 1e-6
    args = [*TINY, "--epochs", "2", "--batch-size", "64", "--no-checkpoint"]
    done, _ = main_on_ranks([*args, "--peak-tflops", str(peak)], 2)
    assert done.returncode == 0, done.stderr[-3000:]
    config = config_in(done.stdout)
    assert config["flops_per_image"] == cost_model.training_flops_per_image("cnn", 10, (3, 32, 32))
    assert config["peak_tflops"] == peak
    metrics = metrics_in(done.stdout)
    assert len(metrics) == 2
    for m in metrics:
        per_device = config["flops_per_image"] * m["throughput"] / m["world_size"] / 1e12
        assert m["tflops"] == pytest.approx(per_device, rel=1e-5)
        assert m["mfu"] == pytest.approx(100 * m["tflops"] / peak, rel=1e-5)
    warnings = [line for line in done.stdout.splitlines() if "is above the device's peak" in line]
    assert [w.split(":")[1].strip() for w in warnings] == ["epoch 1", "epoch 2"], warnings


def test_the_collector_and_the_plots_carry_tflops_and_mfu(tmp_path):
    """A run that knew its peak and one that did not (`mfu=na`): the CSV has the numbers and
    an empty cell, the summary their medians, the throughput figure a panel for them."""
    known = [metric_fields(e, "ddp", 1, tflops=2.0, mfu=40.0 + e) for e in (1, 2, 3)]
    unknown = [metric_fields(e, "ddp", 2, tflops=1.5, mfu=cost_model.UNKNOWN) for e in (1, 2, 3)]
    write_log(tmp_path / "ddp_1gpu.log", known)
    write_log(tmp_path / "ddp_2gpu.log", unknown)
    results = collect_results.results_frame(collect_results.collect([tmp_path], report=print))
    by_gpus = dict(list(results.groupby("gpus")))
    assert by_gpus[1]["mfu"].tolist() == [41.0, 42.0, 43.0]
    assert by_gpus[2]["mfu"].isna().all() and by_gpus[2]["tflops"].eq(1.5).all()
    summary = results_summary.summarize(results)
    one, two = (summary[summary["gpus"] == n].iloc[0] for n in (1, 2))
    assert one["mfu"] == 42.5 and one["tflops"] == 2.0  # median after the first epoch
    assert pd.isna(two["mfu"]) and two["tflops"] == 1.5
    assert "MFU %" in results_summary.markdown_table(summary)

    fig = plot_results.plot_throughput(summary)
    FigureCanvasAgg(fig).draw()
    tflops_ax = fig.axes[1]
    assert "TFLOP/s" in tflops_ax.get_ylabel()
    assert [t.get_text() for t in tflops_ax.texts] == ["MFU 42.5%"]
