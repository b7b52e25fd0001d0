"""Checkpoints that survive preemption: saved every epoch and when SLURM warns; resumed anywhere.

DDP: every rank holds the same weights, so rank 0 alone writes one file (a full state dict).
FSDP: each rank writes its own shard through torch.distributed.checkpoint (DCP), which reshards
on load, so a run may resume at another world size. A pipeline: each rank writes its stage's
file. All go through `get_state_dict` / `set_state_dict`, which understand every wrapper. What
a checkpoint's folder holds, and how its files are read, is checkpoint_files.py's.

Everything is written into `<name>.tmp/` first and renamed once every rank has finished, so a
crash mid-write leaves the previous checkpoint as the latest. Only `prune` deletes checkpoints
(beyond --keep-last, never the one resumed from); a fresh run never writes into a folder that
holds another run's. When to save on a signal is stopping.py's to say.

Faults (docs/reliability.md): a failure while saving or loading, on any rank, becomes the same
`CheckpointError` on every rank, leaving no half-written folder; a checkpoint that cannot be
read is never overwritten, pruned or deleted: once a run goes on from an older one, it is
renamed aside to `<name>.damaged`.
"""

import contextlib
import os
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

import safe_load
from checkpoint_files import (
    DAMAGED_SUFFIX,
    DDP_FILE,
    META_FILE,
    NAME_RE,
    RNG_FILE,
    STAGE_FILE,
    Identity,
    Position,
    Unreadable,
    candidates,
    finished,
    latest,
    misfit,
    named_by,
    one_line,
    read_meta,
    read_state,
    read_streams,
    unreadable,
)
from config import SHARDED, STAGED, Config
from layout import CHECKPOINTS_DIR, run_id
from peer_failures import is_peer_failure
from utils import CheckpointError, UsageError, is_rank_zero, log0, read_ranks

# torch.distributed.checkpoint (DCP) is imported where a checkpoint is written or read: it loads
# FSDP and DTensor (about a second), which `main.py --check`, run before every launch, skips.


def run_identity(cfg: Config, parameters: int) -> Identity:
    """What the checkpoints of a run of `cfg`, whose model has `parameters`, are."""
    return Identity(cfg.strategy, cfg.model, parameters, cfg.batch_size)


class Resumable(NamedTuple):
    """What a checkpoint holds of a run beside its position: the model and optimizer (any
    wrapper's), the loaders' random stream and the schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


@contextlib.contextmanager
def _quiet_fsdp1_state_dict():
    """FSDP1's warnings at every state dict, once per tensor per rank, that say nothing a user
    can act on: its ShardedTensors are to become DTensors; at world size 1 (NO_SHARD on
    purpose) the state dict is the whole model's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
        warnings.filterwarnings("ignore", message=".*Multiple backends are registered.*")
        warnings.filterwarnings(
            "ignore", message="When using ``NO_SHARD`` .*full_state_dict will", category=UserWarning
        )
        yield


def _rank() -> int:
    """This rank's number, for the files it writes (is_rank_zero() decides who writes alone)."""
    return read_ranks()[0]


def _world() -> int:
    return read_ranks()[2]


def _rng_state(generator: torch.Generator | None) -> dict:
    state = {"torch": torch.get_rng_state()}
    if generator is not None:
        state["loader"] = generator.get_state()
        state["loader_device"] = generator.device.type
    if torch.cuda.is_initialized():  # asking a GPU this run never used would open a context
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, generator: torch.Generator | None) -> bool:
    """Restore the random streams; False if they cannot carry over (a generator's state is
    specific to its device type: a checkpoint moved between a CPU and a GPU machine)."""
    if generator is not None and state.get("loader_device", "cpu") != generator.device.type:
        return False
    torch.set_rng_state(state["torch"])
    if generator is not None and "loader" in state:
        generator.set_state(state["loader"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])
    return True


def _whole(identity: Identity) -> bool:
    """Whether every rank holds the whole model, or a part of it (a shard, a pipeline stage)."""
    return identity.strategy not in (*SHARDED, *STAGED)


def _state_file(folder: Path, identity: Identity) -> Path | None:
    """This rank's file of the model's and optimizer's state: the whole model's (rank 0 writes
    it), or its pipeline stage's; None for FSDP's shards, which are DCP's files."""
    if identity.strategy in SHARDED:
        return None
    return folder / (DDP_FILE if _whole(identity) else STAGE_FILE.format(rank=_rank()))


