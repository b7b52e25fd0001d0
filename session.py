"""One rank's training session: its `Trainer` built from the options (data, model, the
strategy's wrapper, optimizer), resumed from a checkpoint if asked, and trained until the last
epoch or a stop that every rank agreed on, with a checkpoint after each epoch and at the stop.

main.py reads and checks the options first and imports this module after: torch, the data and
the wrappers load only for a command line that is good.
"""

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import checkpoint
import data
import distributed_utils
import feasibility
import layout
import peer_failures
import stopping
from comm_bench import run_comm_benchmark
from config import LAYER_SPLIT, STAGED, Config, data_world, microbatches
from cost_model import UNKNOWN, ModelFlops, device_peak_tflops, state_mem, training_flops_per_image
from fsdp_utils import effective_sharding
from measure import ComputeCalibration, EpochMeters, MemoryMeter
from model import build_model, count_parameters
from optim import make_optimizer, make_scheduler
from precision import make_precision, set_process_precision
from profiling import StepProfiler, profile_path, profile_report
from strategies import STEP_COLLECTIVES, compiled, devices_per_rank, wrap_model
from train import Diverged, Learner, Trainer
from utils import format_config, is_rank_zero, log0

# ----------------------------------------------------------------------------- building


def trainer_class(staged: bool) -> type[Trainer]:
    """The pipeline's trainer for a staged run, else the data-parallel one. Imported only for
    a pipeline: torch.distributed.pipelining takes most of a second to import, which every rank
    of every other launch would pay."""
    if not staged:
        return Trainer
    from pipeline_utils import PipelineTrainer

    return PipelineTrainer


