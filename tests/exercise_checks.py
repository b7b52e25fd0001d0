"""The checks of EXERCISES.md's parts to complete: `make check EX=2.1` runs the tests named
test_ex2_1_*, `make check` all of them, one line for each failure saying what is wrong.

Each exercise's tests run its own code alone: the multi-rank ones join a plain gloo group
(dist_harness.spawn(plain=True)) unless the set-up is what they test, and stand-ins take the
place of the other exercises' functions, so that a part passes once it is right whatever the
others' state. They run on the CPU, on a laptop: no GPU, no SLURM. Not collected by `make test`
(its name): tests/test_exercise.py runs them on the solution and on the student's copy.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data
import dataset_files
import distributed_utils
import main
import strategies
from checkpoint import Position
from config import Config
from ddp_utils import get_ddp_model
from dist_harness import in_fresh_process, spawn, spawn_outcomes
from fsdp_utils import get_fsdp_model, own_units
from helpers import write_cifar_dir
from measure import MemoryMeter
from mfu import ModelFlops
from model import build_model
from precision import Precision
from train import Trainer

CPU = torch.device("cpu")

# ----------------------------------------------------------------------------- 2.1 the set-up


def what_setup_made(env) -> dict:
    launcher = {name: int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total)
    return {
        "env": (env.rank, env.local_rank, env.world_size),
        "launcher": (launcher["RANK"], launcher["LOCAL_RANK"], launcher["WORLD_SIZE"]),
        "group": (dist.get_rank(), dist.get_world_size()),
        "device": str(env.device),
        "expected_device": str(distributed_utils.pick_device(env.local_rank)[0]),
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
            f"the process group has rank {rank} as {group[0]} of {group[1]}: is "
            "init_process_group given this rank and the world size?"
        )
        assert made["device"] == made["expected_device"], (
            f"rank {rank} runs on {made['device']}: pick_device(local_rank) says "
            f"{made['expected_device']}"
        )
        assert made["sum"] == 3.0, f"an all-reduce of 1 and 2 over the group gives {made['sum']}"


def without_launcher() -> None:
    """This process as one started by hand: no launcher's rank variables."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)


def setup_alone() -> tuple:
    without_launcher()
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
        "(is init_process_group called also at world size 1?)"
    )


def setup_asked_for_the_cpu() -> str:
    """setup(device="cpu") where torch sees a GPU (a stand-in: none is here): the device it chose,
    or what failed."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    without_launcher()
    try:
        env = distributed_utils.setup(timeout_s=30, device="cpu")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    try:
        return str(env.device)
    finally:
        distributed_utils.cleanup()


def test_ex2_1_the_device_asked_for():
    device = in_fresh_process(setup_asked_for_the_cpu, timeout=60)
    assert device == "cpu", (
        f"--device cpu on a machine with a GPU: {device}: is pick_device given the device asked "
        "for (wanted=device)?"
    )


# ----------------------------------------------------------------------------- 3.1 the data


def numbered(n: int) -> data.Split:
    """n images whose labels are their numbers: a loader's labels say which images it gave."""
    return data.Split(torch.zeros(n, 3, 32, 32, dtype=torch.uint8), torch.arange(n))


def rank_loaders(rank: int, train: int = 96, val: int = 40) -> data.Loaders:
    return data.build_loaders(
        numbered(train),
        numbered(val),
        data.DATASETS["synthetic"],
        kind="tensor",
        rank=rank,
        world_size=2,
        global_batch=16,
        seed=0,
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


def download_then_load(env, root):
    def fake_download(data_dir):  # the real one needs internet
        (data_dir / f"downloaded_by_rank_{env.rank}").touch()
        write_cifar_dir(data_dir)

    dataset_files.download_cifar10 = fake_download
    train, val = data.load_files("cifar10", root, download=True)
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


def ddp_gradients(env) -> dict:
    model = get_ddp_model(tiny_model(), env.device)
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
    expected = []
    for rank in (0, 1):
        model = tiny_model()
        F.cross_entropy(model(rank_batch(rank)[0]), rank_batch(rank)[1]).backward()
        expected.append([p.grad for p in model.parameters()])
    for rank, result in enumerate(results):
        for got, g0, g1 in zip(result["grads"], *expected):
            assert torch.allclose(got, (g0 + g1) / 2, atol=1e-6), (
                f"rank {rank}'s gradients are not the mean of both ranks': are they reduced?"
            )


# ----------------------------------------------------------------------------- 4.2 FSDP


def fsdp_made(env, sharding: str, precision: str, cpu_offload: bool = False) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = build_model("cnn")
    units = len(own_units(model))
    try:
        wrapped = get_fsdp_model(
            model, env.device, sharding, precision, cpu_offload, ranks_per_node=2
        )
    except RuntimeError as e:
        if "accelerator" not in str(e):
            raise
        raise AssertionError(f"{e}: is FSDP given device_id=device (on a CPU too)?") from None
    fsdp = isinstance(wrapped, FSDP)
    mixed = getattr(wrapped, "mixed_precision", None)
    return {
        "type": type(wrapped).__name__,
        "units": len(FSDP.fsdp_modules(wrapped)) - 1 if fsdp else None,
        "expected_units": units,
        "strategy": wrapped.sharding_strategy.name if fsdp else None,
        "param_dtype": str(mixed.param_dtype) if mixed and mixed.param_dtype else None,
        "reduce_dtype": str(mixed.reduce_dtype) if mixed and mixed.reduce_dtype else None,
        "offload": fsdp and wrapped.cpu_offload.offload_params,
        "own_parameters": fsdp and wrapped._use_orig_params,
        "mesh": fsdp and wrapped._device_mesh is not None,
    }


def test_ex4_2_fsdp_units_sharding_and_precision():
    full = spawn(fsdp_made, 2, "full", "bf16", plain=True, timeout=120)[0]
    assert full["type"] == "FullyShardedDataParallel", (
        f"get_fsdp_model returns a {full['type']}, not a FullyShardedDataParallel"
    )
    assert full["units"] == full["expected_units"], (
        f"{full['units']} FSDP units inside the root, not one for each of the model's "
        f"{full['expected_units']} own_units(): is the wrap policy given?"
    )
    assert full["strategy"] == "FULL_SHARD", f"--sharding full runs {full['strategy']}"
    assert (full["param_dtype"], full["reduce_dtype"]) == ("torch.bfloat16", "torch.float32"), (
        f"bf16 computes in {full['param_dtype']} and reduces in {full['reduce_dtype']}: "
        "MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)"
    )
    assert full["own_parameters"], (
        "the optimizer and torch.compile see FSDP's flat parameters, not the model's own: "
        "use_orig_params=True"
    )
    grad_op = spawn(fsdp_made, 2, "grad_op", "fp32", True, plain=True, timeout=120)[0]
    assert grad_op["strategy"] == "SHARD_GRAD_OP", (
        f"--sharding grad_op runs {grad_op['strategy']}: use SHARDING[sharding]"
    )
    assert grad_op["param_dtype"] is None, (
        f"fp32 computes in {grad_op['param_dtype']}: no MixedPrecision without a low dtype"
    )
    assert grad_op["offload"], "--cpu-offload keeps the parameters on the GPU: CPUOffload(...)"
    hybrid = spawn(fsdp_made, 2, "hybrid", "fp32", plain=True, timeout=120)[0]
    assert hybrid["strategy"] == "HYBRID_SHARD" and hybrid["mesh"], (
        f"--sharding hybrid runs {hybrid['strategy']}, mesh given: {hybrid['mesh']}: "
        "device_mesh=hybrid_mesh(device, ranks_per_node)"
    )


# ----------------------------------------------------------------------------- 5.1 main.py


class TrainingFailed(Exception):
    pass


class Calls:
    """Stand-ins for setup, session.run and cleanup that note the order they are called in."""

    def __init__(self, monkeypatch, fail: bool = False):
        import session

        self.log, self.env = [], distributed_utils.DistEnv(0, 0, 1, CPU, "gloo")
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
        f"setup gets {calls.log[0][1:]}: pass --pg-timeout and --device (cfg.pg_timeout, "
        "cfg.device)"
    )
    assert calls.log[1][1], "session.run must get the DistEnv that setup returned"


