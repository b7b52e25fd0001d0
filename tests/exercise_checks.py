"""The checks of EXERCISES.md's parts to complete: `make check EX=2.1` runs the tests named
test_ex2_1_*, `make check` all of them, one line for each failure saying what is wrong, but
not the code that would be right.

Each exercise's tests run its own code alone, so that a part passes once it is right whatever
the others' state: the multi-rank ones join a plain gloo group (dist_harness.spawn(plain=True))
unless the set-up is what they test, and stand-ins take the other exercises' places. They run
on a laptop's CPU: what a part does on a GPU node is seen through stand-ins too (torch told
that there are GPUs, the calls that would need one noted instead of made), so the checks look
at how a part works, not only at what comes out on a CPU. Not collected by `make test` (its
name): tests/test_exercise.py runs them on the solution, the student's copy and planted mistakes.
"""

import inspect
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data
import dataset_files
import ddp_utils
import distributed_utils
import fsdp_utils
import main
import peer_failures
import strategies
from checkpoint import Position
from config import Config
from cost_model import ModelFlops
from dist_harness import in_fresh_process, spawn, spawn_outcomes
from helpers import write_cifar_dir
from measure import EpochMeters, MemoryMeter
from model import build_model
from precision import Precision
from train import Trainer

CPU = torch.device("cpu")
FSDP_DTYPES = ("param_dtype", "reduce_dtype", "buffer_dtype")  # of its mixed precision
ALONE = distributed_utils.DistEnv(0, 0, 1, CPU, "gloo")
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # the variables torchrun sets for a rank

# ----------------------------------------------------------------------------- 2.1 the set-up


def what_setup_made(env) -> dict:
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total)
    return {
        "env": (env.rank, env.local_rank, env.world_size),
        "launcher": tuple(int(os.environ[name]) for name in LAUNCHER),
        "group": (dist.get_rank(), dist.get_world_size()),
        "device": str(env.device),
        "sum": total.item(),
    }


def test_ex2_1_each_rank_joins_as_the_launcher_says():
    for rank, made in enumerate(spawn(what_setup_made, 2, timeout=120)):
        env, launcher, group = made["env"], made["launcher"], made["group"]
        assert env[0] == launcher[0], (
            f"rank {rank} calls itself rank {env[0]}: is the rank read from the launcher's "
            "variables (utils.read_ranks)?"
        )
        assert env[1] == launcher[1], f"rank {rank}'s local rank is {env[1]}, not {launcher[1]}"
        assert env[2] == launcher[2], f"rank {rank} sees a world of {env[2]}, not {launcher[2]}"
        assert group == (rank, 2), (
            f"the process group has rank {rank} as {group[0]} of {group[1]}: is the group "
            "told this rank and the world size?"
        )
        assert made["device"] == "cpu", f"rank {rank} runs on {made['device']}, on a CPU"
        assert made["sum"] == 3.0, f"an all-reduce of 1 and 2 over the group gives {made['sum']}"


def without(*variables: str) -> None:
    """This process as one started by hand: none of a launcher's `variables`."""
    for name in variables:
        os.environ.pop(name, None)


def setup_alone() -> tuple:
    without(*LAUNCHER)
    env = distributed_utils.setup(timeout_s=30)
    try:
        return env.rank, env.world_size, dist.is_initialized() and dist.get_world_size()
    finally:
        distributed_utils.cleanup()


def test_ex2_1_alone_a_world_of_one():
    rank, world_size, group_size = in_fresh_process(setup_alone, timeout=60)
    assert (rank, world_size) == (0, 1), f"alone, setup() says rank {rank} of {world_size}"
    assert group_size == 1, (
        "alone, setup() makes no process group of one: DDP and FSDP need one "
        "(is the group started also at world size 1?)"
    )


class GroupStarted(Exception):
    """Raised in place of starting the process group: setup() has done all it does before."""


