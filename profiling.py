"""--profile: torch.profiler over a few training steps of each rank, one Chrome trace per rank
(open it in https://ui.perfetto.dev), and the line that says where the traces are.
"""

import os
from pathlib import Path

import torch

import distributed_utils
from cuda_graphs import WARMUP_STEPS
from layout import LOGS_DIR, relative, run_id

# --profile traces these steps of the first epoch trained: the first is skipped (it carries
# one-off work), the next warm the profiler up, the last are recorded. A graphed run's eager
# warm-up steps and its capture are skipped too, so that the trace holds the graph's replays.
PROFILE_SCHEDULE = {"wait": 1, "warmup": 2, "active": 3}
# kineto's level that keeps its own lines off stderr (5 would still print its USDT markers).
KINETO_QUIET = "6"


def quiet_kineto() -> None:
    """Keep kineto's own lines (no GPU found, its markers at start and stop) off the run's
    stderr, unless the user set its level."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)


class StepProfiler:
    """--profile's torch.profiler over this rank's steps: operator by operator and, on a GPU,
    kernel by kernel, with the collectives and whether they overlap compute."""

    def __init__(self, path: Path, device: torch.device, graphed: bool = False):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:
            quiet_kineto()  # else kineto's "ERROR: ... gpuGetDeviceCount failed" at every trace
        self.path, self.saved, self.graphed = path, False, graphed
        self.schedule = {
            **PROFILE_SCHEDULE,
            "wait": PROFILE_SCHEDULE["wait"] + (WARMUP_STEPS + 1 if graphed else 0),
        }
        self.profiler = torch.profiler.profile(
            activities=activities,
            on_trace_ready=self.save,
            schedule=torch.profiler.schedule(**self.schedule, repeat=1),
        )

    @property
    def traced_steps(self) -> range:
        """The steps of the first epoch trained that the trace holds (1 = the first)."""
        last = sum(self.schedule.values())
        return range(last - self.schedule["active"] + 1, last + 1)

    def save(self, profiler: torch.profiler.profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        self.saved = True


PROFILE_DIR = LOGS_DIR / "profiles"


def profile_path(env: distributed_utils.DistEnv) -> Path:
    """One trace per rank and run, named as rank 0 names the run."""
    run = distributed_utils.on_rank0(run_id)
    return PROFILE_DIR / f"{run}_rank{env.rank}.json"


def profile_report(profiler: StepProfiler) -> str:
    steps = profiler.traced_steps
    if not profiler.saved:
        return f"[PROFILE] no trace: the run trained fewer than {steps[-1]} steps"
    pattern = profiler.path.with_name(profiler.path.name.replace("rank0", "rank*"))
    kind = "replays of the captured CUDA graph" if profiler.graphed else "eager"
    return (
        f"[PROFILE] steps {steps[0]}-{steps[-1]} ({kind}) of each rank traced: {relative(pattern)} "
        "(open in https://ui.perfetto.dev)"
    )
