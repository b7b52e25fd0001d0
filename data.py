"""CIFAR-10 (or a synthetic stand-in) for data-parallel training: each rank a disjoint shard.

The distributed ideas, in order:
1. Rank 0 alone downloads and decodes; the other ranks wait for its verdict (a broadcast, which
   doubles as the barrier), so a failed download ends every rank with the same message.
2. `DistributedSampler` gives each rank every world_size-th index of one shared permutation
   (seeded, reshuffled by `set_epoch`). A rank's step-s batch is thus its slice of the same
   global batch at any world size: global batch = world_size x local batch.
3. Validation is exact: the sampler pads the last round with repeated images so that every rank
   runs the same number of batches (FSDP needs that); the repeats get weight 0, and loss and
   accuracy are summed over ranks, so each test image counts exactly once.

Two input paths give the same batches. `tensor` (the default) keeps the whole data set as one
uint8 tensor on the training device and crops, flips and normalizes whole batches there: no
worker processes, no per-image Python. `classic` is the course's torchvision transforms and
`DataLoader`, kept for the exercise and for comparison.

Run `python data.py --download --data-dir DIR` on a machine with internet (e.g. a login node)
to fetch CIFAR-10 before a job.
"""

import argparse
import itertools
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from distributed_utils import on_rank0
from model import IMAGE_SHAPE
from utils import UsageError, fail

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CACHE_FILE = "cifar10_uint8.pt"  # decoded tensors, beside the python batches
CROP_PADDING = 4
# Pixel amplitudes of the synthetic set's class pattern and noise: weak enough that the CNN
# needs a few epochs (about 40% after one, 85% after four on 4,096 images), so a broken
# training step shows.
SYNTHETIC_SIGNAL, SYNTHETIC_NOISE = 4, 48


@dataclass(frozen=True)
class DatasetSpec:
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: bool  # default; `--augment/--no-augment` overrides
    train_size: int
    val_size: int


DATASETS = {
    # CIFAR-10's training-set channel statistics.
    "cifar10": DatasetSpec((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), True, 50_000, 10_000),
    # No augmentation by default: runs at any world size then see identical global batches.
    "synthetic": DatasetSpec((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), False, 50_000, 10_000),
}


@dataclass
class Split:
    images: torch.Tensor  # uint8, (N, 3, 32, 32)
    labels: torch.Tensor  # int64, (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, n: int | None) -> "Split":
        return self if n is None else Split(self.images[:n], self.labels[:n])


# ----------------------------------------------------------------------------- CIFAR-10 files

def download_cifar10(data_dir: Path) -> None:
    """Fetch and unpack the official archive; torchvision verifies its md5 after download."""
    from torchvision.datasets.utils import download_and_extract_archive
    download_and_extract_archive(CIFAR10_URL, str(data_dir), filename=CIFAR10_ARCHIVE,
                                 md5=CIFAR10_MD5, remove_finished=True)