def device_name(device) -> str | None:
    """A device as setup() may give it (a torch.device, a name, a GPU's index), as text."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return None if device is None else str(torch.device(device))


def group_as_noted(start, made_stores: dict, *args, **kwargs) -> dict:
    """What the process group was to start with: the arguments of `start` (torch's function
    that starts it), by name; of the store, only whether it is the one setup() made for it."""
    given = inspect.signature(start).bind(*args, **kwargs).arguments
    timeout, store = given.get("timeout"), given.get("store")
    return {
        "backend": given.get("backend"),
        "rank": given.get("rank"),
        "world_size": given.get("world_size"),
        # A timedelta's seconds; anything else as written (37 is no timeout).
        "timeout": f"{timeout.total_seconds():g} s"
        if isinstance(timeout, timedelta)
        else repr(timeout),
        "store": None if store is None else store is made_stores.get("default_pg"),
        "device_id": device_name(given.get("device_id")),
    }


def setup_on_a_node(variables: dict, gpus: int, device: str = "auto") -> list[tuple]:
    """What setup(timeout_s=37, device) does, in order, in a process that a launcher started
    with `variables`, on a node where torch sees `gpus` GPUs: stand-ins, none is here. No peer
    runs either: the store is one in memory, and the process group is not started but noted
    with what it was given, ("group", group_as_noted). ("failed", the error) where setup()
    raised."""
    done = []
    without(*LAUNCHER, *distributed_utils.GPU_VARIABLES)
    os.environ.update(variables)
    if gpus:
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: gpus
    torch.cuda.set_device = lambda gpu: done.append(("own GPU", device_name(gpu)))
    distributed_utils.turn_on_flight_recorder = lambda: done.append(("flight recorder", None))
    distributed_utils.refuse_shared_gpus = lambda *args: None
    peer_failures.start_pulse = lambda *args: None
    dist.rendezvous = lambda url, rank, world_size, **kw: iter(
        [(dist.HashStore(), rank, world_size)]
    )
    made_stores, prefix_store, start = {}, dist.PrefixStore, dist.init_process_group
    dist.PrefixStore = lambda prefix, store: made_stores.setdefault(
        prefix, prefix_store(prefix, store)
    )

    def note_the_group(*args, **kwargs):
        done.append(("group", group_as_noted(start, made_stores, *args, **kwargs)))
        raise GroupStarted

    dist.init_process_group = note_the_group
    try:
        distributed_utils.setup(timeout_s=37, device=device)
    except GroupStarted:
        pass
    except Exception as e:
        done.append(("failed", f"{type(e).__name__}: {e}".splitlines()[0]))
    return done


def noted(done: list[tuple], what: str) -> list:
    return [value for name, value in done if name == what]


# Launched by srun on GPU nodes: its variables, the GPUs torch sees, the GPU the rank's is.
ON_GPU_NODES = [
    # Its third task of four, the second of a node of 2 GPUs.
    (dict(SLURM_PROCID="2", SLURM_LOCALID="1", SLURM_NTASKS="4"), 2, "cuda:1"),
    # Its fourth, with --gpus-per-task=1: the second task of its node sees its own GPU only.
    (dict(SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NTASKS="4"), 1, "cuda:0"),
]
A_STEP = dict(SLURM_STEP_ID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


@pytest.mark.parametrize("variables, gpus, gpu", ON_GPU_NODES)
def test_ex2_1_a_rank_on_a_node_of_gpus(variables, gpus, gpu):
    done = in_fresh_process(setup_on_a_node, {**variables, **A_STEP}, gpus, timeout=60)
    who = (
        f"srun's rank {variables['SLURM_PROCID']} of 4, local rank 1 on a node where it sees "
        f"{gpus} GPU{'s' * (gpus > 1)},"
    )
    assert not noted(done, "failed"), f"{who} fails in setup(): {noted(done, 'failed')[0]}"
    own, groups = noted(done, "own GPU"), noted(done, "group")
    assert groups, f"{who} starts no process group"
    assert own, f"{who} does not make its GPU this process's own"
    assert own == [gpu], f"{who} makes {', '.join(own)} its own, not {gpu}"
    names = [name for name, _ in done]
    assert "flight recorder" in names[: names.index("group")], (
        f"{who} does not turn on NCCL's flight recorder before its group starts"
    )
    group = groups[0]
    rank = int(variables["SLURM_PROCID"])
    assert (group["rank"], group["world_size"]) == (rank, 4), (
        f"{who} joins the group as rank {group['rank']} of {group['world_size']}"
    )
    assert group["backend"] == distributed_utils.GPU_GROUP_BACKEND, (
        f"{who} starts its group with the backend {group['backend']!r}: on GPUs the group "
        "must also carry the CPU tensors that --cpu-offload leaves to collectives"
    )
    assert group["store"] is not None, (
        f"{who} gives its group no store: the group would look for a rendezvous of its own"
    )
    assert group["store"], f"{who} gives its group another store than the one made for it"
    assert group["timeout"] == "37 s", (
        f"setup(timeout_s=37) starts the group with the timeout {group['timeout']}, not 37 s: "
        "--pg-timeout does not reach the group"
    )
    assert group["device_id"] == gpu, (
        f"{who} tells its group that its device is {group['device_id']}, not {gpu}"
    )


def test_ex2_1_the_device_asked_for():
    done = in_fresh_process(setup_on_a_node, {}, 1, "cpu", timeout=60)
    what = "--device cpu on a machine with a GPU:"
    assert not noted(done, "failed"), f"{what} setup() fails: {noted(done, 'failed')[0]}"
    assert noted(done, "group"), f"{what} setup() starts no process group"
    took = noted(done, "own GPU") or [noted(done, "group")[0]["device_id"]]
    assert took == [None], (
        f"{what} setup() takes {took[0]}: is the device asked for given to pick_device?"
    )
    backend = noted(done, "group")[0]["backend"]
    assert backend == "gloo", f"{what} the group starts with the backend {backend!r}"


# ----------------------------------------------------------------------------- 3.1 the data


def numbered(n: int) -> data.Split:
    """n images whose labels are their numbers: a loader's labels say which images it gave."""
    return data.Split(torch.zeros(n, 3, 32, 32, dtype=torch.uint8), torch.arange(n))


