"""Every option of a training run, each with its default and help in one place: the fields of
`Config`, from which main.py's command-line parser is built.

This module imports no torch, so that main.py reads its options before torch loads, and tools
which only plan runs (run_benchmarks.py, on a login node that may have no torch outside a
container) share the same choices and checks. The names of strategies, precisions, models and
data sets are owned here; the modules that implement them (strategies, fsdp_utils, model, data)
key their tables by these names.
"""

import argparse
import math
import re
import typing
from dataclasses import dataclass, field, fields

from utils import UsageError

STRATEGIES = ("ddp", "fsdp", "fsdp2", "pipeline", "model", "dp", "single")
SHARDED = ("fsdp", "fsdp2")  # strategies whose ranks each hold a shard (checkpoints per rank)
STAGED = ("pipeline",)  # each rank holds consecutive layers: a stage (checkpoints per stage)
LAYER_SPLIT = ("pipeline", "model")  # strategies that split the model's layers over devices
ONE_PROCESS = ("model", "dp", "single")  # baselines that drive every device from one process
SWEEP_GPUS = (1, 2, 4, 8)  # run_benchmarks.py's GPU counts by default (benchmark.py predicts them)
SCHEDULES = ("gpipe", "1f1b")
STRATEGY_OPTIONS = {"microbatches": "pipeline", "sync_bn": "ddp"}  # options one strategy takes
# FSDP1: each rank's gradients are flat shards of its units, which a loss scaler must see on
# every rank at once to find an inf (precision.make_precision: ShardedGradScaler).
FLAT_SHARDS = ("fsdp",)
# fully_shard's parameters are DTensors, for which torch has fused Adam but no fused SGD
# (optim.make_optimizer: foreach), which reads its rate and a scaler's inf check on the host.
DTENSOR_PARAMETERS = ("fsdp2",)
# The strategies whose step a CUDA graph can capture (feasibility.graph_refusal), and the torch
# from which it can. FSDP2's hooks only queue work on streams of its own, and a capture may take
# its all-gather's pinned memory since pytorch#167507: torch's tests capture it since 2.11.
CAPTURABLE = ("single", "ddp", "fsdp2")
CAPTURED_SINCE = {"fsdp2": (2, 11)}
# The units each model is cut at (len(model.shard_units()), which tests/test_units.py checks):
# here, without torch, so that --check and the sweep know which world sizes a pipeline takes.
MODEL_UNITS = {"cnn": 4, "cnn-wide": 4, "resnet18": 4, "resnet50": 4}
MODELS = tuple(MODEL_UNITS)  # the models' names (model.MODELS builds them)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp64")
SHARDINGS = ("full", "grad_op", "hybrid")
OPTIMIZERS = ("adam", "sgd")
DATASETS = ("cifar10", "fashionmnist", "tinyimagenet", "synthetic")
LOADERS = ("tensor", "classic")
LR_SCHEDULES = ("none", "step", "cosine")
DEVICES = ("auto", "cuda", "cpu")
# Options that set how many ranks there are: the launcher's, not main.py's (--gpus, --nodes,
# --nproc_per_node, --ntasks-per-node, --world-size, --num-gpus, ...). main.py and the sweep
# both refuse them, each naming what sets the ranks instead.
LAUNCHER_OPTION = re.compile(
    r"--((n|num[-_]?)?(gpus?|nodes?|procs?|tasks|ranks)|(nproc|ntasks|gpus?[-_]per)[\w-]*"
    r"|world[-_]?size)$"
)


def option(default, help: str, *, choices=None, aliases=(), metavar=None, minimum=None, flag=None):
    """A Config field and how the command line offers it.

    minimum: the smallest value accepted (0: not negative, 1: at least one); floats must also be
    finite and, with minimum 0, positive. flag: for a bool, the switch that sets it
    (`--no-download` sets download=False); with a None default, both `--x` and `--no-x`.
    """
    return field(
        default=default,
        metadata=dict(
            help=help, choices=choices, aliases=aliases, metavar=metavar, minimum=minimum, flag=flag
        ),
    )


