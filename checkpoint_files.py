"""A checkpoint on disk: its folder's name and files, what its meta.pt says, finding checkpoints
in a folder, reading their files without running their code (safe_load), and whether one fits
a run (`misfit`). Writing, resuming and pruning them are checkpoint.py's.

A checkpoint is a folder `ckpt_e{epoch}_s{step}` (`Position.name`: where training continues)
holding meta.pt (the position, the run's identity, the world size, the schedule), each rank's
random streams and the model's and optimizer's state: `state.pt` where every rank holds the
whole model, a file per pipeline stage, or FSDP's shards (DCP). Only a finished checkpoint has
its meta.pt; one set aside as unreadable is `<name>.damaged`.
"""

import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

import safe_load
from config import STAGED
from utils import CheckpointError

NAME_RE = re.compile(r"^ckpt_e(\d+)_s(\d+)$")
DAMAGED_SUFFIX = ".damaged"  # an unreadable checkpoint set aside, never deleted by us
META_FILE = "meta.pt"
DDP_FILE = "state.pt"
STAGE_FILE = "stage{rank}.pt"  # a pipeline stage's parameters and optimizer state
RNG_FILE = "rng_rank{rank}.pt"  # a rank's random streams


@dataclass
class Position:
    """Where training continues: epoch `epoch` after `step` batches, with what those batches
    already added to the epoch's (global) sums."""

    epoch: int = 1
    step: int = 0
    loss_sum: float = 0.0
    seen: int = 0
    data_wait: float = 0.0
    time: float = 0.0

    @property
    def name(self) -> str:
        return f"ckpt_e{self.epoch:04d}_s{self.step:06d}"

    @property
    def resumes(self) -> str:
        """Where training goes on from here, in words (after epoch 1 the name says epoch 2)."""
        if self.step:
            return f"after step {self.step} of epoch {self.epoch}: resumes there"
        if self.epoch == 1:
            return "before any step: resumes at epoch 1"
        return f"after epoch {self.epoch - 1}: resumes at epoch {self.epoch}"


@dataclass
class Identity:
    """What a checkpoint fits: refused, with a clear message, by a run of another kind."""

    strategy: str
    model: str
    parameters: int
    global_batch: int  # a step count means this many images: mid-epoch positions need it


# ----------------------------------------------------------------------------- finding


def named_by(resume: str) -> Path:
    """The path `--resume PATH` names: a checkpoint or a folder of them (one of a checkpoint's
    files names that checkpoint)."""
    path = Path(resume)
    return path.parent if path.is_file() and (path.parent / META_FILE).is_file() else path


def _named(directory: Path, holds) -> list[Path]:
    """The paths in `directory` named as checkpoints for which holds(path), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        (tuple(map(int, m.groups())), p)
        for p in directory.iterdir()
        if (m := NAME_RE.match(p.name)) and holds(p)
    ]
    return [p for _, p in sorted(found)]


def finished(directory: Path) -> list[Path]:
    """The finished checkpoints in `directory`, oldest first (a `.tmp` one is being written)."""
    return _named(directory, lambda path: (path / META_FILE).is_file())


def latest(directory: Path) -> Path | None:
    """The newest finished checkpoint in `directory`, or None."""
    found = finished(directory)
    return found[-1] if found else None


def candidates(directory: Path) -> list[Path]:
    """Every checkpoint in `directory`, oldest first, finished or damaged (no meta file)."""
    return _named(directory, Path.is_dir)


# ----------------------------------------------------------------------------- reading


class Unreadable(CheckpointError):
    """A checkpoint whose files cannot be read (a disk fault, a file cut short)."""


def unreadable(path: Path, cause: str) -> Unreadable:
    return Unreadable(f"cannot read checkpoint {path} ({cause})")


def one_line(error: BaseException) -> str:
    """An exception's type and first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class Meta(NamedTuple):
    identity: Identity
    position: Position
    world_size: int
    scheduler: dict | None


def read_meta(path: Path) -> Meta:
    """meta.pt, read weights-only and held to the fields checkpoint.save writes (a file of
    another shape raises here, not further on)."""
    meta = safe_load.torch_file(path)
    return Meta(
        Identity(**meta["identity"]),
        Position(**meta["position"]),
        int(meta["world_size"]),
        meta.get("scheduler"),
    )


def read_state(path: Path) -> dict:
    """A whole-model file (state.pt, a stage's file): the model's and the optimizer's state."""
    state = safe_load.torch_file(path)
    if not (isinstance(state.get("model"), dict) and isinstance(state.get("optim"), dict)):
        raise ValueError(f"{path.name} holds no model and optimizer state")
    return state


def read_streams(path: Path) -> dict | None:
    """A rank's random streams, if saved (at the same world size, every rank's are)."""
    return safe_load.torch_file(path) if path.is_file() else None


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict from checkpoint `path`, in one process (verify.py): state.pt,
    or FSDP's shards gathered (only the model's tensors)."""
    whole = path / DDP_FILE
    if whole.is_file():
        return read_state(whole)["model"]
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items = safe_load.dcp_metadata(path).state_dict_metadata.items()
    model = {
        key.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in items
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # that one process reads it is the point, not a slip
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        safe_load.dcp_load({"model": model}, path, no_dist=True)
    return model


# ----------------------------------------------------------------------------- fitting


def misfit(path: Path, meta: Meta, identity: Identity, world_size: int) -> str | None:
    """Why checkpoint `path` (its meta) cannot resume a run of `identity` on world_size ranks,
    or None: what checkpoint.load refuses, and `--check` before it."""
    theirs = meta.identity
    if replace(theirs, global_batch=identity.global_batch) != identity:  # another kind of run
        return (
            f"checkpoint {path} was written by strategy={theirs.strategy} "
            f"model={theirs.model} ({theirs.parameters} parameters); this run is "
            f"strategy={identity.strategy} model={identity.model} "
            f"({identity.parameters} parameters)"
        )
    if meta.position.step and theirs.global_batch != identity.global_batch:
        return (
            f"checkpoint {path} stopped mid-epoch at global batch "
            f"{theirs.global_batch}; resume it with --batch-size "
            f"{theirs.global_batch}, or from an end-of-epoch checkpoint"
        )
    if identity.strategy in STAGED and meta.world_size != world_size:
        return (
            f"checkpoint {path} holds {meta.world_size} pipeline stages: resume it on "
            f"{meta.world_size} ranks, not {world_size}"
        )
    return None