def rank_loaders(rank: int, seed: int = 0, train: int = 96, val: int = 40) -> data.Loaders:
    return data.build_loaders(
        numbered(train),
        numbered(val),
        data.DATASETS["synthetic"],
        kind="tensor",
        rank=rank,
        world_size=2,
        global_batch=16,
        seed=seed,
        augment=False,
        device=CPU,
    )


def epoch_of(loaders: data.Loaders, epoch: int) -> list[int]:
    loaders.set_position(epoch)
    return [int(i) for _, labels in loaders.train for i in labels]


def test_ex3_1_every_image_once_per_epoch_over_the_ranks():
    loaders = [rank_loaders(rank) for rank in (0, 1)]
    for epoch in (1, 2):
        seen = [epoch_of(rank, epoch) for rank in loaders]
        overlap = set(seen[0]) & set(seen[1])
        assert not overlap, (
            f"ranks see overlapping samples ({len(overlap)} of 96 in epoch {epoch}): is the "
            "sampler given the rank and the world size?"
        )
        assert sorted(seen[0] + seen[1]) == list(range(96)), (
            f"epoch {epoch} trains on {len(set(seen[0] + seen[1]))} of the 96 images"
        )
    val = [[int(i) for _, labels in rank.val for i in labels] for rank in loaders]
    assert sorted(val[0] + val[1]) == list(range(40)), (
        "the ranks' validation shards are not the validation set once: does the validation "
        "split have a distributed sampler too?"
    )


def test_ex3_1_a_new_order_every_epoch():
    loaders = rank_loaders(0)
    first, second = epoch_of(loaders, 1), epoch_of(loaders, 2)
    assert first != sorted(first), "the training images come in order: shuffle them"
    assert first != second, (
        "every epoch gives a rank the same images in the same order: is the training sampler "
        "told the epoch (set_epoch)?"
    )
    assert epoch_of(rank_loaders(1), 2) != epoch_of(rank_loaders(1), 1)
    assert epoch_of(rank_loaders(0, seed=1), 1) != first, (
        "--seed 1 shuffles the training images as --seed 0 does: the sampler does not get the "
        "run's seed"
    )


DOWNLOAD_S = 1.0  # how long the stand-in download takes: a rank that does not wait reads first


def download_then_load(env, root):
    def fake_download(data_dir):  # the real one needs internet
        (data_dir / f"downloaded_by_rank_{env.rank}").touch()
        time.sleep(DOWNLOAD_S)
        write_cifar_dir(data_dir)
        (data_dir / "downloaded").write_text(str(time.time()))

    dataset_files.download_cifar10 = fake_download
    try:
        train, val = data.load_files("cifar10", root, download=True)
    finally:
        (root / f"rank_{env.rank}_done").write_text(str(time.time()))
    return len(train), len(val)