@dataclass
class Config:
    strategy: str = option(
        "ddp",
        "ddp replicates the model on every rank; fsdp (FSDP1, the course's) and fsdp2 "
        "(fully_shard) shard it; pipeline gives each rank consecutive layers (a stage) fed with "
        "micro-batches; model (naive model parallel: one process places consecutive layers on the "
        "visible GPUs), dp (DataParallel: one process drives every visible GPU) and single (one "
        "device, no wrapper) are one-process baselines",
        choices=STRATEGIES,
        aliases=("--method",),
    )
    epochs: int = option(10, "training epochs", minimum=1)
    batch_size: int = option(
        256, "global batch size, split evenly over all ranks", minimum=1, aliases=("--batch_size",)
    )
    lr: float = option(1e-3, "learning rate", minimum=0)
    optimizer: str = option("adam", "Adam, or SGD with momentum 0.9", choices=OPTIMIZERS)
    lr_schedule: str = option(
        "none",
        "learning rate over the run: constant, divided by 10 at half and three quarters of the "
        "epochs (step), or a cosine to zero; "
        "after --warmup-epochs of linear warm-up",
        choices=LR_SCHEDULES,
    )
    warmup_epochs: int = option(
        0, "epochs of linear learning-rate warm-up from lr/steps", minimum=0, metavar="N"
    )
    grad_accum: int = option(
        1,
        "micro-batches per optimizer step: each rank splits its share of the global batch into K "
        "and all-reduces gradients only after the last (--batch-size stays the global batch of one "
        "step)",
        minimum=1,
        metavar="K",
    )
    microbatches: int | None = option(
        None,
        "pipeline: micro-batches per step, each global batch split into M equal ones (default: "
        "twice the number of stages)",
        minimum=1,
        metavar="M",
    )
    schedule: str = option(
        "1f1b",
        "pipeline: the order of forwards and backwards: gpipe (all forwards, then all backwards) "
        "or 1f1b (one forward, one backward once the pipeline is full: fewer activations held)",
        choices=SCHEDULES,
    )
    clip_grad: float | None = option(
        None,
        "clip the global gradient norm (over all ranks and shards) to NORM (default: no clipping)",
        minimum=0,
        metavar="NORM",
    )
    sync_bn: bool = option(
        False,
        "DDP: synchronize BatchNorm statistics over all ranks (models with BatchNorm: the ResNets; "
        "needs GPUs)",
        flag="--sync-bn",
    )
    precision: str = option(
        "fp32",
        "compute precision, comparable numerics for DDP (autocast) and FSDP (MixedPrecision; "
        "gradients reduced in fp32 by both): fp32 is IEEE fp32 also on GPUs, tf32 lets them use "
        "TensorFloat-32 for matrix products and convolutions, fp16 adds a gradient scaler; fp64 "
        "stores and computes everything in float64 (verify.py's equivalence check)",
        choices=PRECISIONS,
    )
    device: str = option(
        "auto",
        "auto: a GPU where torch sees one, else the CPU, but an error where the job was given GPUs "
        "that torch cannot see; cuda: a GPU or an error; cpu: the CPU even where there are GPUs",
        choices=DEVICES,
    )
    sharding: str = option(
        "full",
        "FSDP sharding strategy: full (ZeRO-3), grad_op (ZeRO-2), hybrid (full within a node, "
        "replicated across nodes)",
        choices=SHARDINGS,
    )
    cpu_offload: bool = option(
        False, "FSDP: keep parameter shards in host memory (GPU only)", flag="--cpu-offload"
    )
    model: str = option(
        "cnn",
        "the course CNN (its classifier sized for the data set's images), the same with 4x its "
        "channels, or a ResNet adapted to small images (3x3 stem, no max-pool)",
        choices=MODELS,
    )
    dataset: str = option(
        "cifar10",
        "CIFAR-10; Fashion-MNIST (28x28 grey, padded to 32x32 and made 3-channel); Tiny ImageNet "
        "(200 classes, 64x64, no download: unzip it into --data-dir); or a learnable synthetic "
        "stand-in generated from the seed (no download: smoke tests, benchmarks, offline machines)",
        choices=DATASETS,
    )
    data_dir: str = option(
        "./data", "where the data set's files are, or are downloaded to", metavar="DIR"
    )
    download: bool = option(
        True,
        "fail instead of downloading when CIFAR-10 or Fashion-MNIST is missing (default: rank 0 "
        "downloads it)",
        flag="--no-download",
    )
    train_samples: int | None = option(
        None,
        "use the first N training images (default: all); validation still reads every validation "
        "image, each epoch, unless --val-samples",
        minimum=1,
        metavar="N",
    )
    val_samples: int | None = option(
        None, "use the first N validation images (default: all)", minimum=1, metavar="N"
    )
    augment: bool | None = option(
        None,
        "random crop (padding 4) and flip (default: on for the real data sets, off for synthetic)",
        flag="--augment",
    )
    loader: str = option(
        "tensor",
        "tensor: data set on the device, batched augmentation; classic: torchvision transforms in "
        "DataLoader workers",
        choices=LOADERS,
    )
    num_workers: int = option(
        2, "DataLoader worker processes per rank (classic loader)", minimum=0, metavar="N"
    )
    channels_last: bool = option(False, "NHWC memory format", flag="--channels-last")
    compile: bool = option(
        False,
        "torch.compile the model (the first epoch then includes compiling: about 20 s on a CPU)",
        flag="--compile",
    )
    cuda_graphs: bool | None = option(
        None,
        "capture the whole training step as one CUDA graph after a few eager steps and replay it "
        "(single, ddp and fsdp2 on a GPU). Default: on a GPU wherever it applies and has been "
        "shown to (the [CONFIG] line notes why a run stays eager); off on a CPU",
        flag="--cuda-graphs",
    )
    seed: int = option(42, "seed for weights, data order and synthetic data", minimum=0)
    deterministic: bool = option(
        False,
        "deterministic kernels only: on a GPU, runs repeat to the bit (slower; an op without one "
        "is an error)",
        flag="--deterministic",
    )
    profile: bool = option(
        False,
        "trace a few training steps of each rank with torch.profiler: logs/profiles/<job "
        "id>_rank<R>.json, for ui.perfetto.dev",
        flag="--profile",
    )
    comm_benchmark: bool = option(
        False,
        "before training, time the collectives this model's DDP and FSDP send, and a sweep of "
        "message sizes: one [COMM] line each (comm_bench.py)",
        flag="--comm-benchmark",
    )
    peak_tflops: float | None = option(
        None,
        "one device's dense peak TFLOP/s at the run's --precision, for the mfu field of [METRIC] "
        "(default: from cost_model.PEAK_TFLOPS for the GPUs listed there; none on a CPU)",
        minimum=0,
        metavar="TFLOPS",
    )
    print_every: int = option(50, "progress line every N steps (rank 0)", minimum=1, metavar="N")
    pg_timeout: float = option(
        300.0,
        "seconds a collective waits for a missing rank before failing",
        minimum=0,
        metavar="SECONDS",
    )
    checkpoint_dir: str | None = option(
        None,
        "where checkpoints go, one per epoch and one on SIGUSR1/SIGUSR2/SIGTERM (default: beside "
        "the checkpoint resumed from, else checkpoints/<SLURM job id>, else "
        "checkpoints/local-<time>)",
        metavar="DIR",
    )
    resume: str | None = option(
        None,
        "continue from the latest checkpoint in --checkpoint-dir (auto: start fresh, saying so, if "
        "there is none; pass over unreadable ones to an older one, an error if none can be read), "
        "or from a checkpoint or folder PATH",
        metavar="auto|PATH",
    )
    checkpoint: bool = option(
        True, "write no checkpoints (default: one per epoch)", flag="--no-checkpoint"
    )
    keep_last: int = option(
        3,
        "keep the newest N checkpoints of the run, delete older ones (never the one resumed from; "
        "0: keep all)",
        minimum=0,
        metavar="N",
    )


