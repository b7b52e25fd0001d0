"""Train the CIFAR-10 CNN with DDP or FSDP: one script from a laptop to a multi-node cluster.

    python main.py --strategy ddp                         # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 main.py --strategy fsdp   # one node, four ranks
    srun python main.py ...                               # inside an sbatch job (see run.sh)

The launcher decides the world size; this script only reads it (distributed_utils.py). Rank 0
alone prints: one `[CONFIG]` line with the resolved configuration, progress, and one `[METRIC]`
line per epoch (format in utils.py).
"""

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import checkpoint
import data
import distributed_utils
from ddp_utils import get_ddp_model
from fsdp_utils import DTYPES, SHARDING, get_fsdp_model
from model import MODELS, build_model, count_parameters
from train import Precision, run_epoch
from utils import UsageError, format_config, format_metric, is_rank_zero, log0

STRATEGIES = ("ddp", "fsdp")
OPTIMIZERS = ("adam", "sgd")
LOADERS = ("tensor", "classic")


@dataclass
class Config:
    strategy: str = "ddp"
    epochs: int = 10
    batch_size: int = 256  # global: split evenly over the ranks
    lr: float = 1e-3
    optimizer: str = "adam"
    precision: str = "fp32"
    sharding: str = "full"
    cpu_offload: bool = False
    model: str = "cnn"
    dataset: str = "cifar10"
    data_dir: str = "./data"
    download: bool = True
    train_samples: int | None = None
    val_samples: int | None = None
    augment: bool | None = None  # None: the data set's default
    loader: str = "tensor"
    num_workers: int = 2
    channels_last: bool = False
    compile: bool = False
    seed: int = 42
    print_every: int = 50
    pg_timeout: float = 300.0
    checkpoint_dir: str | None = None  # None: checkpoints/<SLURM job id, or a local time stamp>
    resume: str | None = None  # "auto" (the latest in checkpoint_dir, if any) or a path
    checkpoint: bool = True


def build_parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategy", "--method", choices=STRATEGIES, default=d.strategy,
                   help="DDP replicates the model; FSDP shards it (--method: the course's name)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="training epochs")
    p.add_argument("--batch-size", "--batch_size", type=int, default=d.batch_size,
                   help="global batch size, split evenly over all ranks")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
                   help="Adam, or SGD with momentum 0.9")
    p.add_argument("--precision", choices=tuple(DTYPES), default=d.precision,
                   help="compute precision, the same for DDP (autocast) and FSDP (MixedPrecision); "
                        "fp16 adds a gradient scaler")
    p.add_argument("--sharding", choices=tuple(SHARDING), default=d.sharding,
                   help="FSDP sharding strategy: full (ZeRO-3), grad_op (ZeRO-2), hybrid "
                        "(full within a node, replicated across nodes)")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP: keep parameter shards on CPU")
    p.add_argument("--model", choices=tuple(MODELS), default=d.model, help="model choice")
    p.add_argument("--dataset", choices=tuple(data.DATASETS), default=d.dataset,
                   help="CIFAR-10, or a learnable synthetic set (no download; for smoke tests "
                        "and benchmarks)")
    p.add_argument("--data-dir", default=d.data_dir, help="where CIFAR-10 is, or goes")
    p.add_argument("--no-download", dest="download", action="store_false",
                   help="fail instead of downloading when CIFAR-10 is missing")
    p.add_argument("--train-samples", type=int, default=None, help="use the first N training images")
    p.add_argument("--val-samples", type=int, default=None, help="use the first N validation images")
    p.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                   help="random crop and flip (default: on for cifar10, off for synthetic)")
    p.add_argument("--loader", choices=LOADERS, default=d.loader,
                   help="tensor: data set on the device, batched augmentation; classic: "
                        "torchvision transforms in DataLoader workers")
    p.add_argument("--num-workers", type=int, default=d.num_workers,
                   help="DataLoader worker processes per rank (classic loader)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (on CPU: about a minute to compile, and slower)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for weights, data order, data")
    p.add_argument("--print-every", type=int, default=d.print_every,
                   help="progress line every N steps (rank 0)")
    p.add_argument("--pg-timeout", type=float, default=d.pg_timeout,
                   help="seconds a collective waits for a missing rank before failing")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoints go, one per epoch and one on SIGUSR1/SIGTERM "
                        "(default: beside the one resumed from, else checkpoints/<SLURM job "
                        "id>, else checkpoints/local-<time>)")
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="continue from the latest checkpoint in --checkpoint-dir (auto: start "
                        "fresh if there is none), or from a checkpoint or folder PATH")
    p.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                   help="write no checkpoints")
    return p