def save(directory: Path, position: Position, identity: Identity, resumable: Resumable) -> Path:
    """Every rank calls this. Returns the checkpoint's folder (replacing one of that name).

    A failure on any rank raises the same CheckpointError on every rank, once the others have
    finished their part, naming the checkpoint, the cause and the newest one left intact; the
    half-written folder is removed (where the file system refuses that too, the line says so)."""
    directory = Path(directory)
    final = directory / position.name
    tmp = directory / (position.name + ".tmp")
    _, error = _together(_make_empty, directory, tmp, alone=True)
    if not error:
        _, error = _together(_write, tmp, position, identity, resumable)
    if not error:
        _, error = _together(_move_into_place, tmp, final, alone=True)
    if error:
        _, left = _together(_discard, tmp, alone=True)
        kept = (
            f"its unfinished {tmp.name} could not be removed ({left}): no run takes it for a "
            "checkpoint, and the next save removes it"
            if left
            else f"nothing of it was kept (no {tmp.name} left behind)"
        )
        raise CheckpointError(
            f"cannot save checkpoint {final}: {error}; {kept}, and {_intact(directory)}"
        )
    if is_rank_zero():
        _remove_leftovers(directory)
    return final


def _make_empty(directory: Path, tmp: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # our own leftover from a crash mid-write: never a finished checkpoint
        shutil.rmtree(tmp)
    tmp.mkdir()


def _discard(tmp: Path) -> None:
    """Remove a failed save's unfinished folder, if it was made (a read-only file system refuses
    this too: the ranks agree on how it went, and the line says so)."""
    if tmp.exists():
        shutil.rmtree(tmp)


def _write(tmp: Path, position: Position, identity: Identity, resumable: Resumable) -> None:
    """This rank's part of a checkpoint, into `tmp` (DCP's sharded save is collective, and
    raises on every rank if one fails)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizer, generator, scheduler = resumable
    full, file = _whole(identity), _state_file(tmp, identity)
    with _quiet_fsdp1_state_dict():
        model_state, optim_state = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
        )
        state = {"model": model_state, "optim": optim_state}
        if file is None:
            dcp.save(state, checkpoint_id=tmp)
        elif not full or is_rank_zero():
            torch.save(state, file)
    torch.save(_rng_state(generator), tmp / RNG_FILE.format(rank=_rank()))
    if is_rank_zero():
        torch.save(
            {
                "position": asdict(position),
                "identity": asdict(identity),
                "world_size": _world(),
                "scheduler": scheduler.state_dict() if scheduler else None,
            },
            tmp / META_FILE,
        )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename a finished checkpoint folder to its name: atomic, so it appears complete or not at
    all, and only once its files are on disk (fsync: a power cut must not leave a named
    checkpoint of empty files). One already there is set aside first: one without its meta
    file (damaged) for good, as `<name>.damaged`; a finished one (resumed from an older
    checkpoint on purpose) is deleted once the new one is in place."""
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    old, damaged = None, False
    if final.exists():
        damaged = not (final / META_FILE).is_file()
        old = _aside(final) if damaged else final.with_name(final.name + ".old")
        if not damaged:
            shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:  # the one set aside goes back: as it was
            os.replace(old, final)
        raise
    _fsync(final.parent)
    if damaged:
        log0(f"[CHECKPOINT] {final} had no {META_FILE}: set aside as {old}, never deleted")
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _aside(path: Path) -> Path:
    """A free name for setting `path` aside as damaged: <name>.damaged, .damaged2, ..."""
    aside, n = path.with_name(path.name + DAMAGED_SUFFIX), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{DAMAGED_SUFFIX}{n}")
    return aside


def _remove_leftovers(directory: Path) -> None:
    """Folders that runs killed mid-write (or mid-delete) left (rank 0, after a save): never a
    checkpoint. Whatever cannot be removed stays, harmlessly."""
    for path in directory.glob("ckpt_e*_s*.*"):
        stem, _, suffix = path.name.rpartition(".")
        if suffix in ("tmp", "deleting") and NAME_RE.match(stem) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            log0(f"[CHECKPOINT] removed {path}, which a killed run left unfinished")


def _cause(error: BaseException) -> str:
    """What went wrong, in one line: the exception's type and first line; for DCP's
    CheckpointException (which holds every failed rank's), each rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {_cause(wrapped[0])}" for rank, wrapped in sorted(error.failures.items())
        )
    return one_line(error)


def _together(fn, *args, alone: bool = False) -> tuple[object, str | None]:
    """fn on every rank (alone: on rank 0 only), after which the ranks agree on how it went:
    (fn's result, None) where it worked everywhere, else (None, the first failure) on every
    rank. Each step of a save or a load goes through here, so that a rank that failed goes on
    to the same next collective as the others (not a mismatch, or a hang until --pg-timeout).
    A peer's death is no checkpoint fault: it goes on up, to end the run as one."""
    from torch.distributed.checkpoint.api import CheckpointException

    value, error = None, None
    if not alone or is_rank_zero():
        try:
            value = fn(*args)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            if isinstance(e, Exception) and is_peer_failure(e):
                raise
            error = _cause(e)
    error = _agree(error)
    return (None, error) if error else (value, None)


def _agree(error: str | None) -> str | None:
    """Every rank's outcome of a step, gathered: the first failure (naming its rank), the same on
    every rank; None if every rank succeeded. Also a barrier."""
    if not dist.is_initialized() or _world() == 1:
        return error
    errors = [None] * _world()
    dist.all_gather_object(errors, error)
    for rank, e in enumerate(errors):
        if e:
            return e if e.startswith("rank ") else f"rank {rank}: {e}"
    return None


def _intact(directory: Path) -> str:
    newest = latest(directory)
    if newest is None:
        return f"{directory} holds no earlier checkpoint"
    return f"the newest checkpoint, {newest}, is intact (--resume auto continues from it)"


def folder_for(checkpoint_dir: str | None, resume: str | None) -> Path:
    """Where a run's checkpoints go: the folder asked for; else beside the checkpoint resumed
    from; else one per run_id (a requeued SLURM job keeps its id, so it finds its own)."""
    if checkpoint_dir:
        return Path(checkpoint_dir)
    if resume not in (None, "auto"):
        resumed = named_by(resume)
        return resumed.parent if (resumed / META_FILE).is_file() else resumed
    return CHECKPOINTS_DIR / run_id()


def refuse_overwrite(folder: Path, resume: str | None) -> None:
    """A fresh run must not mix its checkpoints with an earlier run's."""
    if resume is None and latest(folder):
        raise UsageError(
            f"{folder} already holds checkpoints of an earlier run: continue it "
            "with --resume auto, or choose another --checkpoint-dir"
        )


def prepare_folder(checkpoint_dir: str | None, resume: str | None) -> Path:
    """The run's checkpoint folder, created and known to be writable (rank 0 calls this)."""
    folder = folder_for(checkpoint_dir, resume)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".writable"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"checkpoint folder {folder} is not writable ({e.strerror}); "
            "choose another with --checkpoint-dir"
        ) from None
    refuse_overwrite(folder, resume)
    return folder


def prune(directory: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` finished checkpoints (0: keep all), never `protect`
    (the one resumed from) nor one being written. Rank 0 calls this. Returns what went."""
    old = finished(directory)[:-keep] if keep else []
    gone = [p for p in old if protect is None or p.resolve() != Path(protect).resolve()]
    for path in list(gone):
        try:  # renamed first: a kill mid-delete leaves no half-deleted checkpoint by its name
            trash = path.with_name(path.name + ".deleting")
            os.replace(path, trash)
            shutil.rmtree(trash)
        except OSError as e:  # nothing is lost by keeping it: say so, and train on
            gone.remove(path)
            log0(f"[CHECKPOINT] could not delete {path} ({_cause(e)}): it stays")
    return gone


def chosen(resume: str) -> Path:
    """The checkpoint `--resume PATH` names: itself, or the newest in a folder of them (looked
    for before the run creates anything: a mistyped path is one line, no folder)."""
    path = named_by(resume)
    if not (path / META_FILE).is_file():
        path = latest(path)  # a folder of checkpoints
        if path is None:
            raise UsageError(f"--resume {resume}: no checkpoint there")
    return path


def resolve(resume: str, directory: Path) -> Path | None:
    """`--resume auto` (the latest in the checkpoint folder, if any) or a path."""
    return latest(directory) if resume == "auto" else chosen(resume)


def _read(path: Path, fn, *args):
    """fn(*args), a read of checkpoint `path` on every rank, which then agree: what any rank
    cannot read is Unreadable on all of them, at the same step (_together)."""
    value, error = _together(fn, *args)
    if error:
        raise unreadable(path, error)
    return value


def _load_shards(path: Path, model, optimizer) -> dict:
    """FSDP's sharded state, read through DCP into this rank's shapes (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from optim import KEPT_ON_RESUME

    model_state, optim_state = get_state_dict(model, optimizer)  # shapes to fill
    for group in optim_state["param_groups"]:
        # Not the checkpoint's to set (optim.keep_as_built); a checkpoint written without a
        # schedule holds no initial_lr.
        for key in KEPT_ON_RESUME:
            group.pop(key, None)
        # A graphed run with a schedule saves its rate as a tensor, any other run as a number:
        # DCP reads a number into a tensor's place, not a tensor into a number's.
        group["lr"] = torch.tensor(float(group["lr"]))
    state = {"model": model_state, "optim": optim_state}
    safe_load.dcp_load(state, path)
    return state


def check_resume(resume: str, directory: Path, identity: Identity, world_sizes: list[int]) -> None:
    """`--check`'s word on `--resume`: the checkpoint the run would start from is there and
    fits the run at every world size, or the run's own error now, from its meta.pt alone (DCP
    not loaded). With auto, one whose meta cannot be read is left to the run, which passes over
    it to an older one."""
    path = resolve(resume, directory)
    if path is None:
        return
    try:
        meta = read_meta(path / META_FILE)
    except Exception as e:
        if resume == "auto":
            return
        raise unreadable(path, one_line(e)) from None
    for world_size in world_sizes:
        if why := misfit(path, meta, identity, world_size):
            raise UsageError(why)


def load(path: Path, identity: Identity, resumable: Resumable) -> Position:
    """Every rank calls this. Restore model, optimizer, scheduler and (at the same world size)
    every rank's random streams. What any rank cannot read is Unreadable on every rank."""
    model, optimizer, generator, scheduler = resumable
    meta = _read(path, read_meta, path / META_FILE)
    if why := misfit(path, meta, identity, _world()):
        raise UsageError(why)
    position = meta.position
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    file = _state_file(path, identity)
    with _quiet_fsdp1_state_dict():
        if file is None:
            state = _read(path, _load_shards, path, model, optimizer)
        else:
            state = _read(path, read_state, file)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(full_state_dict=_whole(identity)),
        )
    if scheduler is not None and meta.scheduler:
        scheduler.load_state_dict(meta.scheduler)
    # At another world size the ranks' streams do not map onto the new ranks: keep fresh ones.
    if meta.world_size != _world():
        log0(
            f"[CHECKPOINT] written at world size {meta.world_size}, resumed at {_world()}: "
            "the random streams start afresh"
        )
    elif streams := _read(path, read_streams, path / RNG_FILE.format(rank=_rank())):
        if not _set_rng_state(streams, generator):
            log0("[CHECKPOINT] written on another device type: the random streams start afresh")
    return position


def load_chosen(path: Path, identity: Identity, resumable: Resumable) -> Position:
    """`--resume PATH`: `load`. A checkpoint that cannot be read ends the run (the user chose
    it: no guessing at another), saying that nothing was touched and how to go on."""
    try:
        return load(path, identity, resumable)
    except Unreadable as e:
        raise Unreadable(
            f"{e}; nothing was written and every checkpoint is as it was: repair it, or go on "
            f"from the newest readable one with --resume auto --checkpoint-dir {path.parent}"
        ) from None


def load_newest_readable(
    directory: Path, identity: Identity, resumable: Resumable
) -> tuple[Path | None, Position]:
    """`--resume auto`: the newest checkpoint that every rank can read (the ranks decide
    together). One that any rank cannot read is passed over, saying so, and then renamed aside
    (`<name>.damaged`). Where there are checkpoints but none can be read, raises Unreadable
    naming each, having written nothing: starting afresh would throw the training away."""
    found, damaged = candidates(directory), []
    for path in reversed(found):
        try:
            position = load(path, identity, resumable)
        except Unreadable as e:
            damaged.append((path, str(e)))
            if path != found[0]:
                log0(f"[CHECKPOINT] {e}: trying an older one")
            continue
        _, error = _together(_set_aside, damaged, alone=True)
        if error:
            raise CheckpointError(
                f"cannot set aside the unreadable checkpoint(s) "
                f"{', '.join(str(p) for p, _ in damaged)}: {error}; nothing "
                f"was written, {path} is intact"
            )
        return path, position
    if damaged:
        reasons = "; ".join(why.removeprefix("cannot read checkpoint ") for _, why in damaged)
        raise Unreadable(
            f"--resume auto: no checkpoint in {directory} can be read, so none is resumed and "
            f"nothing was written: {reasons}. Repair them, or move them out of {directory} "
            f"(then --resume auto starts afresh there); or start afresh on purpose with "
            f"another --checkpoint-dir"
        )
    return None, Position()


def _set_aside(damaged: list[tuple[Path, str]]) -> None:
    """Rename unreadable checkpoints to <name>.damaged (rank 0), saying so."""
    for path, why in damaged:
        aside = _aside(path)
        os.replace(path, aside)
        log0(
            f"[CHECKPOINT] set {path} aside as {aside}: it cannot be read, and is kept as it "
            f"is ({why.removeprefix(f'cannot read checkpoint {path} ')})"
        )