def option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(f) -> type:
    """int for `int` and for `int | None`."""
    return next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)


def _add_option(parser: argparse.ArgumentParser, f) -> None:
    meta = f.metadata
    # A switch's help, and one without a default value, say what happens by default.
    unsaid = meta["flag"] or f.default is None
    named = dict(dest=f.name, help=meta["help"] + ("" if unsaid else f" (default: {f.default})"))
    if meta["flag"] and f.default is None:  # --x and --no-x; unset: the situation's default
        parser.add_argument(meta["flag"], action="store_true", default=None, **named)
        opposite = dict(dest=f.name, help=f"the opposite of {meta['flag']}")
        parser.add_argument("--no-" + meta["flag"][2:], action="store_false", **opposite)
    elif meta["flag"]:
        action = "store_false" if f.default else "store_true"
        parser.add_argument(meta["flag"], default=f.default, action=action, **named)
    else:
        parser.add_argument(
            option_flag(f.name),
            *meta["aliases"],
            type=_value_type(f),
            default=f.default,
            choices=meta["choices"],
            metavar=meta["metavar"],
            **named,
        )


def add_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every Config field as an option of `parser`."""
    for f in fields(Config):
        _add_option(parser, f)
    return parser


def validate(cfg: Config) -> Config:
    """Numbers the parser's types let through but no run can use: zero, negative, NaN, inf."""
    for f in fields(Config):
        minimum, value = f.metadata["minimum"], getattr(cfg, f.name)
        if minimum is None or value is None:
            continue
        name = option_flag(f.name)
        if isinstance(value, float):
            if not math.isfinite(value) or value <= minimum:
                raise UsageError(f"{name} must be a positive number, got {value}")
        elif value < minimum:
            raise UsageError(f"{name} must be at least {minimum}, got {value}")
    return cfg


