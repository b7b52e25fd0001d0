"""Who am I, how many are we, and where do we meet: one answer for every launcher.

The same program runs as a plain script (world size 1), under `torchrun` (RANK/LOCAL_RANK/
WORLD_SIZE, MASTER_ADDR/MASTER_PORT) and under `srun` (SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS).
Which rank this process is, and how many there are, is utils.read_ranks()'s to say (no torch);
this module owns the rest, the launch scripts export none of it. Under SLURM the rendezvous
point is the first host of the step's node list (expanded here, without scontrol, so that it
works in a container) and a port derived from the job id, so two jobs sharing a node meet at
different ports. With CUDA each rank drives `cuda:(local_rank % device_count)` over NCCL (also
under `--gpus-per-task=1`; two ranks on one GPU are refused); otherwise the CPU over gloo, but
not silently where the job was given GPUs torch cannot see.
"""

import atexit
import datetime
import gc
import itertools
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import peer_failures
from layout import LOGS_DIR, job_id
from utils import UsageError, env_int, is_rank_zero, read_ranks, release

# The oldest torch this project runs on; requirements.txt's floor is the same (a test checks).
# torch 2.9's pipeline stages greet their neighbours with a tensor of another type than the one
# they wait for, which gloo refuses and NCCL garbles (fixed for 2.10 by pytorch/pytorch#165539).
OLDEST_TORCH = (2, 10)
DEFAULT_PORT = 29500  # torchrun's, where no job gives one
# The ports derived from job ids: below Linux's default range of ports for outgoing connections
# (32768-60999), any of which the system may have handed to another program on the node.
JOB_PORTS = range(20000, 32000)


@dataclass(frozen=True)
class DistEnv:
    """This rank's place in the run. Whether it is rank 0 is utils.is_rank_zero()'s to say."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def expand_hostlist(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list, as `scontrol show hostnames` prints them: 'a[1-2],b3' ->
    a1, a2, b3; 'rack[1-2]-n[01-02]' -> rack1-n01, rack1-n02, rack2-n01, rack2-n02. Zero
    padding is the width of a range's first number, as in SLURM."""
    items = re.findall(r"(?:[^,\[\]]+|\[[^\[\]]*\])+", nodelist)
    if not nodelist or ",".join(items) != nodelist:
        raise UsageError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR")
    hosts = []
    for item in items:
        # re.split with a group: text, bracket, text, bracket, ..., text
        parts = re.split(r"\[([^\[\]]*)\]", item)
        choices = [
            [part] if i % 2 == 0 else _expand_ranges(part, nodelist) for i, part in enumerate(parts)
        ]
        hosts += ["".join(host) for host in itertools.product(*choices)]
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    """'001-003,007' -> 001, 002, 003, 007: the inside of one pair of brackets."""
    numbers = []
    for piece in ranges.split(","):
        low, _, high = piece.partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise UsageError(
                f"cannot read {piece!r} in the SLURM node list {nodelist!r}; set MASTER_ADDR"
            )
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return numbers


def master_port_for_job(job_id: str) -> int:
    return JOB_PORTS[int(job_id) % len(JOB_PORTS)]


def rendezvous(env=os.environ) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT: the environment's (torchrun's, or the user's), else derived
    from the SLURM job: task 0 runs on the first node of its step, so that node hosts the store."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1"
    if env.get("MASTER_PORT"):
        port = env_int(env, "MASTER_PORT")
    elif env.get("SLURM_JOB_ID", "").isdigit():
        port = master_port_for_job(env["SLURM_JOB_ID"])
    else:
        port = DEFAULT_PORT
    return addr, port


def rendezvous_text(world_size: int) -> str:
    """Where the ranks meet, for the [CONFIG] line: host:port, or none for a world of one."""
    if world_size == 1:
        return "none"  # a world of one meets nobody
    return "{}:{}".format(*rendezvous())


def network_warning(nodes: int, backend: str, environ=os.environ) -> str | None:
    """Across nodes, NCCL outside CSCS's container has no Slingshot plugin and falls back to
    TCP sockets without a word: a scaling study would then measure TCP."""
    if nodes > 1 and backend == "nccl" and not environ.get("NCCL_NET"):
        return (
            "warning: NCCL across nodes without NCCL_NET: without the network plugin it "
            "falls back to TCP sockets; run in the container (EDF=$PWD/edf.toml sbatch "
            'run.sh), which sets NCCL_NET="AWS Libfabric" and fails if the plugin is '
            "missing"
        )
    return None


# Variables through which a launcher gives this process GPUs (SLURM also sets
# CUDA_VISIBLE_DEVICES, but a container or a user may clear it); "" or -1 hide every GPU.
GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE")


def given_gpus(env=os.environ) -> str | None:
    """'NAME=value' of the first variable saying this process was given GPUs, else None."""
    for name in GPU_VARIABLES:
        value = env.get(name, "").strip()
        none = ("", "-1", "NoDevFiles", *(("0",) if name == "SLURM_GPUS_ON_NODE" else ()))
        if value not in none:
            return f"{name}={value}"
    return None