def cifar10_present(data_dir: Path) -> bool:
    folder = data_dir / CIFAR10_FOLDER
    return all((folder / f).is_file() for f in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE))


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One file of CIFAR-10's python format: images (n, 3, 32, 32) uint8 and labels (n,).

    Unlike torchvision's CIFAR10, no md5 of the files is required, so directories of any size
    in the same format load too. The format is a pickle: load only files you trust.
    """
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except FileNotFoundError:
        raise UsageError(f"{path} is missing") from None
    except Exception as e:  # truncated or foreign files fail in many ways inside pickle
        raise UsageError(f"{path} is not a CIFAR-10 python batch ({type(e).__name__}: {e}); "
                         "delete it and download again") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise UsageError(f"{path}: expected n x 3072 pixels and n labels, "
                         f"got {data.shape} and {labels.shape}")
    if len(labels) and not (0 <= labels.min() and labels.max() < 10):
        raise UsageError(f"{path}: labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def decode_cifar10(folder: Path) -> dict[str, torch.Tensor]:
    parts = [read_cifar_batch(folder / f) for f in CIFAR10_TRAIN_FILES]
    test_x, test_y = read_cifar_batch(folder / CIFAR10_TEST_FILE)
    return {
        "train_images": torch.from_numpy(np.concatenate([p[0] for p in parts])),
        "train_labels": torch.from_numpy(np.concatenate([p[1] for p in parts])),
        "val_images": torch.from_numpy(test_x),
        "val_labels": torch.from_numpy(test_y),
    }


def _source_signature(folder: Path) -> list:
    return [(f, (folder / f).stat().st_size, (folder / f).stat().st_mtime_ns)
            for f in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)]


def _read_cache(data_dir: Path) -> dict | None:
    """The cached tensors (memory-mapped), if the cache matches the source files."""
    try:
        cached = torch.load(data_dir / CACHE_FILE, mmap=True)
        if cached["signature"] == _source_signature(data_dir / CIFAR10_FOLDER):
            return cached
    except Exception:
        pass  # absent or unreadable cache: (re)build it
    return None


def build_cache(data_dir: Path) -> Path:
    """Decode once into one tensor file; rebuilt whenever the source files change."""
    folder, cache = data_dir / CIFAR10_FOLDER, data_dir / CACHE_FILE
    signature = _source_signature(folder)
    if _read_cache(data_dir) is not None:
        return cache
    tensors = decode_cifar10(folder)
    # Write to a temporary name, then rename: a crash never leaves a half-written cache.
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=CACHE_FILE, suffix=".tmp")
    os.close(fd)
    try:
        torch.save({**tensors, "signature": signature}, tmp)
        os.replace(tmp, cache)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return cache


def _not_found(data_dir: Path) -> str:
    return (f"CIFAR-10 not found in {data_dir / CIFAR10_FOLDER} and downloading is off; fetch "
            f"it with: python data.py --download --data-dir {data_dir} (or train without it: "
            "--dataset synthetic)")


def _download_failed(data_dir: Path, error: Exception, fetch_hint: bool) -> str:
    where = ("fetch it on a machine with internet (e.g. a login node) with: python data.py "
             f"--download --data-dir {data_dir}, or " if fetch_hint else "")
    return (f"downloading CIFAR-10 into {data_dir} failed ({error}); this machine may have no "
            f"internet: {where}train without it: --dataset synthetic")


def _prepare_on_rank0(data_dir: Path, download: bool, fetch_hint: bool = True) -> str | None:
    """Download if needed and build the cache; returns the cache's path (None: no cache)."""
    if not cifar10_present(data_dir):
        if not download:
            raise UsageError(_not_found(data_dir))
        print(f"[rank 0] CIFAR-10 not found in {data_dir}, downloading ...", flush=True)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            download_cifar10(data_dir)
        except Exception as e:
            raise UsageError(_download_failed(data_dir, e, fetch_hint)) from None
        if not cifar10_present(data_dir):
            raise UsageError(f"the download did not produce {data_dir / CIFAR10_FOLDER}")
    try:
        return str(build_cache(data_dir))
    except OSError as e:  # read-only data folder: every rank decodes the files itself
        print(f"[rank 0] warning: cannot write {data_dir / CACHE_FILE} ({e}); "
              "decoding without a cache", flush=True)
        decode_cifar10(data_dir / CIFAR10_FOLDER)  # validate once, here, with a clear error
        return None


def load_cifar10(data_dir: Path, download: bool = True,
                 fetch_hint: bool = True) -> tuple[Split, Split]:
    """Every rank calls this; rank 0 alone touches the network and writes files."""
    data_dir = Path(data_dir)
    cache = on_rank0(_prepare_on_rank0, data_dir, download, fetch_hint)
    t = torch.load(cache, mmap=True) if cache else decode_cifar10(data_dir / CIFAR10_FOLDER)
    return Split(t["train_images"], t["train_labels"]), Split(t["val_images"], t["val_labels"])


# ----------------------------------------------------------------------------- synthetic data

def make_synthetic(n_train: int, n_val: int, seed: int) -> tuple[Split, Split]:
    """A learnable stand-in for CIFAR-10: a smooth per-class pattern plus pixel noise.

    Generated on the CPU from `seed` alone, so every rank builds the identical data set.
    """
    g = torch.Generator().manual_seed(seed)
    prototypes = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=(32, 32),
                               mode="bilinear", align_corners=False)

    def split(n: int) -> Split:
        labels = torch.randint(0, 10, (n,), generator=g)
        images = torch.empty(n, 3, 32, 32, dtype=torch.uint8)
        for start in range(0, n, 8192):  # chunks bound the float temporaries
            y = labels[start:start + 8192]
            noise = torch.randn(len(y), 3, 32, 32, generator=g)
            pixels = 128 + SYNTHETIC_SIGNAL * prototypes[y] + SYNTHETIC_NOISE * noise
            images[start:start + 8192] = pixels.round().clamp(0, 255).to(torch.uint8)
        return Split(images, labels)

    return split(n_train), split(n_val)


def load_splits(dataset: str, data_dir: Path, seed: int, train_samples: int | None,
                val_samples: int | None, download: bool = True) -> tuple[Split, Split]:
    if dataset == "cifar10":
        train, val = load_cifar10(data_dir, download)
    else:
        spec = DATASETS[dataset]
        train, val = make_synthetic(train_samples or spec.train_size, val_samples or spec.val_size,
                                    seed)
    train, val = train.head(train_samples), val.head(val_samples)
    if len(train) == 0 or len(val) == 0:
        raise UsageError(f"{dataset}: empty training or validation set")
    return train, val


