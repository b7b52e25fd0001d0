"""Reading files that someone else may have written, without running their code.

A pickle is a program: its GLOBAL opcodes name any importable callable and REDUCE calls it, so
`pickle.load` of a crafted file (a checkpoint from a colleague's folder, a data set from a
mirror) runs whatever it asks for. Every pickle a run reads comes through here, each read by an
allow-list of what its format holds, anything else refused before it is imported:
- torch's files (a checkpoint's meta.pt, state.pt, stage and rng files): `torch_file`, torch's
  weights-only loader (tensors and plain data; torch's default since 2.6).
- CIFAR-10's python batches: `pickle`, with dataset_files' list of numpy's array classes.
- torch.distributed.checkpoint (FSDP's shards): torch reads its `.metadata` with plain
  `pickle.load` and the non-tensor items (the optimizer's settings) with
  `torch.load(weights_only=False)`; `dcp_load` checks the first against DCP's own classes and
  reads the second weights-only.
What stays trusted, as in torch itself: the rendezvous store and the job's network
(docs/reliability.md#what-the-run-trusts).
"""

import io
import pickle as _pickle
from pathlib import Path
from typing import BinaryIO

import torch


class Refused(_pickle.UnpicklingError):
    """A file that holds more than its format allows: nothing in it was run."""


class _Unpickler(_pickle.Unpickler):
    def __init__(self, file: BinaryIO, allowed: frozenset[tuple[str, str]], **kwargs):
        super().__init__(file, **kwargs)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise Refused(
                f"it names {module}.{name}, which this format never holds; nothing in it was run"
            )
        return super().find_class(module, name)


def pickle(file: BinaryIO, allowed: frozenset[tuple[str, str]], **kwargs):
    """pickle.load(file, **kwargs), resolving only the (module, name) globals in `allowed`;
    Refused for any other. Only the look-up of a global comes through Python: pickle's speed."""
    return _Unpickler(file, allowed, **kwargs).load()


# The lines of torch's refusal that say nothing of this file.
_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def torch_file(file: Path | BinaryIO):
    """torch.load, weights-only, onto the CPU. Where torch refuses, Refused in one line: torch's
    message runs to paragraphs and ends by suggesting weights_only=False."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except _pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if not line.startswith(_TORCH_BOILERPLATE)), lines[0])
        refusal = f"torch's weights-only loader refused it ({why}); nothing in it was run"
        raise Refused(refusal) from None


# What DCP's `.metadata` holds (torch/distributed/checkpoint/metadata.py and filesystem.py):
# its dataclasses, the tensors' sizes, dtypes and layouts, and the checkpoint's path.
DCP_METADATA = ".metadata"
_DCP_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
DCP_METADATA_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _DCP_CLASSES}
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),  # python 3.13's home of the class
    }
)


def dcp_metadata(folder: Path):
    """The Metadata of the DCP checkpoint in `folder`, read by the allow-list (Refused
    otherwise). dcp.load reads it again with plain pickle: a finished checkpoint is trusted not
    to change between the two reads."""
    with open(folder / DCP_METADATA, "rb") as f:
        return pickle(f, DCP_METADATA_GLOBALS)


def _weights_only_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, but a non-tensor item must load weights-only before torch's own
        load_bytes (weights_only=False) reads it: the items are a few bytes each."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            torch_file(value)
            value.seek(0)
            super().load_bytes(read_item, value)

    return WeightsOnlyLoadPlanner()


def dcp_load(state: dict, folder: Path, **kwargs) -> None:
    """dcp.load(state) from `folder`, whose pickles are first held to their formats."""
    import torch.distributed.checkpoint as dcp

    dcp_metadata(folder)
    dcp.load(state, checkpoint_id=folder, planner=_weights_only_planner(), **kwargs)