def build_trainer(cfg: Config, env: distributed_utils.DistEnv) -> tuple[Trainer, dict]:
    """This rank's trainer, and the resolved configuration for the `[CONFIG]` line."""
    spec = data.DATASETS[cfg.dataset]
    augment = spec.augment if cfg.augment is None else cfg.augment
    nodes = distributed_utils.num_nodes()
    train_set, val_set = data.load_splits(
        cfg.dataset, cfg.data_dir, cfg.seed, cfg.train_samples, cfg.val_samples, cfg.download
    )
    feasibility.check(cfg, [env.world_size], len(train_set), env.device)
    graphed, _ = feasibility.decide_graphs(cfg, env.device, env.world_size)
    cfg = replace(cfg, cuda_graphs=graphed)  # the default, resolved
    precision = make_precision(cfg.precision, env.device, cfg.cuda_graphs, cfg.strategy)
    fp32_math = set_process_precision(cfg.precision)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    shards = data_world(cfg.strategy, env.world_size)  # a pipeline's stages: one, the whole set
    loaders = data.build_loaders(
        train_set,
        val_set,
        spec,
        kind=cfg.loader,
        rank=env.rank if shards == env.world_size else 0,
        world_size=shards,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        augment=augment,
        device=env.device,
        num_workers=cfg.num_workers,
        memory_format=memory_format,
    )
    sizes = {"train_size": len(train_set), "val_size": len(val_set)}
    del train_set, val_set  # the loaders hold what they need: the baseline must not count these
    # Before the baseline: the calibration's own model and optimizer are not the training's.
    # A pipeline's stage measures its own compute as it trains (pipeline_utils.TimedStage).
    staged = cfg.strategy in STAGED
    stage_microbatches = microbatches(cfg, env.world_size) if staged else None
    calibration = None if staged else calibrate_compute(cfg, env, spec, memory_format)
    memory = MemoryMeter(env.device)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, spec.num_classes, spec.image_shape)
    parameters = count_parameters(model)
    state_pred = state_mem(cfg, model, env.world_size, nodes)
    model = wrap_model(cfg, model, env.device, env.rank, env.world_size, nodes)
    optimizer = make_optimizer(cfg, model)
    devices = env.world_size * devices_per_rank(model)
    flops = ModelFlops(
        per_image=training_flops_per_image(cfg.model, spec.num_classes, spec.image_shape),
        devices=devices,
        peak_tflops=cfg.peak_tflops or device_peak_tflops(env.device, cfg.precision),
    )

    # The [METRIC] line's fields that are not measured (their order is utils.METRIC_FIELDS'):
    # those that name the run, those that say how it ran, and those known once it is built.
    run_labels = {
        "strategy": cfg.strategy,
        "world_size": env.world_size,
        "nodes": nodes,
        "global_batch": cfg.batch_size,
        "local_batch": cfg.batch_size // shards,
    }
    setting = {
        "precision": cfg.precision,
        "device": env.device.type,
        "dataset": cfg.dataset,
        "seed": cfg.seed,
        "job_id": layout.job_id(),
    }
    built = {
        # Model parallelism on one device (a CPU) runs the model whole, as `single` does.
        "sharding": "split"
        if cfg.strategy in LAYER_SPLIT and devices > 1
        else effective_sharding(model, cfg.sharding),
        "train_images": len(loaders.train) * cfg.batch_size,
        "microbatches": stage_microbatches or UNKNOWN,
        "state_pred": state_pred,
    }
    resolved = {
        **asdict(cfg),
        **run_labels,
        "augment": augment,
        "backend": env.backend,
        "fp32_math": fp32_math,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "rendezvous": distributed_utils.rendezvous_text(env.world_size),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),  # the node's: its ranks' threads share them
        **sizes,
        "steps_per_epoch": len(loaders.train),
        "parameters": parameters,
        **gpu_memory(env.device),
        **built,  # as [METRIC] reads them: the sharding that ran, not --sharding's default
        "flops_per_image": flops.per_image,
        "peak_tflops": flops.peak_tflops or UNKNOWN,
        "torch": torch.__version__,
        **setting,
    }
    pipeline = dict(microbatches=stage_microbatches, schedule_name=cfg.schedule) if staged else {}
    trainer = trainer_class(staged)(
        **pipeline,
        model=model,
        optimizer=optimizer,
        precision=precision,
        env=env,
        loaders=loaders,
        meters=EpochMeters(
            memory=memory,
            flops=flops,
            labels={**run_labels, **setting, **built},
            calibration=calibration,
        ),
        print_every=cfg.print_every,
        scheduler=make_scheduler(cfg, optimizer, len(loaders.train)),
        grad_accum=cfg.grad_accum,
        clip_grad=cfg.clip_grad,
        cuda_graphs=cfg.cuda_graphs,
        step_collectives=STEP_COLLECTIVES[cfg.strategy],
    )
    return trainer, resolved


def gpu_memory(device: torch.device) -> dict:
    """The [CONFIG] line's gpu_memory, the GPU's bytes, which report.md's projection of the
    largest model fits into (projection.py); none on a CPU, whose memory is no GPU's."""
    if device.type != "cuda":
        return {}
    return {"gpu_memory": torch.cuda.get_device_properties(device).total_memory}


def validation_note(cfg: Config, train_size: int, val_size: int) -> str | None:
    """Said where a run trains on fewer images (--train-samples) than it validates on every
    epoch (all, without --val-samples): validation then takes longer than training (3.6 times
    for ResNet-18 on 512 of 10,000 on a CPU; docs/performance.md). Not scaled with
    --train-samples: its accuracy would become another measure."""
    if cfg.train_samples is None or cfg.val_samples is not None or val_size <= train_size:
        return None
    return (
        f"[CONFIG] note: every epoch validates all {val_size} validation images, more than "
        f"the {train_size} it trains on: --val-samples N validates the first N"
    )