def find_data(dataset: str, data_dir: Path, train_samples: int | None,
              download: bool = True) -> tuple[int, str]:
    """What a run would train on, without downloading, writing or synchronizing anything (for
    `main.py --check`): the number of training images, and where they come from. Raises the
    run's own error when it would fail for want of data."""
    spec, data_dir = DATASETS[dataset], Path(data_dir)
    if dataset == "synthetic":
        return train_samples or spec.train_size, "synthetic data, generated from the seed"
    if not cifar10_present(data_dir):
        if not download:
            raise UsageError(_not_found(data_dir))
        return (min(train_samples or spec.train_size, spec.train_size),
                f"CIFAR-10 not in {data_dir}: rank 0 will download it (170 MB)")
    cached = _read_cache(data_dir)
    labels = (cached or decode_cifar10(data_dir / CIFAR10_FOLDER))["train_labels"]
    size = len(labels) if train_samples is None else min(train_samples, len(labels))
    return size, f"CIFAR-10 in {data_dir}"


# ----------------------------------------------------------------------------- augmentation

def random_crop_flip(images: torch.Tensor, generator: torch.Generator,
                     padding: int = CROP_PADDING) -> torch.Tensor:
    """Per-image random crop from a zero-padded copy and random horizontal flip, batched.

    Same distribution as torchvision's RandomCrop(32, padding=4) + RandomHorizontalFlip, done
    as one gather on the images' own device: a crop at (dy, dx) reads the padded image at a fixed
    pattern of flat offsets shifted by dy * padded_width + dx, and a flip mirrors the columns.
    """
    n, c, h, w = images.shape
    dev = images.device
    pw = w + 2 * padding
    channel = torch.arange(c, device=dev).view(c, 1, 1) * (h + 2 * padding) * pw
    row = torch.arange(h, device=dev).view(1, h, 1) * pw
    col = torch.arange(w, device=dev).view(1, 1, w)
    pattern = (channel + row + col).view(1, -1)
    mirrored = (channel + row + (w - 1 - col)).view(1, -1)

    dy = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator, device=dev)
    dx = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator, device=dev)
    flip = torch.randint(0, 2, (n, 1), generator=generator, device=dev).bool()
    offsets = torch.where(flip, mirrored, pattern) + dy * pw + dx
    padded = F.pad(images, (padding,) * 4).view(n, -1)
    return padded.gather(1, offsets).view(n, c, h, w)


class Normalize:
    """uint8 images -> float, scaled to [0, 1] and standardized per channel, on the device."""

    def __init__(self, spec: DatasetSpec, device: torch.device,
                 memory_format=torch.contiguous_format):
        self.mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1) * 255
        self.memory_format = memory_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.mean.device, non_blocking=True).float()
        return ((x - self.mean) / self.std).contiguous(memory_format=self.memory_format)


# ----------------------------------------------------------------------------- loaders

class ShardSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, for a run resumed mid-epoch."""

    def __init__(self, size: int, world_size: int, rank: int, shuffle: bool, seed: int = 0):
        super().__init__(range(size), world_size, rank, shuffle=shuffle, seed=seed)
        self.skip = 0  # samples of this rank's shard already trained on this epoch

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip

    def steps_left(self, steps: int, batch_size: int) -> int:
        """Of an epoch's `steps` batches, those not yet trained on."""
        return steps - self.skip // batch_size


class TensorLoader:
    """A rank's batches, sliced from the whole data set held as one tensor on the device.

    The epoch's indices come from `sampler` (a DistributedSampler) in one host-to-device copy;
    every batch is then an index, an optional crop/flip and a normalize, all on the device.
    """

    def __init__(self, split: Split, sampler: ShardSampler, batch_size: int, steps: int,
                 normalize: Normalize, augment: bool, generator: torch.Generator):
        device = normalize.mean.device
        # Rows of one flat image each: index_select on them is a plain row copy, many times
        # faster than advanced indexing of the 4-d tensor on the CPU. A copy on the CPU too:
        # the rank then holds its data set as it does on a GPU, not as pages of a mapped file.
        self.images = split.images.to(device, copy=True).view(len(split), -1)
        self.labels = split.labels.to(device, copy=True)
        self.sampler, self.batch_size, self.steps = sampler, batch_size, steps
        self.normalize, self.augment, self.generator = normalize, augment, generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        """This epoch's batches from the sampler's position on (see Loaders.set_position)."""
        indices = torch.tensor(list(self.sampler), device=self.images.device)
        for step in range(self.sampler.steps_left(self.steps, self.batch_size)):
            batch = indices[step * self.batch_size:(step + 1) * self.batch_size]
            images = self.images.index_select(0, batch).view(-1, *IMAGE_SHAPE)
            if self.augment:
                images = random_crop_flip(images, self.generator)
            yield self.normalize(images), self.labels[batch]


