"""No file the run reads can run code (docs/reliability.md#what-the-run-trusts): a checkpoint's
files, FSDP's DCP metadata and items, and CIFAR-10's batches, each crafted to create a marker
file when unpickled, are refused in one line; the marker never appears; the run's own files
are as they were."""

import os
import pickle
import shutil

import pytest
import torch

import checkpoint
import checkpoint_files
import safe_load
from conftest import TINY, assert_one_line_error, run_main
from helpers import write_cifar_dir
from utils import EXIT_STATUS

BATCH_64 = [*TINY, "--batch-size", "64"]


class Payload:
    """Unpickled by a plain pickle.load, this runs a command that creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def snapshot(folder) -> dict:
    """Every file under folder with its bytes: what 'nothing touched' compares."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One rank's checkpoints, made once: ddp (whole files, two of them) and fsdp2 (DCP)."""
    root = tmp_path_factory.mktemp("saved")
    for strategy, epochs in [("ddp", "2"), ("fsdp2", "1")]:
        args = [*BATCH_64, "--epochs", epochs, "--strategy", strategy]
        done = run_main([*args, "--checkpoint-dir", root / strategy])
        assert done.returncode == 0, done.stderr[-2000:]
    return root


def copy_of(saved, strategy, tmp_path):
    folder = tmp_path / strategy
    shutil.copytree(saved / strategy, folder)
    return folder


def resume(folder, strategy, which, epochs="3"):
    args = [*BATCH_64, "--epochs", epochs, "--strategy", strategy, "--resume", which]
    return run_main([*args, "--checkpoint-dir", folder])


@pytest.mark.parametrize("file", [checkpoint.META_FILE, checkpoint.DDP_FILE, "rng_rank0.pt"])
def test_a_crafted_checkpoint_file_is_refused_its_code_not_run(saved, tmp_path, file):
    """--resume PATH of a checkpoint one of whose files is a pickle that runs a command: the
    checkpoint error's line and status, no marker, every file as it was."""
    folder = copy_of(saved, "ddp", tmp_path)
    newest = checkpoint.latest(folder)
    marker = tmp_path / "ran"
    torch.save({"identity": Payload(marker)}, newest / file)
    before = snapshot(folder)
    line = assert_one_line_error(
        resume(folder, "ddp", newest),
        f"cannot read checkpoint {newest}",
        "nothing in it was run",
        status=EXIT_STATUS["checkpoint"],
    )
    assert "posix.system" in line or "os.system" in line, line
    assert not marker.exists(), "the payload ran"
    assert snapshot(folder) == before


def test_resume_auto_passes_over_a_crafted_checkpoint_saying_so(saved, tmp_path):
    folder = copy_of(saved, "ddp", tmp_path)
    older, newest = checkpoint.candidates(folder)[-2:]
    marker = tmp_path / "ran"
    torch.save(Payload(marker), newest / checkpoint.DDP_FILE)
    done = resume(folder, "ddp", "auto")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"cannot read checkpoint {newest} (Refused:" in done.stdout
    assert f"resumed from {older}" in done.stdout
    assert not marker.exists(), "the payload ran"
    assert (folder / f"{newest.name}{checkpoint.DAMAGED_SUFFIX}").is_dir(), "set aside, kept"


def test_a_well_formed_meta_file_of_another_shape_is_the_checkpoint_error(saved, tmp_path):
    """Loadable weights-only but not what save() writes: once a raw TypeError traceback."""
    folder = copy_of(saved, "ddp", tmp_path)
    newest = checkpoint.latest(folder)
    torch.save({"identity": 5, "position": {}}, newest / checkpoint.META_FILE)
    assert_one_line_error(
        resume(folder, "ddp", newest),
        f"cannot read checkpoint {newest} (TypeError",
        status=EXIT_STATUS["checkpoint"],
    )


def test_crafted_dcp_metadata_is_refused_its_code_not_run(saved, tmp_path):
    """torch reads DCP's .metadata with plain pickle.load: the project reads it first."""
    folder = copy_of(saved, "fsdp2", tmp_path)
    newest = checkpoint.latest(folder)
    marker = tmp_path / "ran"
    (newest / safe_load.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))
    before = snapshot(folder)
    assert_one_line_error(
        resume(folder, "fsdp2", newest, epochs="2"),
        f"cannot read checkpoint {newest}",
        "names posix.system, which this format never holds",
        status=EXIT_STATUS["checkpoint"],
    )
    assert not marker.exists(), "the payload ran"
    assert snapshot(folder) == before


def test_real_dcp_checkpoints_read_whole_as_torch_reads_them(saved):
    """checkpoint_files.read_model (verify's --max-diff) gathers FSDP's shards through the checks:
    the same tensors as torch's own dcp_to_torch_save, which reads without them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = checkpoint.latest(saved / "fsdp2")
    ours = checkpoint_files.read_model(newest)
    whole = newest.parent / "whole.pt"
    dcp_to_torch_save(newest, whole)
    theirs = torch.load(whole, weights_only=True)["model"]
    whole.unlink()
    assert ours.keys() == theirs.keys() and len(ours) > 0
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_a_crafted_dcp_item_is_refused_where_torch_would_run_it(tmp_path):
    """DCP's non-tensor items (the optimizer's settings) are read by torch with
    torch.load(weights_only=False); dcp_load reads them weights-only first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    marker = tmp_path / "ran"
    state = {"weight": torch.ones(3), "lr": Payload(marker)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    target = {"weight": torch.empty(3), "lr": 0.0}
    with pytest.raises(CheckpointException) as refused:  # DCP wraps each rank's error
        safe_load.dcp_load(target, tmp_path / "ckpt", no_dist=True)
    assert "rank 0: Refused: torch's weights-only loader refused it" in checkpoint._cause(
        refused.value
    )
    assert not marker.exists(), "the payload ran"
    dcp.load(target, checkpoint_id=tmp_path / "ckpt", no_dist=True)  # torch's own reader
    assert marker.exists(), "the crafted item does run code where nothing checks it"


def test_a_crafted_cifar_batch_stops_the_run_in_one_line(tmp_path):
    folder = write_cifar_dir(tmp_path / "data")
    marker = tmp_path / "ran"
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": Payload(marker)}))
    assert_one_line_error(
        run_main(
            [*BATCH_64, "--no-checkpoint", "--dataset", "cifar10", "--data-dir", folder.parent]
        ),
        "data_batch_1 is not a CIFAR-10 python batch and was not loaded",
        "nothing in it was run",
    )
    assert not marker.exists(), "the payload ran"


def test_a_crafted_data_cache_is_rebuilt_its_code_not_run(tmp_path):
    """The decoded cache beside the files is torch's format, read weights-only: a crafted one
    is as good as absent (decoded again from the batches and rewritten)."""
    import data
    import dataset_files

    write_cifar_dir(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"signature": Payload(marker)}, dataset_files.cache_path("cifar10", tmp_path))
    train, val = data.load_files("cifar10", tmp_path, download=False)
    assert (len(train), len(val)) == (100, 30)
    assert not marker.exists(), "the payload ran"
