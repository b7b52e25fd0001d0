"""Train the CIFAR-10 CNN with DDP or FSDP: one script from a laptop to a multi-node cluster.

    python main.py --strategy ddp                         # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 main.py --strategy fsdp   # one node, four ranks
    srun python main.py ...                               # inside an sbatch job (see run.sh)
    python main.py --check 1 2 4 8 --strategy fsdp        # validate for these world sizes only

The launcher decides the world size; this script only reads it (distributed_utils.py). Each rank
parses the options (config.py), builds its trainer (data, model, DDP or FSDP wrapper, optimizer),
resumes it from a checkpoint if asked, trains it (train.py) and cleans up. Rank 0 alone prints:
one `[CONFIG]` line with the resolved configuration, progress, and one `[METRIC]` line per epoch
(format in utils.py).
"""

import argparse
import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import checkpoint
import data
import distributed_utils
from comm_bench import run_comm_benchmark
from config import ONE_PROCESS, SHARDED, Config, add_options, validate
from ddp_utils import get_ddp_model, get_dp_model
from fsdp_utils import effective_sharding, get_fsdp2_model, get_fsdp_model, low_precision
from model import build_model, count_parameters
from train import (PROFILE_SCHEDULE, ComputeCalibration, Diverged, MemoryMeter, MetricLabels,
                   Precision, StepProfiler, Trainer)
from utils import UsageError, format_config, is_rank_zero, log0

# The exit statuses, for scripts that run main.py.
EXIT_STATUS = {
    "finished": 0,
    "peer_failed": 1,  # another rank died or hung; its own log says why
    "usage": 2,  # bad input: one `error:` line
    "stopped": 3,  # SIGUSR1/SIGUSR2/SIGTERM: a checkpoint was saved; resume to finish
    "diverged": 4,  # the training loss became NaN or infinite; the last good checkpoint stays
    "checkpoint": 5,  # a checkpoint could not be saved or read: one `error:` line says which,
    # why, and what is intact (docs/reliability.md)
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 finished, 1 another rank died or hung, 2 bad input, 3 stopped by "
               "SIGUSR1/SIGUSR2/SIGTERM after saving a checkpoint (resume to finish), 4 diverged "
               "(the training loss became NaN or infinite), 5 a checkpoint could not be saved "
               "or read")
    add_options(parser)
    parser.add_argument("--check", nargs="*", type=int, metavar="N",
                        help="validate the configuration for world sizes N (default: the "
                             "launcher's) and find the data, then exit without training")
    return parser


def parse_command_line(argv: list[str]) -> tuple[Config, list[int] | None]:
    """The configuration, and the world sizes to check (None: train)."""
    options = vars(build_parser().parse_args(argv))
    check = options.pop("check")
    return validate(Config(**options)), check


# ----------------------------------------------------------------------------- checks