# The backend that carries each device type's tensors.
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# A process group on GPUs: each device type's tensors to its own backend ("cpu:gloo,cuda:nccl").
GPU_GROUP_BACKEND = ",".join(f"{kind}:{name}" for kind, name in BACKENDS.items())


def check_torch(version: str | None = None) -> None:
    """Refuse a torch (this one: torch.__version__) older than OLDEST_TORCH in one line, by its
    release alone: NVIDIA's NGC containers carry builds such as 2.10.0a0+b4e4ee81d3."""
    version = version or torch.__version__
    if release(version) < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        raise UsageError(
            f"torch {version} is older than {oldest}, the oldest this project runs on: "
            f"install requirements.txt (make install), or run in a container with torch {oldest} "
            "or newer (edf.toml's, on CSCS Alps)"
        )


def pick_device(local_rank: int, wanted: str = "auto", env=os.environ) -> tuple[torch.device, str]:
    """The device and backend of this rank. `auto` takes a GPU where torch sees one and the
    CPU otherwise, but never silently where GPUs were given to the job and torch cannot see
    them (a CPU-only build, no driver in the container): that would train on the CPU for hours."""
    if wanted == "cpu":
        return torch.device("cpu"), BACKENDS["cpu"]
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), BACKENDS["cuda"]
    given = given_gpus(env)
    if wanted == "cuda" or given:
        why = f"{given} gives this process GPUs" if given else "--device cuda asks for a GPU"
        build = (
            "a CPU-only build of torch: install a CUDA build (on CSCS Alps, run in the "
            "container: EDF=...)"
            if torch.version.cuda is None
            else "no GPU visible to it: check nvidia-smi, and the container's GPU hooks"
        )
        raise UsageError(
            f"{why}, but torch {torch.__version__} sees none ({build}); "
            "--device cpu trains on the CPU on purpose"
        )
    return torch.device("cpu"), BACKENDS["cpu"]


def check_device(wanted: str) -> tuple[torch.device, str]:
    """For `main.py --check`: the device the run would take here, or a GPU assumed for
    `--device cuda` checked without one (a login node planning a sweep)."""
    if wanted == "cuda" and not torch.cuda.is_available():
        return torch.device("cuda"), "cuda (no GPU here: bf16 support not checked)"
    device, _ = pick_device(0, wanted)
    return device, device.type


def shared_gpus(owners: list[str]) -> str | None:
    """owners[rank] = 'host GPU-uuid': which ranks would drive one GPU together, or None."""
    ranks_of: dict[str, list[str]] = {}
    for rank, owner in enumerate(owners):
        ranks_of.setdefault(owner, []).append(str(rank))
    for owner, ranks in ranks_of.items():
        if len(ranks) > 1:
            return (
                f"ranks {', '.join(ranks)} would share one GPU ({owner}; NCCL refuses that): "
                "start one task per GPU (--ntasks-per-node = GPUs per node, or "
                "--gpus-per-task=1)"
            )
    return None


def refuse_shared_gpus(store, rank: int, world_size: int, device: torch.device) -> None:
    """Every rank publishes its GPU at the store and reads all of them, before NCCL starts: a
    missing LOCAL_RANK or more tasks than GPUs on a node is one clear line, not NCCL's
    "Duplicate GPU detected" in the first collective."""
    store = dist.PrefixStore("gpus", store)
    uuid = torch.cuda.get_device_properties(device).uuid
    store.set(str(rank), f"{socket.gethostname()} GPU {uuid}")
    owners = [v.decode() for v in store.multi_get([str(r) for r in range(world_size)])]
    clash = shared_gpus(owners)
    if clash:
        raise UsageError(clash)


# Waiting for rank 0's one-off work (a 170 MB download) is not a hung peer: a CPU group of its
# own with a long timeout (on NCCL, off the GPU, whose watchdog would abort after --pg-timeout).
HANDSHAKE_TIMEOUT_S = 3600.0
_handshake_group = None
_timeout = datetime.timedelta(seconds=300)  # the run's --pg-timeout, for every group we make
# Tests only (tests/dist_harness.py sets it in its spawned ranks; no option or variable does):
# ranks on one GPU, with gloo carrying the CUDA tensors that NCCL would refuse to share.
SHARE_ONE_GPU = False


# NCCL's flight recorder: every rank keeps its last collectives in a ring buffer and, when one
# times out, writes them to FLIGHT_RECORDER_DIR/<job>_rank<N>, so that a hang's dump says which
# collective each rank had entered (python -m torch.distributed.flight_recorder.fr_trace FOLDER).
FLIGHT_RECORDER_DIR = LOGS_DIR / "nccl-trace"
# The ring buffer's size, under the name torch reads since 2.9: the old name still works but
# makes every rank warn twice that it is deprecated. A job that set either keeps its own.
FR_BUFFER_SIZE, FR_BUFFER_SIZE_OLD, FR_BUFFER_SIZE_SINCE = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    (2, 9),
)