def test_ex3_1_rank_0_alone_downloads_and_the_others_wait(tmp_path):
    outcomes = spawn_outcomes(download_then_load, 2, tmp_path, plain=True, timeout=120)
    # Who downloaded, before what failed: two ranks writing the same files fail too.
    downloaded = sorted(p.name for p in tmp_path.glob("downloaded_by_rank_*"))
    who = (
        f"{', '.join(downloaded) or 'no rank'} downloaded: rank 0 alone must, while the others "
        "wait (distributed_utils.on_rank0)"
    )
    assert len(downloaded) < 2, who
    ready = tmp_path / "downloaded"
    done = tmp_path / "rank_1_done"
    if downloaded and done.is_file():
        early = not ready.is_file() or float(done.read_text()) < float(ready.read_text())
        what = str(outcomes[1][1]).splitlines()[0]
        assert not early, (
            f"rank 1 is done with the data ({what}) before rank 0 has downloaded it: the other "
            "ranks do not wait for rank 0"
        )
    for rank, (status, value) in enumerate(outcomes):
        assert status == "ok", f"rank {rank}: {value}"
        assert value == (100, 30), f"rank {rank} loaded (train, val) = {value}, not (100, 30)"
    assert downloaded == ["downloaded_by_rank_0"], who


# ----------------------------------------------------------------------------- 4.1 DDP


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def batch_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of the batch's mean loss at the model's parameters as they are (left out
    of their .grad)."""
    return list(torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters())))


def ddp_gradients(env) -> dict:
    model = ddp_utils.get_ddp_model(tiny_model(), env.device)
    x, y = rank_batch(env.rank)
    F.cross_entropy(model(x), y).backward()
    return {
        "type": type(model).__name__,
        "grads": [p.grad.clone() for p in model.parameters()],
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def test_ex4_1_ddp_replicates_and_averages_gradients():
    results = spawn(ddp_gradients, 2, plain=True, timeout=120)
    assert results[0]["type"] == "DistributedDataParallel", (
        f"get_ddp_model returns a {results[0]['type']}, not a DistributedDataParallel"
    )
    whole = sum(p.numel() for p in tiny_model().parameters())
    assert results[0]["parameters"] == whole, "each rank must hold the whole model under DDP"
    expected = [batch_gradients(tiny_model(), *rank_batch(rank)) for rank in (0, 1)]
    for rank, result in enumerate(results):
        for got, g0, g1 in zip(result["grads"], *expected):
            assert torch.allclose(got, (g0 + g1) / 2, atol=1e-6), (
                f"rank {rank}'s gradients are not the mean of both ranks': are they reduced?"
            )


class BoundForAGpu(nn.Linear):
    """tiny_model, noting the GPU it is sent to: there is none here, so it stays where it is."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(4, 3)
        self.gpu = None

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (torch.device, str)) and torch.device(target).type == "cuda":
            self.gpu = device_name(target)
            return self
        return super().to(*args, **kwargs)

    def cuda(self, device=None):
        self.gpu = device_name(torch.cuda.current_device() if device is None else device)
        return self


DDP_INIT = torch.nn.parallel.DistributedDataParallel.__init__  # before a stand-in takes its place


class StandInDDP(nn.Module):
    """In DDP's place where it cannot run (no GPU here): what it was given, and where the
    model it wraps was then."""

    def __init__(self, module, *args, **kwargs):
        super().__init__()
        given = inspect.signature(DDP_INIT).bind(self, module, *args, **kwargs).arguments
        self.module, self.gpu_then = module, getattr(module, "gpu", None)
        self.device_ids = [device_name(d) for d in given.get("device_ids") or []] or None
        self.output_device = device_name(given.get("output_device"))

    def to(self, *args, **kwargs):
        self.module.to(*args, **kwargs)
        return self

    def cuda(self, device=None):
        self.module.cuda(device)
        return self


def test_ex4_1_ddp_on_a_gpu(monkeypatch):
    gpu = torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: gpu.index)  # setup()'s choice
    monkeypatch.setattr(ddp_utils, "DDP", StandInDDP)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", StandInDDP)
    monkeypatch.setattr(torch.nn.parallel.distributed, "DistributedDataParallel", StandInDDP)
    model = BoundForAGpu()
    wrapped = ddp_utils.get_ddp_model(model, gpu)
    where = "get_ddp_model(model, cuda:1)"
    assert isinstance(wrapped, StandInDDP), f"{where} returns a {type(wrapped).__name__}"
    assert wrapped.module is model, f"{where} wraps another model than the one given"
    moved_after = model.gpu == "cuda:1" and wrapped.gpu_then is None
    assert not moved_after, (
        f"{where} moves the model to its GPU after DDP wrapped it: DDP broadcasts the "
        "parameters and places its buckets where they are when it is made"
    )
    assert wrapped.gpu_then == "cuda:1", (
        f"{where} gives DDP a model whose parameters are on {wrapped.gpu_then or 'the CPU'}"
    )
    assert wrapped.device_ids in (None, ["cuda:1"]), (
        f"{where} tells DDP that the model is on {', '.join(wrapped.device_ids)}"
    )
    assert wrapped.output_device in (None, "cuda:1"), (
        f"{where} tells DDP to put the outputs on {wrapped.output_device}"
    )


