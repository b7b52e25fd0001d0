"""Who am I, how many are we, and where do we meet: one answer for every launcher.

The same program runs as a plain script (world size 1), under `torchrun` (which exports
RANK/LOCAL_RANK/WORLD_SIZE) and under `srun` (which exports SLURM_PROCID/SLURM_LOCALID/
SLURM_NTASKS). The rendezvous point is MASTER_ADDR:MASTER_PORT; under SLURM it defaults to the
first host of the allocation and a port derived from the job id, so two jobs sharing a node
never collide. With CUDA present each rank drives `cuda:(local_rank % device_count)` over NCCL
(this also covers `--gpus-per-task=1`, where every task sees one GPU); otherwise the CPU over gloo.
"""

import datetime
import gc
import os
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from utils import UsageError

DEFAULT_PORT = 29500
PORT_RANGE = 20000  # ports DEFAULT_PORT .. DEFAULT_PORT + PORT_RANGE - 1 are derived from job ids


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int_env(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"environment variable {name}={env[name]!r} is not an integer") from None


def read_ranks(env=os.environ) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's variables, else SLURM's, else (0, 0, 1).

    SLURM's are used only inside a job step (`srun`): the batch script itself also carries
    SLURM_PROCID=0 and the job's SLURM_NTASKS, and would otherwise wait for peers that never come.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
    else:
        return 0, 0, 1
    rank, local_rank, world_size = (_int_env(env, n) if n in env else 0 for n in names)
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is outside world size {world_size} ({', '.join(names)})")
    return rank, local_rank, world_size


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as 'nid[001234-001237]', expanded by scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise UsageError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol ({e}); "
                         "set MASTER_ADDR") from None
    return out.split()[0]


def master_port_for_job(job_id: str) -> int:
    return DEFAULT_PORT + int(job_id) % PORT_RANGE


def rendezvous(env=os.environ) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT: the environment's, else derived from the SLURM job."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = first_slurm_host(nodelist) if nodelist else "127.0.0.1"
    if env.get("MASTER_PORT"):
        port = _int_env(env, "MASTER_PORT")
    elif env.get("SLURM_JOB_ID", "").isdigit():
        port = master_port_for_job(env["SLURM_JOB_ID"])
    else:
        port = DEFAULT_PORT
    return addr, port


def pick_device(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


def setup(timeout_s: float = 300.0) -> DistEnv:
    """Join (or, alone, create) the process group and bind this process to its device.

    A world of one still gets a process group, from an in-memory store: DDP and FSDP need one,
    and no port is opened for nobody.
    """
    rank, local_rank, world_size = read_ranks()
    device, backend = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        # env:// rather than our own TCPStore: under torchrun the agent already hosts the store.
        addr, port = rendezvous()
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, local_rank, world_size, device, backend)


def cleanup() -> None:
    """Destroy the process groups while the interpreter is fully alive.

    destroy_process_group only forgets the groups; their C++ side dies with the last Python
    reference. A reference cycle (modules, hooks) can postpone that to the interpreter's
    teardown, where gloo's threads are torn down unjoined: "terminate called without an
    active exception", SIGABRT, after all the work was done. Collect the cycles first.
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def barrier() -> None:
    """Wait for every rank; nothing to wait for in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def on_rank0(fn, *args):
    """Run fn on rank 0 alone and hand its result, or its UsageError, to every rank.

    For work only one rank may do (download, create folders): the broadcast is also the
    barrier, and a failure ends every rank with rank 0's message instead of a hang.
    """
    outcome = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome = [("ok", fn(*args))]
        except UsageError as e:
            outcome = [("error", str(e))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    status, value = outcome[0]
    if status == "error":
        raise UsageError(value)
    return value


def is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because another rank died or hung (not a bug of ours)."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and "gloo" in str(error))


def silent_ranks(grace_s: float = 3.0) -> list[int]:
    """After a failed collective: the ranks that did not check in at the rendezvous store.

    Every surviving rank meets the failure within moments of the others (a dead peer closes
    its sockets; a hung one times every rank out together), writes its check-in, and waits a
    little for the others'. Whoever is missing died or hung.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"checkin/{rank}", "alive")
    deadline = time.monotonic() + grace_s
    while True:
        missing = [r for r in range(world) if not store.check([f"checkin/{r}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.1)


def describe_peer_failure(error: BaseException) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    try:
        missing = silent_ranks()
        who = f"rank(s) {', '.join(map(str, missing))} died or hung" if missing else \
            "a peer failed"
    except Exception:  # the store lives in rank 0 (or torchrun's agent): it may be gone too
        who = "the rendezvous store is gone too: rank 0 (or its launcher) died"
    return f"rank {dist.get_rank()}: {who}; stopping ({first_line[:200]})"


def num_nodes(env=os.environ) -> int:
    """Nodes taking part: SLURM's count, else torchrun's ratio of world to local world size."""
    if "SLURM_JOB_NUM_NODES" in env and "SLURM_STEP_ID" in env:
        return int(env.get("SLURM_STEP_NUM_NODES", env["SLURM_JOB_NUM_NODES"]))
    world, local = int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", 0) or 0)
    return max(1, world // local) if local else 1


def job_id(env=os.environ) -> str:
    return env.get("SLURM_JOB_ID", "local")