def turn_on_flight_recorder(folder: Path = FLIGHT_RECORDER_DIR) -> None:
    """Before NCCL starts: the flight recorder's settings, where the job has not set its own."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(folder.resolve() / f"{job_id()}_rank"),
    }
    if FR_BUFFER_SIZE_OLD not in os.environ:  # else the job's own size, under the old name
        settings[FR_BUFFER_SIZE] = "2000"
    for name, value in settings.items():
        os.environ.setdefault(name, value)


def setup(timeout_s: float = 300.0, device: str = "auto") -> DistEnv:
    """Join (or, alone, create) the process group and bind this process to its device.

    A world of one still gets a process group (DDP and FSDP need one), from an in-memory store:
    no port is opened for nobody. Otherwise rank 0 hosts the store at rendezvous() (under
    torchrun its agent already does, and every rank is a client).
    """
    global _handshake_group, _timeout
    # What is imported by now lives as long as the process: frozen, the collector (off while
    # main.py imported, back on here) scans only what the run made, not torch's modules (0.15 s
    # a collection). Thawed at exit: triton (nanobind) checks then that its objects were freed.
    gc.freeze()
    atexit.register(gc.unfreeze)
    gc.enable()
    # exercise 2.1 begin
    rank, local_rank, world_size = read_ranks()
    device, backend = pick_device(local_rank, wanted=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        turn_on_flight_recorder()
    # exercise 2.1 end
    timeout = _timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1:
        store = dist.HashStore()
    else:
        addr, port = rendezvous()
        store, _, _ = next(
            dist.rendezvous(
                f"tcp://{addr}:{port}", rank=rank, world_size=world_size, timeout=timeout
            )
        )
        if device.type == "cuda" and not SHARE_ONE_GPU:
            refuse_shared_gpus(store, rank, world_size, device)
        peer_failures.start_pulse(store, rank, addr)
    if SHARE_ONE_GPU:
        backend = groups_backend = "gloo"
    else:
        # On GPUs, NCCL for CUDA tensors and gloo for the CPU tensors that FSDP's --cpu-offload
        # leaves to collectives (gradient norms, fp16's inf checks): NCCL alone refuses them.
        groups_backend = GPU_GROUP_BACKEND if device.type == "cuda" else backend
    # The store serves the GPU check, the pulse and the check-in too, each under its own prefix.
    group_store = dist.PrefixStore("default_pg", store)
    # exercise 2.1 begin
    dist.init_process_group(
        groups_backend,
        store=group_store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    # exercise 2.1 end
    if world_size > 1:
        _handshake_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=HANDSHAKE_TIMEOUT_S)
        )
        # Every rank has met, its pulse answering: from here a peer that dies ends this rank
        # within --pg-timeout, even a main thread that no collective's timeout would wake.
        peer_failures.watch(timeout_s)
    return DistEnv(rank, local_rank, world_size, device, backend)


def subgroups(rank_lists: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group of a partition of the ranks (every rank calls it with the same lists),
    with the run's --pg-timeout: torch's own subgroups (a device mesh's) would get the backend's
    default, 10 minutes for NCCL, 30 for gloo, whatever --pg-timeout says."""
    group, _ = dist.new_subgroups_by_enumeration(rank_lists, timeout=_timeout)
    return group


def cleanup(failed: bool = False) -> None:
    """Destroy the process groups while the interpreter is fully alive; after a peer failed,
    abort them first (NCCL's work queued towards a dead peer never completes).

    A group's C++ side dies with its last Python reference: a reference cycle would postpone
    that to the interpreter's teardown, where gloo's threads end unjoined (SIGABRT after all
    the work was done), so the cycles are collected first. The pulse stops before, telling the
    peers (unless this rank failed) that it leaves, not dies.
    """
    global _handshake_group
    peer_failures.leave(cleanly=not failed)
    if dist.is_initialized():
        gc.collect()
        if failed:
            dist.group.WORLD.abort()
        _handshake_group = None
        dist.destroy_process_group()
        gc.collect()


def barrier() -> None:
    """Wait for every rank; nothing to wait for in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def on_rank0(fn, *args):
    """Run fn on rank 0 alone and hand its result, or its UsageError, to every rank (download,
    create folders): a failure ends every rank with rank 0's message instead of a hang. The
    others wait up to HANDSHAKE_TIMEOUT_S, not --pg-timeout: a download takes minutes.
    """
    outcome = [None]
    if not dist.is_initialized() or is_rank_zero():
        try:
            outcome = [("ok", fn(*args))]
        except UsageError as e:
            outcome = [("error", str(e))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0, group=_handshake_group)
    status, value = outcome[0]
    if status == "error":
        raise UsageError(value)
    return value


def num_nodes(env=os.environ) -> int:
    """Nodes taking part: SLURM's count, else torchrun's ratio of world to local world size."""
    if "SLURM_JOB_NUM_NODES" in env and "SLURM_STEP_ID" in env:
        return int(env.get("SLURM_STEP_NUM_NODES", env["SLURM_JOB_NUM_NODES"]))
    world, local = int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", 0) or 0)
    return max(1, world // local) if local else 1