# ----------------------------------------------------------------------------- 4.2 FSDP


def fsdp_made(env, runs: list[tuple]) -> list[dict]:
    """What get_fsdp_model makes of the CNN for each (sharding, precision, cpu_offload) of runs,
    on 2 ranks as one node of 2."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    made = []
    for sharding, precision, cpu_offload in runs:
        model = build_model("cnn")
        units = len(fsdp_utils.own_units(model))
        try:
            wrapped = fsdp_utils.get_fsdp_model(
                model, env.device, sharding, precision, cpu_offload, ranks_per_node=2
            )
        except RuntimeError as e:
            if "accelerator" not in str(e):
                raise
            raise AssertionError(f"{e}: is FSDP given the rank's device (on a CPU too)?") from None
        fsdp = isinstance(wrapped, FSDP)
        mixed = getattr(wrapped, "mixed_precision", None)
        dtypes = {kind: getattr(mixed, kind, None) for kind in FSDP_DTYPES}
        made.append(
            {
                "type": type(wrapped).__name__,
                "units": len(FSDP.fsdp_modules(wrapped)) - 1 if fsdp else None,
                "expected_units": units,
                "strategy": wrapped.sharding_strategy.name if fsdp else None,
                **{kind: str(dtype) if dtype else None for kind, dtype in dtypes.items()},
                "offload": fsdp and wrapped.cpu_offload.offload_params,
                "own_parameters": fsdp and wrapped._use_orig_params,
                "mesh": fsdp and wrapped._device_mesh is not None,
            }
        )
    return made


def test_ex4_2_fsdp_units_sharding_and_precision():
    runs = [("full", "bf16", False), ("grad_op", "fp32", True), ("hybrid", "fp16", False)]
    full, grad_op, hybrid = spawn(fsdp_made, 2, runs, plain=True, timeout=120)[0]
    assert full["type"] == "FullyShardedDataParallel", (
        f"get_fsdp_model returns a {full['type']}, not a FullyShardedDataParallel"
    )
    assert full["units"] == full["expected_units"], (
        f"{full['units']} FSDP units inside the root, not one for each of the model's "
        f"{full['expected_units']} own_units(): is the wrap policy given?"
    )
    assert full["strategy"] == "FULL_SHARD", f"--sharding full runs {full['strategy']}"
    assert (full["param_dtype"], full["reduce_dtype"]) == ("torch.bfloat16", "torch.float32"), (
        f"bf16 computes in {full['param_dtype']} and reduces the gradients in "
        f"{full['reduce_dtype']}, not in bf16 and in fp32"
    )
    assert full["buffer_dtype"] == full["param_dtype"], (
        f"bf16 keeps the buffers in {full['buffer_dtype']}: not in the compute dtype"
    )
    assert full["own_parameters"], (
        "the optimizer and torch.compile see FSDP's flat parameters, not the model's own"
    )
    assert grad_op["strategy"] == "SHARD_GRAD_OP", (
        f"--sharding grad_op runs {grad_op['strategy']}: not the sharding asked for"
    )
    assert grad_op["param_dtype"] is None, (
        f"fp32 computes in {grad_op['param_dtype']}: mixed precision only with a low dtype"
    )
    assert grad_op["offload"], "--cpu-offload keeps the parameters on the device"
    assert hybrid["param_dtype"] == "torch.float16", (
        f"fp16 computes in {hybrid['param_dtype']}: not the precision asked for"
    )
    assert hybrid["strategy"] == "HYBRID_SHARD" and hybrid["mesh"], (
        f"--sharding hybrid runs {hybrid['strategy']}, mesh given: {hybrid['mesh']}: hybrid "
        "sharding needs the two-dimensional mesh of the nodes and their ranks"
    )


# ----------------------------------------------------------------------------- 5.1 main.py


class TrainingFailed(Exception):
    pass


class Calls:
    """Stand-ins for setup, session.run and cleanup that note the order they are called in."""

    def __init__(self, monkeypatch, fail: bool = False):
        import session

        self.log, self.env = [], ALONE
        monkeypatch.setattr(distributed_utils, "setup", self.setup)
        monkeypatch.setattr(distributed_utils, "cleanup", self.cleanup)
        monkeypatch.setattr(session, "run", self.run)
        monkeypatch.setattr(main, "report", lambda outcome, epochs, argv: 0)
        self.fail = fail

    def setup(self, timeout_s=300.0, device="auto"):
        self.log.append(("setup", timeout_s, device))
        return self.env

    def run(self, cfg, env):
        self.log.append(("run", env is self.env))
        if self.fail:
            raise TrainingFailed("a failure in training")
        return None

    def cleanup(self, failed=False):
        self.log.append(("cleanup", failed))


def test_ex5_1_main_sets_up_trains_and_cleans_up(monkeypatch):
    calls = Calls(monkeypatch)
    cfg = Config(pg_timeout=42.0, device="cpu")
    main.train(cfg, [])
    names = [call[0] for call in calls.log]
    assert names == ["setup", "run", "cleanup"], (
        f"main.train calls {' then '.join(names) or 'nothing'}: set up, train, clean up"
    )
    assert calls.log[0][1:] == (42.0, "cpu"), (
        f"--pg-timeout 42 --device cpu: setup gets {calls.log[0][1:]}: the run's options do "
        "not reach it"
    )
    assert calls.log[1][1], "session.run must get the DistEnv that setup returned"
    assert calls.log[2] == ("cleanup", False), (
        "after a run that succeeded, cleanup is told that it failed: it would abort the group"
    )


def test_ex5_1_cleanup_also_after_a_failure(monkeypatch):
    calls = Calls(monkeypatch, fail=True)
    with pytest.raises(TrainingFailed):
        main.train(Config(device="cpu"), [])
    assert ("cleanup", True) in calls.log, (
        f"after a failure in training main.train calls {calls.log}: cleanup must run then "
        "too, told that the run failed"
    )


class Wrapped(nn.Module):
    """What a stand-in wrapper returns: the model it was given, inside."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model


