"""Sharding, augmentation, exact validation and CIFAR-10 loading (files the tests write)."""

import pickle
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

import data
import dataset_files
from config import Config
from dist_harness import spawn, spawn_outcomes, train_and_gather
from helpers import write_cifar_dir
from session import build_trainer
from utils import UsageError

SPEC = data.DATASETS["synthetic"]


def indexed_split(n: int) -> data.Split:
    """Images whose first pixel encodes their index, so batches reveal what they contain."""
    images = torch.zeros(n, 3, 32, 32, dtype=torch.uint8)
    images[:, 0, 0, 0] = torch.arange(n) % 256
    images[:, 1, 0, 0] = torch.arange(n) // 256
    return data.Split(images, torch.arange(n) % 10)


def cpu_loaders(
    split, global_batch, kind="tensor", rank=0, world_size=1, seed=0, augment=False
) -> data.Loaders:
    """A rank's loaders on the CPU, validating on the training split, no worker processes."""
    return data.build_loaders(
        split,
        split,
        SPEC,
        kind=kind,
        rank=rank,
        world_size=world_size,
        global_batch=global_batch,
        seed=seed,
        augment=augment,
        device=torch.device("cpu"),
        num_workers=0,
    )


def seen_indices(loader, split) -> list[int]:
    out = []
    for images, _ in loader:
        # Undo normalization to recover the encoded index.
        raw = images[:, :2, 0, 0] * torch.tensor(SPEC.std[:2]) + torch.tensor(SPEC.mean[:2])
        raw = (raw * 255).round().long()
        out += (raw[:, 0] + 256 * raw[:, 1]).tolist()
    return out


