"""The summary of run.sh's GPU and CPU samplers (their end-to-end run: test_run_sh.py)."""

import pytest

import samples
from helpers import GPU_CSV_HEADER

pytestmark = pytest.mark.fast  # make test-fast


def test_gpu_summary_is_exact(tmp_path):
    rows = [(0, 40, 500), (1, 90, 700), (0, 60, 800), (1, 70, 700), (0, 80, 800)]
    lines = [GPU_CSV_HEADER] + [
        f"2026/11/22 10:00:0{i}.000, {gpu}, {util}, {mem}, 81559, 100.0"
        for i, (gpu, util, mem) in enumerate(rows)
    ]
    # A requeued job appends: nvidia-smi's header again, and a GPU without a power reading.
    lines += [GPU_CSV_HEADER, "2026/11/22 10:01:00.000, 1, 20, 100, 81559, [N/A]"]
    (tmp_path / "gpu_4242_nid001.csv").write_text("\n".join(lines) + "\n")
    gpus, _ = samples.summarize([tmp_path])
    gpu0, gpu1 = gpus.to_dict("records")
    assert gpu0 == {
        "job_id": "4242",
        "host": "nid001",
        "gpu": 0,
        "samples": 3,
        "peak_mem_mib": 800,
        "mean_mem_mib": 700.0,
        "mode_mem_mib": 800,
        "mem_total_mib": 81559,
        "mean_util_pct": 60.0,
        "mean_power_w": 100.0,
    }
    assert (gpu1["samples"], gpu1["peak_mem_mib"], gpu1["mode_mem_mib"]) == (3, 700, 700)
    assert gpu1["mean_util_pct"] == 60.0 and gpu1["mean_power_w"] == 100.0  # N/A left out


def test_process_summary_is_cpu_seconds_over_wall_seconds(tmp_path):
    (tmp_path / "cpu_4242_nid001.csv").write_text(
        "time_s,pid,cpu_s,rss_mb\n"
        "100.0,7,10.0,300.0\n101.0,8,0.5,200.0\n"
        "102.0,7,13.0,900.5\n103.0,8,1.0,250.0\n"
        "104.0,7,16.0,800.0\n"
    )
    _, processes = samples.summarize([tmp_path])
    p7, p8 = processes.to_dict("records")
    assert (p7["pid"], p7["samples"], p7["seconds"], p7["peak_rss_mb"]) == (7, 3, 4.0, 900.5)
    assert p7["mean_cpu_pct"] == 150.0  # 6 CPU seconds in 4 s: one and a half cores
    assert p8["mean_cpu_pct"] == 25.0 and p8["peak_rss_mb"] == 250.0


def test_other_files_are_not_samples(tmp_path):
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    (tmp_path / "comm_4242.csv").write_text("a,b\n1,2\n")
    assert samples.sample_files(tmp_path) == []
    gpus, processes = samples.summarize([tmp_path])
    assert gpus.empty and processes.empty