def scheduled(cfg: Config) -> bool:
    """Whether the learning rate changes during the run: a schedule, or a warm-up."""
    return cfg.lr_schedule != "none" or bool(cfg.warmup_epochs)


def data_world(strategy: str, world_size: int) -> int:
    """The ranks the data is sharded over: every stage of a pipeline takes the whole global
    batch (the first its images, the last its labels)."""
    return 1 if strategy in STAGED else world_size


def microbatches(cfg: Config, stages: int) -> int:
    """--microbatches, or twice the stages: at m = 2p the textbook's idle share of a step,
    (p - 1) / (m + p - 1), is below a third at any p."""
    return cfg.microbatches or 2 * stages


def pipeline_world_sizes(model: str) -> list[int]:
    """The world sizes a pipeline of this model runs on: at least 2 stages, each the same
    number of the model's units."""
    units = MODEL_UNITS[model]
    return [n for n in range(2, units + 1) if units % n == 0]


def pipeline_cut(model: str) -> str:
    """How a pipeline cuts the model, in words, for the messages that refuse a world size."""
    sizes = " or ".join(map(str, pipeline_world_sizes(model)))
    return (
        f"--strategy pipeline cuts --model {model}'s {MODEL_UNITS[model]} units into one "
        f"stage per rank, the same number each: world size {sizes}"
    )


def pipeline_refusal(cfg: Config, world_size: int) -> str | None:
    """Why --strategy pipeline cannot run this way on world_size ranks, or None (the
    precisions its stages compute in are feasibility.refusal's to say)."""
    if world_size not in pipeline_world_sizes(cfg.model):
        return f"{pipeline_cut(cfg.model)}, not {world_size}"
    m = microbatches(cfg, world_size)
    if cfg.batch_size % m:
        return f"global batch size {cfg.batch_size} does not split into {m} equal micro-batches"
    if cfg.schedule == "1f1b" and m < world_size:
        return f"--schedule 1f1b needs at least one micro-batch per stage: {m} < {world_size}"
    unsupported = {
        "--grad-accum": cfg.grad_accum > 1 and "use --microbatches",
        "--compile": cfg.compile and "not with pipeline stages",
    }
    return next((f"--strategy pipeline: {k}: {why}" for k, why in unsupported.items() if why), None)


def world_refusal(cfg: Config, world_size: int, train_size: int) -> str | None:
    """Why this configuration cannot run on world_size ranks with train_size training images,
    or None: the checks that need the launcher's world size and the data, not torch, and the
    options only one strategy takes (STRATEGY_OPTIONS). Asked by feasibility.refusal."""
    if cfg.strategy in ONE_PROCESS and world_size > 1:
        return (
            f"--strategy {cfg.strategy} drives every device from one process; "
            f"start one process (python main.py), not {world_size}"
        )
    if cfg.strategy in STAGED and (why := pipeline_refusal(cfg, world_size)):
        return why
    for name, strategy in STRATEGY_OPTIONS.items():
        if getattr(cfg, name) and cfg.strategy != strategy:
            return f"{option_flag(name)} is for --strategy {strategy}"
    shards = data_world(cfg.strategy, world_size)
    if cfg.batch_size < shards or cfg.batch_size % shards:
        return (
            f"global batch size {cfg.batch_size} must be a multiple of the world "
            f"size {shards} (each rank gets an equal share)"
        )
    if (cfg.batch_size // shards) % cfg.grad_accum:
        return (
            f"each rank's {cfg.batch_size // shards} images per step do not "
            f"split into --grad-accum {cfg.grad_accum} equal micro-batches"
        )
    if train_size < cfg.batch_size:
        return f"{train_size} training images make no full global batch of {cfg.batch_size}"
    return None