def test_ex5_1_cleanup_also_after_a_failure(monkeypatch):
    calls = Calls(monkeypatch, fail=True)
    with pytest.raises(TrainingFailed):
        main.train(Config(device="cpu"), [])
    assert ("cleanup", True) in calls.log, (
        f"after a failure in training main.train calls {calls.log}: cleanup(failed=True) "
        "must run also then (try/finally)"
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ex5_1_the_strategy_chooses_the_wrapper(monkeypatch, strategy):
    chosen = []
    for name in ("ddp", "fsdp"):
        monkeypatch.setattr(
            strategies,
            f"get_{name}_model",
            lambda model, *a, name=name, **k: chosen.append(name) or model,
        )
    strategies.wrap_model(Config(strategy=strategy), tiny_model(), CPU, 0, 1, 1)
    assert chosen == [strategy], (
        f"--strategy {strategy} wraps the model with {chosen or 'nothing'}: "
        f"get_{strategy}_model in strategies.wrap_model"
    )


# ----------------------------------------------------------------------------- 6.1 training


class Recorder(nn.Module):
    """A linear model that notes the mode and whether gradients are on at every forward."""

    def __init__(self):
        super().__init__()
        self.linear = tiny_model()
        self.seen = []

    def forward(self, x):
        self.seen.append((self.training, torch.is_grad_enabled()))
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


def trainer(model: nn.Module, env, lr: float = 0.1, val_size: int = 10) -> Trainer:
    return Trainer(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        precision=Precision(None, torch.amp.GradScaler("cpu", enabled=False)),
        env=env,
        loaders=StandInLoaders(env.rank, env.world_size, val_size),
        memory=MemoryMeter(env.device),
        flops=ModelFlops(per_image=0, devices=1, peak_tflops=None),
        print_every=1000,
    )


def test_ex6_1_a_step_is_one_optimizer_step():
    model = tiny_model()
    run = trainer(model, distributed_utils.DistEnv(0, 0, 1, CPU, "gloo"))
    reference = tiny_model()
    x, y = rank_batch(0)
    for step in (1, 2):
        before = [p.detach().clone() for p in model.parameters()]
        run.step(x, y, torch.zeros(()))
        assert all(p.grad is not None for p in model.parameters()), (
            "no gradients after a step: is backward called (scaler.scale(loss).backward())?"
        )
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), (
            "the parameters did not move: is the optimizer's step taken (scaler.step)?"
        )
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        assert all(
            torch.allclose(a, b, atol=1e-6)
            for a, b in zip(model.parameters(), reference.parameters())
        ), f"step {step} is not one SGD step on this batch's gradients" + (
            ": are the gradients zeroed first (zero_grad)?" if step == 2 else ""
        )


def test_ex6_1_validation_in_eval_mode_then_back_to_training():
    model = Recorder()
    run = trainer(model, distributed_utils.DistEnv(0, 0, 1, CPU, "gloo"))
    run.evaluate()
    assert model.seen and not any(training for training, _ in model.seen), (
        "the model validates in training mode: model.eval() in evaluate"
    )
    model.seen.clear()
    run.train_epoch(Position(epoch=1))
    assert model.seen and all(training for training, _ in model.seen), (
        "after validation the next epoch trains in eval mode: model.train() at its start"
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