class ImageDataset(Dataset):
    """Per-image access for the classic path: PIL image through torchvision transforms."""

    def __init__(self, split: Split, transform):
        self.hwc = split.images.permute(0, 2, 3, 1).numpy()
        self.labels = split.labels.numpy()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image
        return self.transform(Image.fromarray(self.hwc[i])), int(self.labels[i])


def classic_transform(spec: DatasetSpec, augment: bool):
    from torchvision import transforms as T
    steps = [T.RandomCrop(32, padding=CROP_PADDING), T.RandomHorizontalFlip()] if augment else []
    return T.Compose([*steps, T.ToTensor(), T.Normalize(spec.mean, spec.std)])


class ClassicLoader:
    """The course's pipeline: DataLoader workers transform images one by one on the CPU."""

    def __init__(self, split: Split, sampler: ShardSampler, batch_size: int, steps: int,
                 spec: DatasetSpec, augment: bool, device: torch.device, num_workers: int,
                 memory_format=torch.contiguous_format):
        self.loader = DataLoader(ImageDataset(split, classic_transform(spec, augment)),
                                 batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                                 pin_memory=device.type == "cuda", drop_last=False,
                                 persistent_workers=num_workers > 0)
        self.sampler, self.steps, self.device = sampler, steps, device
        self.batch_size, self.memory_format = batch_size, memory_format

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        remaining = self.sampler.steps_left(self.steps, self.batch_size)
        for _, (images, labels) in zip(range(remaining), self.loader):
            images = images.to(self.device, non_blocking=True)
            yield (images.contiguous(memory_format=self.memory_format),
                   labels.to(self.device, non_blocking=True))


def validation_weights(offset: int, batch_len: int, rank: int, world_size: int, total: int,
                       device: torch.device) -> torch.Tensor:
    """1 for real images, 0 for the sampler's padding (repeats beyond the data set's end).

    DistributedSampler (no shuffle) gives rank r the padded positions r, r + W, r + 2W, ...;
    positions >= total are the repeats.
    """
    positions = rank + world_size * torch.arange(offset, offset + batch_len, device=device)
    return (positions < total).float()


@dataclass
class Loaders:
    train: "TensorLoader | ClassicLoader"
    val: "TensorLoader | ClassicLoader"
    train_sampler: ShardSampler
    val_size: int
    generator: torch.Generator | None  # the tensor path's augmentation stream

    def device_bytes(self) -> int:
        """Bytes of data set this rank keeps on its training device (the tensor path's)."""
        return sum(t.numel() * t.element_size() for loader in (self.train, self.val)
                   if isinstance(loader, TensorLoader) for t in (loader.images, loader.labels))

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Shuffle for `epoch` (the same order on every rank) and start after `step` batches."""
        self.train_sampler.set_epoch(epoch)
        self.train_sampler.skip = step * self.train.batch_size


def build_loaders(train: Split, val: Split, spec: DatasetSpec, *, kind: str, rank: int,
                  world_size: int, global_batch: int, seed: int, augment: bool,
                  device: torch.device, num_workers: int = 0,
                  memory_format=torch.contiguous_format) -> Loaders:
    """Shard both splits over the ranks; training uses only full global batches."""
    local_batch = global_batch // world_size
    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed)
    val_sampler = ShardSampler(len(val), world_size, rank, shuffle=False)
    train_steps = len(train) // global_batch
    val_steps = -(-len(val_sampler) // local_batch)
    gen = None
    if kind == "tensor":
        norm = Normalize(spec, device, memory_format)
        # Per-rank augmentation stream, independent of the sampler's shared permutation.
        gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)

        def make(split, sampler, steps, aug):
            return TensorLoader(split, sampler, local_batch, steps, norm, aug, gen)
    else:
        def make(split, sampler, steps, aug):
            return ClassicLoader(split, sampler, local_batch, steps, spec, aug, device,
                                 num_workers, memory_format)
    return Loaders(make(train, train_sampler, train_steps, augment),
                   make(val, val_sampler, val_steps, False), train_sampler, len(val), gen)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Fetch CIFAR-10 ahead of a job (e.g. on a login "
                                "node with internet), then decode it into the tensor cache.")
    p.add_argument("--download", action="store_true", help="download if absent")
    p.add_argument("--data-dir", default="./data", help="target folder (default ./data)")
    args = p.parse_args(argv)
    try:
        train, val = load_cifar10(Path(args.data_dir), download=args.download,
                                  fetch_hint=False)  # this command is the fetch
    except UsageError as e:
        fail(str(e))
    print(f"CIFAR-10 ready in {args.data_dir}: {len(train)} training and {len(val)} "
          "validation images")


if __name__ == "__main__":
    main(sys.argv[1:])