@pytest.mark.parametrize("kind", ["tensor", "classic"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_gets_what_distributed_sampler_assigns_in_a_new_order_each_epoch(
    kind, world_size
):
    """Every sample once per epoch across the ranks, each rank exactly the samples, in the
    order, that DistributedSampler assigns it, another order each epoch."""
    n, global_batch = 240, 24
    split = indexed_split(n)
    seen = {}
    for rank in range(world_size):
        loaders = cpu_loaders(split, global_batch, kind, rank, world_size, seed=9)
        reference = DistributedSampler(range(n), world_size, rank, shuffle=True, seed=9)
        for epoch in (0, 1):
            loaders.set_position(epoch)
            reference.set_epoch(epoch)
            seen[rank, epoch] = seen_indices(loaders.train, split)
            assert seen[rank, epoch] == list(reference), (rank, epoch)
    for epoch in (0, 1):
        everything = sorted(i for rank in range(world_size) for i in seen[rank, epoch])
        assert everything == list(range(n)), "each sample exactly once across ranks"
    assert seen[0, 0] != seen[0, 1], "a new order every epoch"


@pytest.mark.parametrize("kind", ["tensor", "classic"])
def test_training_keeps_full_global_batches_only(kind):
    """Also in an epoch resumed after 4 steps: the rest of its batches, not the leftover."""
    split = indexed_split(250)  # 10 full batches of 24, 10 images left over
    loaders = cpu_loaders(split, world_size=2, global_batch=24, kind=kind)
    assert len(loaders.train) == 10
    whole = seen_indices(loaders.train, split)
    assert len(whole) == 10 * 12
    loaders.set_position(0, 4)
    assert seen_indices(loaders.train, split) == whole[4 * 12 :]


def test_a_short_last_validation_batch_is_gathered_without_a_resize():
    """The epoch's buffer holds exactly the rank's shard: a buffer of whole batches would be
    resized by index_select(out=), which torch warns of and means to refuse."""
    split = indexed_split(64)
    # One full training batch of 48; validation: 48, then 16.
    loaders = cpu_loaders(split, global_batch=48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert seen_indices(loaders.val, split) == list(range(64))
    assert loaders.val.epoch_buffer.shape[0] == 64


@pytest.mark.parametrize("dataset", ["synthetic", "tinyimagenet"])  # 32x32 and 64x64 images
def test_random_crop_flip_takes_a_window_of_the_padded_image(dataset):
    """Of the padded image (4 pixels a side): every window, flipped or not, drawn per image; the
    classic loader's transform keeps the size too."""
    spec = data.DATASETS[dataset]
    size = spec.image_shape[1]
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, *spec.image_shape), dtype=torch.uint8)
    out = data.RandomCropFlip(images.shape[1:], images.device)(images, gen)
    assert out.shape == images.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    flips, shifts = 0, set()
    for i in range(len(images)):
        windows = [
            ((dy, dx), padded[i, :, dy : dy + size, dx : dx + size])
            for dy in range(9)
            for dx in range(9)
        ]
        matches = [
            (*shift, flip)
            for shift, w in windows
            for flip in (False, True)
            if torch.equal(out[i], w.flip(2) if flip else w)
        ]
        assert matches, f"image {i} is not a crop of its padded original"
        flips += matches[0][2]
        shifts.add(matches[0][:2])
    assert 10 < flips < 54, "about half the images flipped"
    assert len(shifts) > 20, "offsets vary over the 9x9 window"
    picture = Image.fromarray(images[0].permute(1, 2, 0).numpy())
    assert data.classic_transform(spec, augment=True)(picture).shape == images.shape[1:]


def test_tensor_path_normalizes_like_torchvision():
    split = data.make_synthetic(8, 8, seed=1)[0]
    norm = data.Normalize(SPEC, torch.device("cpu"))(split.images)
    transform = data.classic_transform(SPEC, augment=False)
    tv = torch.stack(
        [transform(Image.fromarray(img.permute(1, 2, 0).numpy())) for img in split.images]
    )
    assert torch.allclose(norm, tv, atol=1e-5)


# ----------------------------------------------------------------------------- exact validation

VAL_CFG = dict(
    dataset="synthetic",
    train_samples=4096,
    val_samples=1001,
    batch_size=48,
    epochs=2,
    seed=11,
    checkpoint=False,
    print_every=10**6,
)


def validate_weights(env, cfg, weights):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    trainer, _ = build_trainer(cfg, env)
    set_model_state_dict(trainer.model, weights, options=StateDictOptions(full_state_dict=True))
    return trainer.evaluate()


@pytest.fixture(scope="module")
def weights():
    """Weights worth validating: after training, accuracy and correct counts are far from
    chance, so an image counted twice or missed changes them."""
    return spawn(train_and_gather, 1, Config(**VAL_CFG))[0][0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_validation_is_exact_at_any_world_size(weights, strategy):
    cfg = Config(**VAL_CFG, strategy=strategy)
    results = {ws: spawn(validate_weights, ws, cfg, weights)[0] for ws in (1, 2, 3)}
    ref = results[1]
    assert 30 < ref["acc"] < 100, "trained weights: a duplicated or missed image shows"
    for ws, res in results.items():
        assert res["val_correct"] == ref["val_correct"], ws
        assert res["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6), ws
        assert res["acc"] == pytest.approx(ref["acc"], abs=1e-9), ws


def test_validation_weights_mask_only_the_padding():
    # 1,001 images on 3 ranks: the sampler pads to 1,002; rank 2's last position repeats.
    w = [data.validation_weights(0, 334, r, 3, 1001, torch.device("cpu")) for r in range(3)]
    assert [int(x.sum()) for x in w] == [334, 334, 333]
    assert w[2][-1] == 0


# ----------------------------------------------------------------------------- CIFAR-10 files


def test_loads_any_directory_in_the_cifar10_python_format(tmp_path):
    folder = write_cifar_dir(tmp_path)
    train, val = data.load_files("cifar10", tmp_path, download=False)
    assert train.images.shape == (100, 3, 32, 32) and val.images.shape == (30, 3, 32, 32)
    for i in (0, 1):  # pickled as the real files are (python 2), then by this python
        with open(folder / dataset_files.CIFAR10_TRAIN_FILES[i], "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        part = slice(20 * i, 20 * (i + 1))
        assert torch.equal(train.images[part].reshape(20, -1), torch.from_numpy(batch[b"data"]))
        assert train.labels[part].tolist() == batch[b"labels"]
    assert dataset_files.cache_path("cifar10", tmp_path).is_file()


def test_cache_is_decoded_once_and_again_when_a_source_file_changes(tmp_path, monkeypatch):
    folder = write_cifar_dir(tmp_path)
    decodes = []
    decode = dataset_files.decode_cifar10
    monkeypatch.setattr(dataset_files, "decode_cifar10", lambda f: decodes.append(f) or decode(f))
    for _ in range(3):
        assert len(data.load_files("cifar10", tmp_path, download=False)[1]) == 30
    assert len(decodes) == 1, "the second and third loads read the cache"
    write_cifar_dir(tmp_path / "other", n_test=5)
    (folder / "test_batch").write_bytes(
        (tmp_path / "other" / dataset_files.CIFAR10_FOLDER / "test_batch").read_bytes()
    )
    assert len(data.load_files("cifar10", tmp_path, download=False)[1]) == 5
    assert len(decodes) == 2, "a changed source file rebuilds the cache"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_corrupt_cifar_file_is_a_clear_error(tmp_path, damage):
    folder = write_cifar_dir(tmp_path)
    path = folder / "data_batch_3"
    blob = path.read_bytes()
    foreign = pickle.dumps({b"data": [[0] * 3072], b"labels": 7})  # a label, not a list of them
    damaged = {"truncate": blob[: len(blob) // 2], "garbage": b"not a pickle", "foreign": foreign}
    path.write_bytes(damaged[damage])
    with pytest.raises(UsageError, match="data_batch_3"):
        data.load_files("cifar10", tmp_path, download=False)


def test_samples_take_at_most_the_whole_set_synthetic_too():
    """--train-samples beyond a set's size takes the whole set; a synthetic set is as large as
    CIFAR-10 (10^8 images once meant a 307 GB allocation, and a traceback)."""
    train, val = data.load_splits("synthetic", Path("."), 0, 10**8, 10**8)
    assert (len(train), len(val)) == (50_000, 10_000)
    assert data.find_data("synthetic", Path("."), 10**8)[0] == 50_000


def test_missing_data_without_download_says_how_to_fetch(tmp_path):
    with pytest.raises(UsageError, match="python data.py --download"):
        data.load_files("cifar10", tmp_path / "nothing", download=False)


def fake_download_then_load(env, root, fail):
    def fake_download(data_dir):
        (data_dir / f"downloaded_by_rank_{env.rank}").touch()
        if fail:
            raise ConnectionError("no route to host")
        write_cifar_dir(data_dir)

    dataset_files.download_cifar10 = fake_download  # the real one needs internet
    train, val = data.load_files("cifar10", root, download=True)
    return len(train), len(val)


def test_rank0_alone_downloads_and_all_ranks_load(tmp_path):
    results = spawn(fake_download_then_load, 3, tmp_path, False)
    assert results == [(100, 30)] * 3
    assert sorted(p.name for p in tmp_path.glob("downloaded_by_rank_*")) == ["downloaded_by_rank_0"]


def test_failed_download_ends_every_rank_with_the_same_message(tmp_path):
    outcomes = spawn_outcomes(fake_download_then_load, 2, tmp_path, True, timeout=60)
    assert [status for status, _ in outcomes] == ["error", "error"]
    first_lines = {msg.splitlines()[0] for _, msg in outcomes}
    assert len(first_lines) == 1, first_lines
    (line,) = first_lines
    assert line.startswith("UsageError: downloading CIFAR-10") and "no route to host" in line
    assert "python data.py --download --data-dir" in line


def position_coded_split(n: int) -> data.Split:
    """n copies of one image whose pixels name their own row and column: the images of an
    epoch then differ only by the crop and flip each was drawn, whatever the sampler's order."""
    rows, cols = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    image = torch.stack([rows + 1, cols + 1, torch.full_like(rows, 255)]).to(torch.uint8)
    return data.Split(image.repeat(n, 1, 1, 1), torch.zeros(n, dtype=torch.long))


def test_each_epoch_draws_new_crops_and_a_resumed_one_those_it_drew():
    """The crops and flips of a rank's epoch come from (seed, rank, epoch) alone, drawn for
    the whole epoch when it starts. One loader through epochs 1 and 2: the second epoch's
    images are cropped and flipped otherwise than the first's (alike at a position by chance
    once in 81 x 2 draws, 0.3 of 48 expected: at most 6 allowed). A loader built anew and
    started at epoch 2 step 3 (a resumed run) gives the batches the uninterrupted one gave
    from step 3."""
    split = position_coded_split(96)

    def loaders():
        return cpu_loaders(split, rank=1, world_size=2, global_batch=16, seed=5, augment=True)

    def epoch(loader, number: int, step: int = 0) -> list[torch.Tensor]:
        loader.set_position(number, step)
        return [images for images, _ in loader.train]

    uninterrupted = loaders()
    first, second = epoch(uninterrupted, 1), epoch(uninterrupted, 2)
    alike = sum(torch.equal(a, b) for a, b in zip(torch.cat(first), torch.cat(second)))
    print(f"{alike} of 48 images cropped and flipped alike in epochs 1 and 2")
    assert len(first) == len(second) == 6 and alike <= 6
    resumed = epoch(loaders(), 2, step=3)
    assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(second[3:], resumed))
    plain = cpu_loaders(split, rank=1, world_size=2, global_batch=16, seed=5)
    assert not any(torch.equal(a, b) for a, b in zip(second, epoch(plain, 2)))