# Options of --strategy fsdp that are none of their defaults, on 2 nodes of 2 ranks.
FSDP_OPTIONS = dict(sharding="grad_op", precision="bf16", cpu_offload=True)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ex5_1_the_strategy_chooses_the_wrapper(monkeypatch, strategy):
    given = {}
    for name, real in (("ddp", ddp_utils.get_ddp_model), ("fsdp", fsdp_utils.get_fsdp_model)):

        def stand_in(model, *args, name=name, real=real, **kwargs):
            given[name] = inspect.signature(real).bind(model, *args, **kwargs)
            given[name].apply_defaults()
            return Wrapped(model)

        monkeypatch.setattr(strategies, f"get_{name}_model", stand_in)
    model = tiny_model()
    cfg = Config(strategy=strategy, **FSDP_OPTIONS)
    trained = strategies.wrap_model(cfg, model, CPU, rank=0, world_size=4, nodes=2)
    assert list(given) == [strategy], (
        f"--strategy {strategy} wraps the model with {' and '.join(given) or 'nothing'}"
    )
    arguments = given[strategy].arguments
    assert arguments["model"] is model and arguments["device"] == CPU, (
        f"--strategy {strategy} wraps another model or device than the ones given"
    )
    assert isinstance(trained, Wrapped) and trained.module is model, (
        f"--strategy {strategy} trains the model unwrapped: the wrapper's result is dropped"
    )
    if strategy == "fsdp":
        options = {k: arguments[k] for k in (*FSDP_OPTIONS, "ranks_per_node")}
        expected = {**FSDP_OPTIONS, "ranks_per_node": 2}
        assert options == expected, (
            f"--sharding grad_op --precision bf16 --cpu-offload on 2 nodes of 2 ranks: FSDP "
            f"gets {options}: the run's options do not reach it"
        )


# ----------------------------------------------------------------------------- 6.1 training


class Recorder(nn.Module):
    """A linear model that notes its mode (training or not) at every forward."""

    def __init__(self):
        super().__init__()
        self.linear = tiny_model()
        self.seen = []

    def forward(self, x):
        self.seen.append(self.training)
        return self.linear(x)


class Batches(list):
    batch_size = 8


class StandInLoaders:
    """What the trainer asks of data.Loaders (exercise 3.1's), over fixed batches."""

    def __init__(self, rank: int, world_size: int, val_size: int):
        self.train = Batches([rank_batch(rank)])
        # Rank r validates the images r, r + W, ...: as the distributed sampler deals them.
        x, y = validation_set(val_size)
        self.val = Batches([(x[rank::world_size], y[rank::world_size])])
        self.val_size = val_size

    def set_position(self, epoch: int, step: int = 0) -> None:
        pass