def parse_config(argv) -> Config:
    cfg = Config(**vars(build_parser().parse_args(argv)))
    for name in ("epochs", "batch_size", "print_every", "train_samples", "val_samples"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if cfg.lr <= 0 or cfg.pg_timeout <= 0 or cfg.num_workers < 0:
        raise UsageError("--lr and --pg-timeout must be positive, --num-workers not negative")
    return cfg


def check_world(cfg: Config, world_size: int, train_size: int) -> None:
    if cfg.batch_size < world_size or cfg.batch_size % world_size:
        raise UsageError(f"global batch size {cfg.batch_size} must be a multiple of the world "
                         f"size {world_size} (each rank gets an equal share)")
    if train_size < cfg.batch_size:
        raise UsageError(f"{train_size} training images make no full global batch of "
                         f"{cfg.batch_size}")


def make_precision(cfg: Config, device: torch.device) -> Precision:
    if cfg.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(f"bf16 is not supported on {torch.cuda.get_device_name(device)}; "
                         "use --precision fp16 or fp32")
    if cfg.cpu_offload and device.type != "cuda":
        raise UsageError("--cpu-offload moves FSDP's shards from the GPU to the CPU; "
                         "without a GPU they are on the CPU already")
    scaler = None
    if cfg.precision == "fp16":
        if cfg.strategy == "fsdp":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            scaler = ShardedGradScaler(device.type)
        else:
            scaler = torch.amp.GradScaler(device.type)
    # FSDP casts through its MixedPrecision policy; DDP needs autocast.
    autocast = DTYPES[cfg.precision] if cfg.strategy == "ddp" and cfg.precision != "fp32" else None
    return Precision(autocast, scaler)


def wrap_model(cfg: Config, env: distributed_utils.DistEnv, nodes: int,
               model: torch.nn.Module) -> torch.nn.Module:
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.strategy == "ddp":
        model = get_ddp_model(model, env.device)
    else:
        model = get_fsdp_model(model, env.device, cfg.sharding, cfg.precision, cfg.cpu_offload,
                               ranks_per_node=env.world_size // nodes)
    return torch.compile(model) if cfg.compile else model


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=cfg.lr)


@dataclass
class Job:
    """Everything one rank trains with, resolved from the configuration."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loaders: data.Loaders
    precision: Precision
    identity: dict  # which run this is: the fields that follow the course's in [METRIC]
    run_info: dict  # how it ran: the fields that close the [METRIC] line
    resolved: dict  # the whole resolved configuration, for the [CONFIG] line


def prepare(cfg: Config, env: distributed_utils.DistEnv) -> Job:
    spec = data.DATASETS[cfg.dataset]
    augment = spec.augment if cfg.augment is None else cfg.augment
    nodes = distributed_utils.num_nodes()
    train_set, val_set = data.load_splits(cfg.dataset, cfg.data_dir, cfg.seed, cfg.train_samples,
                                          cfg.val_samples, cfg.download)
    check_world(cfg, env.world_size, len(train_set))
    precision = make_precision(cfg, env.device)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    loaders = data.build_loaders(train_set, val_set, spec, kind=cfg.loader, rank=env.rank,
                                 world_size=env.world_size, global_batch=cfg.batch_size,
                                 seed=cfg.seed, augment=augment, device=env.device,
                                 num_workers=cfg.num_workers, memory_format=memory_format)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model)
    parameters = count_parameters(model)
    model = wrap_model(cfg, env, nodes, model)
    optimizer = make_optimizer(cfg, model)

    identity = {
        "strategy": cfg.strategy, "world_size": env.world_size, "nodes": nodes,
        "global_batch": cfg.batch_size, "local_batch": cfg.batch_size // env.world_size,
    }
    run_info = {
        "precision": cfg.precision, "device": env.device.type, "dataset": cfg.dataset,
        "seed": cfg.seed, "job_id": distributed_utils.job_id(),
    }
    resolved = {**asdict(cfg), **identity, "augment": augment, "backend": env.backend,
                "train_size": len(train_set), "val_size": len(val_set),
                "steps_per_epoch": len(loaders.train),
                "parameters": parameters,
                "torch": torch.__version__, **run_info}
    return Job(model, optimizer, loaders, precision, identity, run_info, resolved)


def checkpoint_folder(cfg: Config) -> Path:
    """Rank 0 names and creates the folder (a run's default name carries its start time)."""
    if cfg.checkpoint_dir:
        folder = Path(cfg.checkpoint_dir)
    elif cfg.resume not in (None, "auto"):  # go on writing beside the checkpoint resumed
        resumed = Path(cfg.resume)
        folder = resumed.parent if (resumed / checkpoint.META_FILE).is_file() else resumed
    elif "SLURM_JOB_ID" in os.environ:  # a requeued job keeps its id, so it finds its own
        folder = Path("checkpoints") / os.environ["SLURM_JOB_ID"]
    else:
        folder = Path("checkpoints") / time.strftime("local-%Y%m%d-%H%M%S")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".writable"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise UsageError(f"checkpoint folder {folder} is not writable ({e.strerror}); "
                         "choose another with --checkpoint-dir") from None
    if cfg.resume is None and checkpoint.latest(folder):
        raise UsageError(f"{folder} already holds checkpoints of an earlier run: continue it "
                         "with --resume auto, or choose another --checkpoint-dir")
    return folder


def train_epochs(cfg: Config, env: distributed_utils.DistEnv, job: Job,
                 position: checkpoint.Position, folder: Path | None,
                 identity: checkpoint.Identity, stop: checkpoint.StopRequest):
    """Epochs from `position` to cfg.epochs, a checkpoint after each. Returns the metrics of
    the finished epochs and, if a stop was requested, the position it saved (else None)."""
    history = []

    def save(at: checkpoint.Position) -> None:
        if folder:
            path = checkpoint.save(folder, at, identity, job.model, job.optimizer,
                                   job.loaders.generator)
            log0(f"[CHECKPOINT] saved {path}")

    while position.epoch <= cfg.epochs:
        reached, metrics = run_epoch(job.model, job.optimizer, job.loaders, job.precision, env,
                                     position, cfg.print_every, stop)
        stopping = stop.drain()  # the same answer on every rank
        if metrics is None:  # a stop came mid-epoch: keep what this epoch has done so far
            save(reached)
            return history, reached
        head = {k: metrics.pop(k) for k in ("epoch", "time", "val_loss", "acc", "peak_mem")}
        line = {**head, **job.identity, **metrics, **job.run_info}
        log0(format_metric(line))
        history.append(line)
        position = checkpoint.Position(epoch=position.epoch + 1)
        save(position)
        if stopping and position.epoch <= cfg.epochs:
            return history, position
    return history, None


def run(cfg: Config, env: distributed_utils.DistEnv) -> tuple[Job, list[dict]]:
    """Train until cfg.epochs, or until SLURM asks us to stop (then save and return).

    Returns the job (its trained model) and the metrics of the epochs this process ran.
    """
    job = prepare(cfg, env)
    folder = distributed_utils.on_rank0(checkpoint_folder, cfg) if cfg.checkpoint else None
    identity = checkpoint.Identity(cfg.strategy, cfg.model, job.resolved["parameters"],
                                   cfg.batch_size)
    position = checkpoint.Position()
    source = checkpoint.resolve(cfg.resume, folder or Path(".")) if cfg.resume else None
    if source:
        position = checkpoint.load(source, identity, job.model, job.optimizer,
                                   job.loaders.generator)
    log0(format_config({**job.resolved, "checkpoint_dir": folder, "resumed_from": source}))
    if source:
        log0(f"[CHECKPOINT] resumed from {source}: epoch {position.epoch}, step {position.step}")

    with checkpoint.StopRequest() as stop:
        history, stopped_at = train_epochs(cfg, env, job, position, folder, identity, stop)
    if stopped_at:
        log0(f"[CHECKPOINT] stopped on {checkpoint.stop_signal() or 'a signal to another rank'}"
             f" at epoch {stopped_at.epoch} step {stopped_at.step} of {cfg.epochs} epochs"
             + ("; continue with --resume auto" if folder else " (no checkpoint written)"))
    return job, history


def main(argv=None) -> int:
    with checkpoint.catch_stop_signals():  # a warning during start-up must not kill us either
        return _main(argv)


def _main(argv) -> int:
    try:
        cfg = parse_config(argv)
        env = distributed_utils.setup(cfg.pg_timeout)
        try:
            run(cfg, env)
        except Exception as e:
            if not distributed_utils.is_peer_failure(e):
                raise
            # Another rank died or hung: say which, and exit instead of waiting for the
            # job's time limit. Its own log holds the cause.
            print(f"error: {distributed_utils.describe_peer_failure(e)}", file=sys.stderr,
                  flush=True)
            return 1
        finally:
            distributed_utils.cleanup()
    except UsageError as e:
        # Usage errors are the same on every rank: one line, from rank 0.
        if is_rank_zero():
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