def calibrate_compute(
    cfg: Config,
    env: distributed_utils.DistEnv,
    spec: data.DatasetSpec,
    memory_format: torch.memory_format,
) -> ComputeCalibration:
    """An unwrapped copy of the training step for t_compute, built with the random streams
    restored afterwards, so that training is exactly as without it: compiled where the run is
    (--compile), one CUDA graph where the run's step is (--cuda-graphs)."""
    forked = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        model = build_model(cfg.model, spec.num_classes, spec.image_shape).to(
            env.device, memory_format=memory_format
        )
        # As one process runs it: autocast (also for FSDP, whose policy casts the real one), a
        # plain scaler (FSDP1's would all-reduce, over ranks that step different counts).
        learner = Learner(
            model=compiled(cfg, model),
            optimizer=make_optimizer(cfg, model),
            precision=make_precision(cfg.precision, env.device, cfg.cuda_graphs),
            env=env,
            grad_accum=cfg.grad_accum,
            clip_grad=cfg.clip_grad,
            cuda_graphs=cfg.cuda_graphs,
        )
        size = cfg.batch_size // env.world_size
        # In the loaders' memory format: a layout conversion is not the step's compute.
        images = torch.randn(size, *spec.image_shape, device=env.device)
        labels = torch.randint(0, spec.num_classes, (size,), device=env.device)
        batch = (images.contiguous(memory_format=memory_format), labels)
        return ComputeCalibration(learner.train_step, batch, learner.loss_sum)


# ----------------------------------------------------------------------------- running


@dataclass
class Outcome:
    trainer: Trainer
    history: list[dict]  # the [METRIC] fields of the epochs this process finished
    stopped_at: checkpoint.Position | None  # where a stop left training, if one came
    folder: Path | None  # where the checkpoints are
    diverged: str | None = None  # why training was given up, if it diverged


def run(cfg: Config, env: distributed_utils.DistEnv) -> Outcome:
    """Build, resume if asked, then train until cfg.epochs or until a stop signal (then save)."""
    chosen = checkpoint.chosen(cfg.resume) if cfg.resume not in (None, "auto") else None
    trainer, resolved = build_trainer(cfg, env)
    if cfg.profile:
        trainer.meters.profiler = StepProfiler(profile_path(env), env.device, trainer.cuda_graphs)
    folder = (
        distributed_utils.on_rank0(checkpoint.prepare_folder, cfg.checkpoint_dir, cfg.resume)
        if cfg.checkpoint
        else None
    )
    fits = checkpoint.run_identity(cfg, resolved["parameters"])
    resumable = checkpoint.Resumable(
        trainer.model, trainer.optimizer, trainer.loaders.generator, trainer.scheduler
    )
    source, position = None, checkpoint.Position()
    if cfg.resume == "auto":
        source, position = checkpoint.load_newest_readable(folder or Path("."), fits, resumable)
    elif chosen:
        source, position = chosen, checkpoint.load_chosen(chosen, fits, resumable)
    log0(format_config({**resolved, "checkpoint_dir": folder, "resumed_from": source}))
    if note := validation_note(cfg, resolved["train_size"], resolved["val_size"]):
        log0(note)
    if why_eager := feasibility.decide_graphs(cfg, env.device, env.world_size)[1]:
        log0(f"[CONFIG] note: the step runs eager, not as one CUDA graph: {why_eager}")
    if warning := distributed_utils.network_warning(resolved["nodes"], env.backend):
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
        peer_failures.say_where(f"saving checkpoint {at.name}")
        log0(f"[CHECKPOINT] saved {checkpoint.save(folder, at, fits, resumable)} ({at.resumes})")
        if is_rank_zero():
            for old in checkpoint.prune(folder, cfg.keep_last, protect=source):
                log0(f"[CHECKPOINT] deleted {old} (--keep-last {cfg.keep_last})")

    with stopping.StopRequest(cfg.pg_timeout) as stop:
        try:
            history, stopped_at = trainer.fit(position, cfg.epochs, stop, save)
        except Diverged as e:
            why = f"{e}: training diverged (try a lower --lr); {last_good_checkpoint(folder)}"
            return Outcome(trainer, [], None, folder, why)
    if trainer.meters.profiler:
        log0(profile_report(trainer.meters.profiler))
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
    job = {"job_id": layout.job_id()}
    run_comm_benchmark(model, env.device, cfg.precision, cfg.strategy, extra=job)