def validation_set(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


class WatchedSGD(torch.optim.SGD):
    """SGD that keeps the gradients each of its steps was given."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.given = []

    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.given.append([None if p.grad is None else p.grad.clone() for p in params])
        return super().step(closure)


LR = 0.1


def trainer(model: nn.Module, env=ALONE, val_size: int = 10, **learner) -> Trainer:
    """A Trainer of model on stand-in loaders, with WatchedSGD, in fp32 unless `learner` gives
    another precision (or grad_accum)."""
    learner.setdefault("precision", Precision(None, torch.amp.GradScaler("cpu", enabled=False)))
    return Trainer(
        model=model,
        optimizer=WatchedSGD(model.parameters(), lr=LR),
        env=env,
        loaders=StandInLoaders(env.rank, env.world_size, val_size),
        meters=EpochMeters(
            memory=MemoryMeter(env.device),
            flops=ModelFlops(per_image=0, devices=1, peak_tflops=None),
        ),
        print_every=1000,
        **learner,
    )


def close(got: list[torch.Tensor | None], wanted: list[torch.Tensor]) -> bool:
    return all(g is not None and torch.allclose(g, w, atol=1e-6) for g, w in zip(got, wanted))


class OffGradients(AssertionError):
    """The optimizer stepped on other gradients than the batch's."""

    def __init__(self, what: str, got: list[torch.Tensor], wanted: list[torch.Tensor]):
        self.got, self.wanted = got, wanted
        # got as a multiple of wanted (its projection on them): 2 for gradients twice too large
        dot = sum((g * w).sum() for g, w in zip(got, wanted))
        self.times = float(dot / sum((w * w).sum() for w in wanted))
        super().__init__(f"{what}: the optimizer steps on {self.times:.4g} times its gradients")

    def near(self, factor: float) -> bool:
        return abs(self.times - factor) < 1e-3 * factor

    def because(self, why: str) -> AssertionError:
        return AssertionError(f"{self}: {why}")


def one_step(run: Trainer, x: torch.Tensor, y: torch.Tensor, what: str) -> list[torch.Tensor]:
    """run.step on the batch (x, y), checked to be one optimizer step on the batch's gradients
    (else OffGradients, or an AssertionError saying how it failed); returns those gradients."""
    wanted = batch_gradients(run.model, x, y)
    before = [p.detach().clone() for p in run.model.parameters()]
    steps = len(run.optimizer.given)
    try:
        run.step(x, y, torch.zeros(()))
    except NotImplementedError:  # a stub: its own line says which exercise
        raise
    except Exception as e:
        raise AssertionError(f"{what} fails: {type(e).__name__}: {e}".splitlines()[0]) from None
    taken = len(run.optimizer.given) - steps
    assert taken == 1, f"{what} takes {taken} optimizer steps, not one"
    got = run.optimizer.given[-1]
    assert all(g is not None for g in got), f"{what}: the optimizer steps without gradients"
    if not close(got, wanted):
        raise OffGradients(what, got, wanted)
    after = [b - LR * w for b, w in zip(before, wanted)]
    assert close(list(run.model.parameters()), after), f"{what} is not one SGD step"
    return wanted


def test_ex6_1_a_step_is_one_optimizer_step_on_the_batchs_gradients():
    run = trainer(tiny_model())
    first = one_step(run, *rank_batch(0), "step 1")
    try:
        one_step(run, *rank_batch(1), "step 2")
    except OffGradients as e:
        if close(e.got, [a + b for a, b in zip(first, e.wanted)]):
            raise e.because("step 1's are still in them: nothing clears them in between") from None
        raise


SCALE = 2.0**10  # the loss scaler's first scale: far from 1, so that a missed factor shows


class WatchedScaler(torch.amp.GradScaler):
    """fp16's loss scaler (it works on a CPU too), noting what a step asks of it. Its scale
    doubles at every step without overflow (growth_interval=1): an update shows."""

    def __init__(self):
        super().__init__("cpu", init_scale=SCALE, growth_interval=1)
        self.calls = []

    def scale(self, outputs):
        self.calls.append("scale")
        return super().scale(outputs)

    def step(self, optimizer, *args, **kwargs):
        self.calls.append("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls.append("update")
        return super().update(new_scale)


def test_ex6_1_the_loss_scaler_scales_steps_and_updates():
    scaler = WatchedScaler()
    run = trainer(tiny_model(), precision=Precision(None, scaler))
    for step in (1, 2):
        what = f"with fp16's loss scaler on (scale {scaler.get_scale():g}), step {step}"
        scaler.calls.clear()
        stepped = len(run.optimizer.given)
        try:
            one_step(run, *rank_batch(step), what)
            failure = None
        except AssertionError as e:
            failure = e
        calls = scaler.calls
        assert "scale" in calls, f"{what}: the scaler scales no loss: backward runs unscaled"
        if "step" in calls:
            assert "update" in calls[calls.index("step") :], (
                f"{what}: the scaler's scale is never updated after its step"
            )
        else:
            assert len(run.optimizer.given) == stepped, (
                f"{what}: the optimizer steps past the scaler, which would unscale the "
                "gradients and skip a step that overflowed"
            )
            assert "update" not in calls, f"{what}: the scaler is updated before it steps"
        if isinstance(failure, OffGradients) and failure.near(1 / SCALE):
            raise failure.because(
                "the scaler unscaled the gradients of a loss it did not scale"
            ) from None
        if failure:
            raise failure
        assert scaler.get_scale() == SCALE * 2**step, (
            f"{what}: the scale is {scaler.get_scale():g} after a step without overflow, not "
            f"{SCALE * 2**step:g}: the scaler's scale is not updated once a step"
        )


def test_ex6_1_micro_batches_add_up_to_the_batch():
    run = trainer(tiny_model(), grad_accum=2)
    x, y = rank_batch(0)
    last = [g / 2 for g in batch_gradients(run.model, x[4:], y[4:])]  # its share: half
    try:
        one_step(run, x, y, "a step of 2 micro-batches")
    except OffGradients as e:
        if e.near(2):
            raise e.because("each micro-batch's mean loss counts as much as the batch's") from None
        if close(e.got, last):
            raise e.because("the last micro-batch's alone: the first's are cleared") from None
        raise


def modes_seen(env) -> tuple[list, list]:
    """The model's modes at the forwards of a validation, then of the next epoch's training."""
    model = Recorder()
    run = trainer(model, env)
    run.evaluate()
    validating = list(model.seen)
    model.seen.clear()
    run.train_epoch(Position(epoch=1))
    return validating, model.seen


def test_ex6_1_validation_in_eval_mode_then_back_to_training():
    # In a group of one rank, as the program always runs: collectives may be called directly.
    validating, training = spawn(modes_seen, 1, plain=True, timeout=120)[0]
    assert validating and not any(validating), (
        "the model validates in training mode: dropout and batch norm would act as in training"
    )
    assert training and all(training), (
        "after validation the next epoch trains in evaluation mode: nothing puts the model "
        "back in training mode"
    )


def validate_on_rank(env) -> dict:
    run = trainer(tiny_model(), env)
    try:
        return run.evaluate()
    except AssertionError:  # evaluate's own check: the count is not the validation set's
        return {"counted": "not all"}


def test_ex6_1_validation_counts_every_image_once_over_the_ranks():
    results = spawn(validate_on_rank, 2, plain=True, timeout=120)
    model = tiny_model()
    x, y = validation_set(10)
    with torch.no_grad():
        logits = model(x)
    loss = F.cross_entropy(logits, y).item()
    correct = int((logits.argmax(1) == y).sum())
    for rank, got in enumerate(results):
        assert "counted" not in got, (
            f"rank {rank} counted only its own share of the 10 validation images: are the "
            "validation sums all-reduced over the ranks?"
        )
        assert got["val_correct"] == correct and abs(got["val_loss"] - loss) < 1e-5, (
            f"rank {rank} reports {got['val_correct']} correct and loss {got['val_loss']:.6f}, "
            f"one process {correct} and {loss:.6f}"
        )


# ----------------------------------------------------------------------------- the report

# make check loads this module as a plugin too (-p exercise_checks): these hooks print each
# failure as one line, the exercise, the test and what is wrong, in place of pytest's report.


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None:
        error = call.excinfo.value
        what = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if not isinstance(error, AssertionError):
            what = f"{type(error).__name__}: {what}"
        number = item.name.removeprefix("test_ex").split("_", 2)
        item.config.exercise_failures.append(
            f"exercise {number[0]}.{number[1]}: {item.name}: {what}"
        )
    return report


def pytest_configure(config):
    config.exercise_failures = []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in config.exercise_failures:
        terminalreporter.write_line(f"FAILED {line}")
