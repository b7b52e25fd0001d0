"""The largest model a GPU holds, projected from what the runs measured: per model, strategy and
GPU count, how many parameters fit a GPU of a given memory, state plus activations at the run's
batch, for report.md and plot_results.py's figure.

Per point (the largest over its epochs and runs): bytes per parameter, state_mem / parameters
(flat for DDP, 1/N for FSDP), and bytes per image, act_per_image. A model of the same family
(the measured one scaled in its parameters, its activations per image as measured) fits M bytes
up to P = (M - act_per_image x local_batch) / bytes per parameter (largest_parameters). Where
that stops holding is CAVEATS, which report.md prints.
"""

import math

import pandas as pd

from utils import MB

GIB = 1024 * MB  # --gpu-memory's GB are GiB, as the project's MB are MiB
CPU_GPU_GB = 80  # the GPU a CPU run is projected onto: an A100's or H100's 80 GB
# What the projection needs of each point: without them (logs older than act_per_image), it
# says it cannot be made rather than guess.
NEEDED = ("state_mem", "parameters", "act_per_image", "local_batch")

CAVEATS = (
    "- Activations per image are the measured model's: a family member whose extra parameters "
    "sit in its high-resolution layers holds more.",
    "- FSDP gathers one unit's full parameters while it runs: transient memory inside the "
    "measured peak that grows with the largest unit, not with the shard. One unit much larger "
    "than the rest (a classifier's matrix, a ResNet's last stage) makes the FSDP rows too "
    "generous by about that unit's full size.",
    "- The peak is what the allocator handed out. On a GPU the caching allocator reserves more "
    "(reserved_mem in the logs), and a fragmented allocator can fail a model that fits on paper: "
    "leave it room.",
)


def largest_parameters(
    state_mem: float, parameters: float, act_per_image: float, local_batch: float, gpu: float
) -> float:
    """The parameters of the largest model whose state plus activations fit `gpu` bytes: state
    at the measured bytes per parameter (state_mem / parameters), activations at the measured
    bytes per image times the rank's batch; 0 where the activations alone do not fit."""
    activations = act_per_image * local_batch
    return max(0.0, (gpu - activations) / (state_mem / parameters))


def gpu_memory(summary: pd.DataFrame, given_gb: float | None) -> tuple[float, str]:
    """The GPU to project onto, in bytes, and its words: --gpu-memory where given, else the
    runs' own GPU where their logs say its memory, else 80 GB (CPU runs, or logs that do not
    say)."""
    if given_gb is not None:
        return given_gb * GIB, f"a GPU of {given_gb:g} GB (--gpu-memory)"
    logged = summary["gpu_memory"].dropna() if "gpu_memory" in summary else pd.Series([])
    if not logged.empty:
        return logged.min(), f"the runs' own GPU, {logged.min() / GIB:.1f} GB (their logs)"
    why = "the runs trained on CPU ranks" if on_cpu(summary) else "the logs do not say"
    return CPU_GPU_GB * GIB, f"a GPU of {CPU_GPU_GB} GB ({why}; --gpu-memory chooses another)"


def on_cpu(summary: pd.DataFrame) -> bool:
    return "device" in summary and set(summary["device"].dropna()) == {"cpu"}


def missing(summary: pd.DataFrame) -> list[str]:
    """The columns the projection needs that no point has."""
    return [c for c in NEEDED if c not in summary or summary[c].isna().all()]


def projection_table(summary: pd.DataFrame, gpu: float) -> pd.DataFrame:
    """Per point with every column NEEDED: bytes per parameter measured and, where logged,
    predicted (state_pred, cost_model.py), activations, and the largest model that fits."""
    rows = summary.dropna(subset=list(NEEDED)).copy()
    rows["bytes_per_param"] = rows["state_mem"] / rows["parameters"]
    predicted = rows["state_pred"] if "state_pred" in rows else math.nan
    rows["bytes_per_param_pred"] = predicted / rows["parameters"]
    rows["activations"] = rows["act_per_image"] * rows["local_batch"]
    rows["largest"] = [
        largest_parameters(r.state_mem, r.parameters, r.act_per_image, r.local_batch, gpu)
        for r in rows.itertuples()
    ]
    rows["times_model"] = rows["largest"] / rows["parameters"]
    return rows


def projection_markdown(table: pd.DataFrame, rank: str) -> str:
    lines = [
        f"| model | parameters | strategy | {rank}s | batch per {rank} | state B/parameter "
        "measured | predicted | activations MB | largest model that fits | x this model |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in table.itertuples():
        predicted = "n/a" if pd.isna(r.bytes_per_param_pred) else f"{r.bytes_per_param_pred:.2f}"
        lines.append(
            f"| {r.model} | {r.parameters:,.0f} | {r.strategy} | {r.gpus:.0f} | "
            f"{r.local_batch:.0f} | {r.bytes_per_param:.2f} | {predicted} | "
            f"{r.activations / MB:.1f} | {r.largest / 1e6:,.1f} M | {r.times_model:,.0f} |"
        )
    return "\n".join(lines)


def projection_section(summary: pd.DataFrame, given_gb: float | None, rank: str) -> list[str]:
    """report.md's section: the table, how it was made, and where it stops holding; or why it
    cannot be made."""
    title = ["## The largest model that fits", ""]
    if absent := missing(summary):
        return [
            *title,
            f"Cannot be made: the logs have no {', '.join(absent)} (runs older than these "
            "fields). Run the sweep again to measure them.",
            "",
        ]
    gpu, where = gpu_memory(summary, given_gb)
    return [
        *title,
        f"Onto {where}: per point, the parameters P of the largest model whose state and "
        "activations fit, P = (GPU memory - act_per_image x batch per "
        f"{rank}) / (state_mem / parameters), the model scaled in its parameters with its "
        "activations per image as measured (projection.py). Predicted: cost_model.py's "
        "state_pred / parameters.",
        "",
        projection_markdown(projection_table(summary, gpu), rank),
        "",
        "Where it stops holding:",
        "",
        *CAVEATS,
        "",
    ]
