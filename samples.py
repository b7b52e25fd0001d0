"""What the GPUs and the training processes did during a job: run.sh's samplers, summarised.

run.sh samples every node of a job every SAMPLE_EVERY seconds into two CSVs beside the logs:
`gpu_<job>_<host>.csv` (nvidia-smi's own CSV: timestamp, index, utilization.gpu [%],
memory.used [MiB], memory.total [MiB], power.draw [W]) and `cpu_<job>_<host>.csv` (time_s,
pid, cpu_s, rss_mb of every main.py rank: cumulative CPU seconds and resident memory). A
requeued job appends to the same files, nvidia-smi repeating its header.

Per GPU this gives the peak, mean and most frequent memory use and the mean utilisation (as the
KAUST workshop's analysis does): the most frequent value is the training steady state, the
peak its worst moment. Unlike the in-process `peak_mem` (what PyTorch's allocator handed out),
nvidia-smi sees everything the process holds: the CUDA context, the allocator's cache, NCCL's
buffers. Per process: the mean CPU use (CPU seconds over wall seconds, 100% = one core) and
the peak resident memory.
"""

import re
from pathlib import Path

import pandas as pd

FILE_RE = re.compile(r"^(?P<kind>gpu|cpu)_(?P<job_id>.+)_(?P<host>[^_]+)\.csv$")
GPU_COLUMNS = ("timestamp", "gpu", "util_pct", "mem_mib", "mem_total_mib", "power_w")
GPU_SUMMARY = (
    "job_id",
    "host",
    "gpu",
    "samples",
    "peak_mem_mib",
    "mean_mem_mib",
    "mode_mem_mib",
    "mem_total_mib",
    "mean_util_pct",
    "mean_power_w",
)
CPU_SUMMARY = ("job_id", "host", "pid", "samples", "seconds", "mean_cpu_pct", "peak_rss_mb")


def sample_files(folder: Path) -> list[tuple[str, str, str, Path]]:
    """(kind, job id, host, path) of every sampler CSV directly in folder."""
    found = []
    for path in sorted(folder.glob("*.csv")):
        match = FILE_RE.match(path.name)
        if match:
            found.append((match["kind"], match["job_id"], match["host"], path))
    return found


def read_gpu_samples(path: Path) -> pd.DataFrame:
    """nvidia-smi's rows (its header may repeat after a requeue; "[N/A]" power is NaN)."""
    frame = pd.read_csv(
        path, header=None, names=GPU_COLUMNS, skipinitialspace=True, dtype=str, on_bad_lines="skip"
    )
    frame = frame[frame["timestamp"] != "timestamp"]
    for column in GPU_COLUMNS[1:]:
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame.dropna(subset=["gpu", "mem_mib"])


def summary_rows(job_id: str, host: str, frame: pd.DataFrame, key: str, stats) -> list[dict]:
    """One row per GPU or process (`key`): where it ran, its samples, and stats(its samples)."""
    return [
        {"job_id": job_id, "host": host, key: int(k), "samples": len(one), **stats(one)}
        for k, one in frame.groupby(key)
    ]


def gpu_stats(one: pd.DataFrame) -> dict:
    memory = one["mem_mib"]
    return {
        "peak_mem_mib": memory.max(),
        "mean_mem_mib": round(memory.mean(), 1),
        "mode_mem_mib": memory.mode().max(),  # of equally frequent values, the largest
        "mem_total_mib": one["mem_total_mib"].max(),
        "mean_util_pct": round(one["util_pct"].mean(), 1),
        "mean_power_w": round(one["power_w"].mean(), 1),
    }


def process_stats(one: pd.DataFrame) -> dict:
    seconds = one["time_s"].max() - one["time_s"].min()
    cpu = one["cpu_s"].max() - one["cpu_s"].min()
    return {
        "seconds": round(seconds, 1),
        "mean_cpu_pct": round(100 * cpu / seconds, 1) if seconds > 0 else float("nan"),
        "peak_rss_mb": one["rss_mb"].max(),
    }


def files_of(folders: list[Path], kind: str) -> list[tuple[str, str, Path]]:
    """(job id, host, path) of the sampler CSVs of one kind (gpu, cpu) in the folders."""
    return [
        (job, host, path) for f in folders for k, job, host, path in sample_files(f) if k == kind
    ]


def gpu_timeline(folders: list[Path]) -> pd.DataFrame:
    """Every GPU sample: job_id, host, gpu, seconds since the job's first sample on that node,
    memory used (MiB) and utilisation (%), for plotting them over time."""
    frames = []
    for job_id, host, path in files_of(folders, "gpu"):
        frame = read_gpu_samples(path)
        when = pd.to_datetime(frame["timestamp"], format="%Y/%m/%d %H:%M:%S.%f", errors="coerce")
        frames.append(
            pd.DataFrame(
                {
                    "job_id": job_id,
                    "host": host,
                    "gpu": frame["gpu"].astype(int),
                    "seconds": (when - when.min()).dt.total_seconds(),
                    "mem_mib": frame["mem_mib"],
                    "util_pct": frame["util_pct"],
                }
            ).dropna()
        )
    columns = ("job_id", "host", "gpu", "seconds", "mem_mib", "util_pct")
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def summarize(folders: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per GPU and per process, from the sampler CSVs in the folders."""
    gpus, processes = [], []
    for job_id, host, path in files_of(folders, "gpu"):
        gpus += summary_rows(job_id, host, read_gpu_samples(path), "gpu", gpu_stats)
    for job_id, host, path in files_of(folders, "cpu"):
        frame = pd.read_csv(path, on_bad_lines="skip").apply(pd.to_numeric, errors="coerce")
        processes += summary_rows(job_id, host, frame.dropna(), "pid", process_stats)
    return (pd.DataFrame(gpus, columns=GPU_SUMMARY), pd.DataFrame(processes, columns=CPU_SUMMARY))