def check_world(cfg: Config, world_size: int, train_size: int) -> None:
    if cfg.strategy in ONE_PROCESS and world_size > 1:
        raise UsageError(f"--strategy {cfg.strategy} drives every device from one process; "
                         f"start one process (python main.py), not {world_size}")
    if cfg.batch_size < world_size or cfg.batch_size % world_size:
        raise UsageError(f"global batch size {cfg.batch_size} must be a multiple of the world "
                         f"size {world_size} (each rank gets an equal share)")
    if (cfg.batch_size // world_size) % cfg.grad_accum:
        raise UsageError(f"each rank's {cfg.batch_size // world_size} images per step do not "
                         f"split into --grad-accum {cfg.grad_accum} equal micro-batches")
    if train_size < cfg.batch_size:
        raise UsageError(f"{train_size} training images make no full global batch of "
                         f"{cfg.batch_size}")


def check_device_options(cfg: Config, device: torch.device) -> None:
    """Options the device cannot do."""
    if (cfg.precision == "bf16" and device.type == "cuda" and torch.cuda.is_available()
            and not torch.cuda.is_bf16_supported()):
        raise UsageError(f"bf16 is not supported on {torch.cuda.get_device_name(device)}; "
                         "use --precision fp16 or fp32")
    if cfg.cpu_offload and device.type != "cuda":
        raise UsageError("--cpu-offload moves FSDP's shards from the GPU to the CPU; "
                         "without a GPU they are on the CPU already")
    if cfg.sync_bn and device.type != "cuda":
        raise UsageError("--sync-bn needs GPUs: torch's SyncBatchNorm does not run on the CPU")
    if cfg.sync_bn and cfg.strategy != "ddp":
        raise UsageError("--sync-bn is for --strategy ddp")


def make_precision(precision: str, strategy: str, device: torch.device) -> Precision:
    """How a step of this strategy runs at this --precision: FSDP casts through its mixed
    precision policy (fsdp_utils); every unsharded model (DDP, DP, single) needs autocast."""
    fp16 = precision == "fp16"
    if strategy == "fsdp":  # FSDP1's gradients are flat shards: its scaler sees them all
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler(device.type, enabled=fp16)
    else:
        scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    return Precision(None if strategy in SHARDED else low_precision(precision), scaler)


def set_fp32_math(precision: str) -> str:
    """GPUs compute fp32 convolutions in TF32 unless told otherwise (cuDNN's default): make
    fp32 mean IEEE fp32, and tf32 ask for TF32 in convolutions and matrix products alike.
    Returns what fp32 operations run as. (No effect on a CPU.)"""
    math = "tf32" if precision == "tf32" else "ieee"
    # The legacy switches first, to the same answer: code that still reads them (torch.compile's
    # in some versions) raises where only the per-operation settings below were made.
    torch.set_float32_matmul_precision("high" if math == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = math == "tf32"
    torch.backends.cuda.matmul.fp32_precision = math
    torch.backends.cudnn.conv.fp32_precision = math
    torch.backends.cudnn.rnn.fp32_precision = math
    return math


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels only (an error names any op that has none); cuBLAS needs its
    workspace fixed before CUDA starts for that."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)


def check_device(cfg: Config) -> tuple[torch.device, str]:
    """The device the run would take here, or, for `--device cuda` checked on a machine without
    a GPU (a login node planning a sweep), a GPU assumed: its model is unknown here."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return torch.device("cuda"), "cuda (no GPU here: bf16 support not checked)"
    device, _ = distributed_utils.pick_device(0, cfg.device)
    return device, device.type


def check(cfg: Config, world_sizes: list[int]) -> int:
    """`--check`: would this configuration run at these world sizes? One process, no training."""
    world_sizes = world_sizes or [distributed_utils.read_ranks()[2]]
    if min(world_sizes) < 1:
        raise UsageError(f"--check: world sizes must be at least 1, got {min(world_sizes)}")
    train_size, source = data.find_data(cfg.dataset, cfg.data_dir, cfg.train_samples,
                                        cfg.download)
    for world_size in world_sizes:
        check_world(cfg, world_size, train_size)
    device, where = check_device(cfg)
    check_device_options(cfg, device)
    if cfg.resume not in (None, "auto"):
        checkpoint.resolve(cfg.resume, Path("."))
    elif cfg.checkpoint and cfg.checkpoint_dir:
        checkpoint.refuse_overwrite(Path(cfg.checkpoint_dir), cfg.resume)
    print(f"check: ok: strategy={cfg.strategy} world sizes {' '.join(map(str, world_sizes))}, "
          f"global batch {cfg.batch_size}, {train_size} training images ({source}), {where}")
    return EXIT_STATUS["finished"]


# ----------------------------------------------------------------------------- building

def wrap_model(cfg: Config, env: distributed_utils.DistEnv, nodes: int,
               model: torch.nn.Module) -> torch.nn.Module:
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    shard = dict(sharding=cfg.sharding, precision=cfg.precision, cpu_offload=cfg.cpu_offload,
                 ranks_per_node=env.world_size // nodes)
    if cfg.strategy == "ddp":
        model = get_ddp_model(model, env.device)
    elif cfg.strategy == "fsdp":
        model = get_fsdp_model(model, env.device, **shard)
    elif cfg.strategy == "fsdp2":
        model = get_fsdp2_model(model, env.device, **shard)
    elif cfg.strategy == "dp":
        model = get_dp_model(model, env.device)
    else:  # single
        model = model.to(env.device)
    return torch.compile(model) if cfg.compile else model


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer,
                   steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The learning rate per optimizer step: linear warm-up, then constant, step or cosine."""
    if cfg.lr_schedule == "none" and not cfg.warmup_epochs:
        return None
    warmup, total = cfg.warmup_epochs * steps_per_epoch, cfg.epochs * steps_per_epoch
    milestones = [int(total * 0.5), int(total * 0.75)]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "step":
            return 0.1 ** sum(step >= m for m in milestones)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=cfg.lr)


def build_trainer(cfg: Config, env: distributed_utils.DistEnv) -> tuple[Trainer, dict]:
    """This rank's trainer, and the resolved configuration for the `[CONFIG]` line."""
    spec = data.DATASETS[cfg.dataset]
    augment = spec.augment if cfg.augment is None else cfg.augment
    nodes = distributed_utils.num_nodes()
    train_set, val_set = data.load_splits(cfg.dataset, cfg.data_dir, cfg.seed, cfg.train_samples,
                                          cfg.val_samples, cfg.download)
    check_world(cfg, env.world_size, len(train_set))
    check_device_options(cfg, env.device)
    precision = make_precision(cfg.precision, cfg.strategy, env.device)
    fp32_math = set_fp32_math(cfg.precision)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    loaders = data.build_loaders(train_set, val_set, spec, kind=cfg.loader, rank=env.rank,
                                 world_size=env.world_size, global_batch=cfg.batch_size,
                                 seed=cfg.seed, augment=augment, device=env.device,
                                 num_workers=cfg.num_workers, memory_format=memory_format)
    sizes = {"train_size": len(train_set), "val_size": len(val_set)}
    del train_set, val_set  # the loaders hold what they need: the baseline must not count these
    # Before the baseline: the calibration's own model and optimizer are not the training's.
    calibration = calibrate_compute(cfg, env, spec, memory_format)
    memory = MemoryMeter(env.device)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, spec.num_classes, spec.image_shape)
    parameters = count_parameters(model)
    model = wrap_model(cfg, env, nodes, model)
    optimizer = make_optimizer(cfg, model)

    labels = MetricLabels(
        run={"strategy": cfg.strategy, "world_size": env.world_size, "nodes": nodes,
             "global_batch": cfg.batch_size, "local_batch": cfg.batch_size // env.world_size},
        setting={"precision": cfg.precision, "device": env.device.type, "dataset": cfg.dataset,
                 "seed": cfg.seed, "job_id": distributed_utils.job_id()},
        later={"sharding": effective_sharding(model, cfg.sharding),
               "train_images": len(loaders.train) * cfg.batch_size})
    resolved = {**asdict(cfg), **labels.run, "augment": augment, "backend": env.backend,
                "fp32_math": fp32_math,
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "rendezvous": rendezvous_text(env), "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),  # the node's: its ranks' threads share them
                **sizes,
                "steps_per_epoch": len(loaders.train), "parameters": parameters,
                "torch": torch.__version__, **labels.setting}
    scheduler = make_scheduler(cfg, optimizer, len(loaders.train))
    trainer = Trainer(model, optimizer, loaders, precision, env, labels, cfg.print_every, memory,
                      scheduler, cfg.grad_accum, cfg.clip_grad, calibration)
    return trainer, resolved


def calibrate_compute(cfg: Config, env: distributed_utils.DistEnv, spec: data.DatasetSpec,
                      memory_format: torch.memory_format) -> ComputeCalibration:
    """An unwrapped copy of the training step for t_compute, built with the random streams
    restored afterwards, so that training is exactly as without it. Not compiled: for --compile
    runs t_compute is the eager model's."""
    forked = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        model = build_model(cfg.model, spec.num_classes, spec.image_shape).to(
            env.device, memory_format=memory_format)
        # As one process runs it: autocast (also for FSDP, whose policy casts the real one), a
        # plain scaler (FSDP1's would all-reduce, over ranks that step different counts).
        precision = make_precision(cfg.precision, "single", env.device)
        bare = Trainer(model, make_optimizer(cfg, model), None, precision, env, None,
                       cfg.print_every, None, None, cfg.grad_accum, cfg.clip_grad)
        return ComputeCalibration(bare, cfg.batch_size // env.world_size, spec.image_shape,
                                  spec.num_classes, memory_format)


def network_warning(nodes: int, backend: str, environ=os.environ) -> str | None:
    """Across nodes, NCCL outside CSCS's container has no Slingshot plugin and falls back to
    TCP sockets without a word: a scaling study would then measure TCP."""
    if nodes > 1 and backend == "nccl" and not environ.get("NCCL_NET"):
        return ("warning: NCCL across nodes without NCCL_NET: without the network plugin it "
                "falls back to TCP sockets; run in the container (EDF=$PWD/edf.toml sbatch "
                "run.sh), which sets NCCL_NET=\"AWS Libfabric\" and fails if the plugin is "
                "missing")
    return None


def rendezvous_text(env: distributed_utils.DistEnv) -> str:
    if env.world_size == 1:
        return "none"  # a world of one meets nobody
    addr, port = distributed_utils.rendezvous()
    return f"{addr}:{port}"


# ----------------------------------------------------------------------------- running

@dataclass
class Outcome:
    trainer: Trainer
    history: list[dict]  # the [METRIC] fields of the epochs this process finished
    stopped_at: checkpoint.Position | None  # where a stop left training, if one came
    folder: Path | None  # where the checkpoints are
    diverged: str | None = None  # why training was given up, if it diverged


def run(cfg: Config, env: distributed_utils.DistEnv) -> Outcome:
    """Resume if asked, then train until cfg.epochs or until a stop signal (then save)."""
    trainer, resolved = build_trainer(cfg, env)
    if cfg.profile:
        trainer.profiler = StepProfiler(profile_path(env), env.device)
    folder = (distributed_utils.on_rank0(checkpoint.prepare_folder, cfg.checkpoint_dir,
                                         cfg.resume) if cfg.checkpoint else None)
    fits = checkpoint.Identity(cfg.strategy, cfg.model, resolved["parameters"], cfg.batch_size)
    resumable = (trainer.model, trainer.optimizer, trainer.loaders.generator, trainer.scheduler)
    source, position = None, checkpoint.Position()
    if cfg.resume == "auto":
        source, position = checkpoint.load_newest_readable(folder or Path("."), fits,
                                                           *resumable)
    elif cfg.resume:
        source = checkpoint.resolve(cfg.resume, folder or Path("."))
        position = checkpoint.load_everywhere(source, fits, *resumable)
    log0(format_config({**resolved, "checkpoint_dir": folder, "resumed_from": source}))
    if warning := network_warning(resolved["nodes"], env.backend):
        log0(warning)
    if cfg.comm_benchmark:
        comm_benchmark(cfg, env)
    if source:
        log0(f"[CHECKPOINT] resumed from {source}: epoch {position.epoch}, step {position.step}")
    elif cfg.resume == "auto":
        log0(f"[CHECKPOINT] --resume auto: no checkpoint in {folder or '.'}; starting fresh")

    def save(at: checkpoint.Position) -> None:
        if not folder or (source and source.resolve() == (folder / at.name).resolve()):
            return  # nothing trained since resuming (a stop during start-up): saved already
        log0(f"[CHECKPOINT] saved {checkpoint.save(folder, at, fits, *resumable)}")
        if is_rank_zero():
            for old in checkpoint.prune(folder, cfg.keep_last, protect=source):
                log0(f"[CHECKPOINT] deleted {old} (--keep-last {cfg.keep_last})")

    with checkpoint.StopRequest(cfg.pg_timeout) as stop:
        try:
            history, stopped_at = trainer.fit(position, cfg.epochs, stop, save)
        except Diverged as e:
            return Outcome(trainer, [], None, folder, f"{e}: training diverged (try a lower "
                           f"--lr); {last_good_checkpoint(folder)}")
    if trainer.profiler:
        log0(profile_report(trainer.profiler))
    return Outcome(trainer, history, stopped_at, folder)


def last_good_checkpoint(folder: Path | None) -> str:
    if folder is None:
        return "no checkpoint was kept (--no-checkpoint)"
    last = checkpoint.latest(folder)
    return f"the last good checkpoint is {last}" if last else f"no checkpoint in {folder} yet"


def comm_benchmark(cfg: Config, env: distributed_utils.DistEnv) -> None:
    """--comm-benchmark: the collectives of this model at this world size, on every rank. The
    model is built on the meta device (shapes only) with the random streams restored, so that
    training is exactly as without it."""
    spec = data.DATASETS[cfg.dataset]
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(cfg.model, spec.num_classes, spec.image_shape)
    low = low_precision(cfg.precision)  # what FSDP's all-gathers carry (fsdp_utils)
    gathered = low.itemsize if cfg.strategy in SHARDED and low else 4
    run_comm_benchmark(model, env.device, gathered, extra={"job_id": distributed_utils.job_id()})


PROFILE_DIR = Path("logs") / "profiles"


def profile_path(env: distributed_utils.DistEnv) -> Path:
    """One trace per rank and run, named as rank 0 names the run."""
    run = distributed_utils.on_rank0(distributed_utils.run_name)
    return PROFILE_DIR / f"{run}_rank{env.rank}.json"


def profile_report(profiler: StepProfiler) -> str:
    steps = sum(PROFILE_SCHEDULE.values())
    if not profiler.saved:
        return f"[PROFILE] no trace: the run trained fewer than {steps} steps"
    pattern = profiler.path.with_name(profiler.path.name.replace("rank0", "rank*"))
    return (f"[PROFILE] steps {steps - PROFILE_SCHEDULE['active'] + 1}-{steps} of each rank "
            f"traced: {pattern} (open in https://ui.perfetto.dev)")


def continue_command(argv: list[str], folder: Path) -> str:
    """The command line that resumes a stopped run: its own, resuming from its folder."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--resume="):
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        kept.append(arg)
    return shlex.join(["main.py", *kept, "--resume", str(folder)])


def stop_report(outcome: Outcome, epochs: int, argv: list[str]) -> str:
    at = outcome.stopped_at
    signal_name = checkpoint.stop_signal() or "a signal to another rank"
    text = (f"[CHECKPOINT] stopped on {signal_name} at epoch {at.epoch} step {at.step} of "
            f"{epochs} epochs")
    if outcome.folder is None:
        return text + " (no checkpoint written: --no-checkpoint)"
    return f"{text}; continue with: {continue_command(argv, outcome.folder)}"


def train(cfg: Config, argv: list[str]) -> int:
    """Join the other ranks, train, leave; a dead or hung peer ends this rank with one line."""
    env = distributed_utils.setup(cfg.pg_timeout, cfg.device)
    failed = True
    try:
        status = report(run(cfg, env), cfg.epochs, argv)
        # Leave together: under srun --kill-on-bad-exit the first rank to exit non-zero (a stop
        # exits 3) ends the others, which must not cut rank 0's pruning or report short.
        distributed_utils.barrier()
        failed = False
    except Exception as e:
        if not distributed_utils.is_peer_failure(e):
            raise
        # Its own log holds the cause: say which rank, rather than wait for the time limit.
        print(f"error: {distributed_utils.describe_peer_failure(e)}", file=sys.stderr,
              flush=True)
        return EXIT_STATUS["peer_failed"]
    finally:
        distributed_utils.cleanup(failed)
    return status


def report(outcome: Outcome, epochs: int, argv: list[str]) -> int:
    """Rank 0's last line on a run that did not finish; the exit status."""
    if outcome.diverged:
        log0(f"error: {outcome.diverged}", file=sys.stderr)
        return EXIT_STATUS["diverged"]
    if outcome.stopped_at:
        log0(stop_report(outcome, epochs, argv))
        return EXIT_STATUS["stopped"]
    return EXIT_STATUS["finished"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with checkpoint.catch_stop_signals():  # a warning during start-up must not kill us either
        try:
            cfg, world_sizes = parse_command_line(argv)
            set_deterministic(cfg.deterministic)
            if world_sizes is not None:
                return check(cfg, world_sizes)
            return train(cfg, argv)
        except UsageError as e:
            log0(f"error: {e}", file=sys.stderr)  # the same on every rank: one line, rank 0's
            if isinstance(e, checkpoint.CheckpointError):
                return EXIT_STATUS["checkpoint"]
            return EXIT_STATUS["usage"]


if __name__ == "__main__":
    sys.exit(main())
