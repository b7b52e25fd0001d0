"""Data sets for data-parallel training, each rank a disjoint shard: CIFAR-10, Fashion-MNIST,
Tiny ImageNet (their files: dataset_files.py) or a synthetic stand-in.

The distributed ideas, in order:
1. Rank 0 alone downloads and decodes, once, into a tensor cache beside the files; the other
   ranks wait for its verdict (a broadcast, which doubles as the barrier), so a failed download
   ends every rank with the same message.
2. `DistributedSampler` gives each rank every world_size-th index of one shared permutation
   (seeded, reshuffled by `set_epoch`). A rank's step-s batch is thus its slice of the same
   global batch at any world size: global batch = world_size x local batch.
3. Validation is exact: the sampler pads the last round with repeated images so that every rank
   runs the same number of batches (FSDP needs that); the repeats get weight 0, and loss and
   accuracy are summed over ranks, so each test image counts exactly once.

Two input paths give the same batches. `tensor` (the default) keeps the whole data set as one
uint8 tensor on the training device; at the start of an epoch it gathers the rank's shard in
the epoch's order and crops and flips all of it there, in a few whole-tensor operations, so that
a step only takes its batch and normalizes it: no worker processes, no per-image Python, and
one operation per step (airbench's design). `classic` is the course's torchvision transforms
and `DataLoader`, kept for the exercise and for comparison.

Run `python data.py --download --data-dir DIR [--dataset fashionmnist]` on a machine with
internet (e.g. a login node) to fetch a data set before a job.
"""

import argparse
import itertools
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dataset_files import (
    FILE_SETS,
    TINY_CLASSES,
    TINY_SHAPE,
    must_download,
    open_cache,
    prepare,
    read_cache,
)
from distributed_utils import on_rank0
from model import IMAGE_SHAPE, NUM_CLASSES
from utils import UsageError, fail, require_torchvision

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
    train_size: int  # of the full set: --check's estimate before a download
    val_size: int
    num_classes: int = NUM_CLASSES  # the models' outputs
    image_shape: tuple[int, int, int] = IMAGE_SHAPE  # (C, H, W) of the decoded images


DATASETS = {
    # CIFAR-10's training-set channel statistics.
    "cifar10": DatasetSpec(
        (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), True, 50_000, 10_000
    ),
    # No augmentation by default: runs at any world size then see identical global batches.
    "synthetic": DatasetSpec((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), False, 50_000, 10_000),
    # Fashion-MNIST's training-set statistics (0.2860, 0.3530) over its 28x28 pixels, taken
    # over the 32x32 padded image (784 of 1,024 pixels, the rest 0): mean 0.2860 x 784/1024,
    # mean square (0.3530^2 + 0.2860^2) x 784/1024.
    "fashionmnist": DatasetSpec((0.2190,) * 3, (0.3318,) * 3, True, 60_000, 10_000),
    # Tiny ImageNet's training-set channel statistics.
    "tinyimagenet": DatasetSpec(
        (0.4802, 0.4481, 0.3975),
        (0.2770, 0.2691, 0.2821),
        True,
        100_000,
        10_000,
        TINY_CLASSES,
        TINY_SHAPE,
    ),
}


@dataclass
class Split:
    images: torch.Tensor  # uint8, (N, C, H, W): the data set's image_shape
    labels: torch.Tensor  # int64, (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, n: int | None) -> "Split":
        return self if n is None else Split(self.images[:n], self.labels[:n])


# ----------------------------------------------------------------------------- data sets in files


def load_files(
    dataset: str, data_dir: Path, download: bool = True, fetch_hint: bool = True
) -> tuple[Split, Split]:
    """Every rank calls this; rank 0 alone touches the network and writes files."""
    data_dir = Path(data_dir)
    # exercise 3.1 begin
    cache = on_rank0(prepare, dataset, data_dir, download, fetch_hint)
    # exercise 3.1 end
    t = (
        open_cache(cache)
        if cache
        else FILE_SETS[dataset].decode(data_dir / FILE_SETS[dataset].folder)
    )
    return Split(t["train_images"], t["train_labels"]), Split(t["val_images"], t["val_labels"])


# ----------------------------------------------------------------------------- synthetic data


def make_synthetic(n_train: int, n_val: int, seed: int) -> tuple[Split, Split]:
    """A learnable stand-in for CIFAR-10: a smooth per-class pattern plus pixel noise.

    Generated on the CPU from `seed` alone, so every rank builds the identical data set.
    """
    g = torch.Generator().manual_seed(seed)
    prototypes = F.interpolate(
        torch.randn(10, 3, 4, 4, generator=g), size=(32, 32), mode="bilinear", align_corners=False
    )

    def split(n: int) -> Split:
        labels = torch.randint(0, 10, (n,), generator=g)
        images = torch.empty(n, 3, 32, 32, dtype=torch.uint8)
        for start in range(0, n, 8192):  # chunks bound the float temporaries
            y = labels[start : start + 8192]
            noise = torch.randn(len(y), 3, 32, 32, generator=g)
            pixels = 128 + SYNTHETIC_SIGNAL * prototypes[y] + SYNTHETIC_NOISE * noise
            images[start : start + 8192] = pixels.round().clamp(0, 255).to(torch.uint8)
        return Split(images, labels)

    return split(n_train), split(n_val)


def at_most(samples: int | None, size: int) -> int:
    """How many of a set's `size` images `--train-samples`/`--val-samples` take: the first N, as
    many as there are (a synthetic set is as large as the set it stands in for)."""
    return min(samples or size, size)


def load_splits(
    dataset: str,
    data_dir: Path,
    seed: int,
    train_samples: int | None,
    val_samples: int | None,
    download: bool = True,
) -> tuple[Split, Split]:
    if dataset in FILE_SETS:
        train, val = load_files(dataset, data_dir, download)
    else:
        spec = DATASETS[dataset]
        train, val = make_synthetic(
            at_most(train_samples, spec.train_size), at_most(val_samples, spec.val_size), seed
        )
    train, val = train.head(train_samples), val.head(val_samples)
    if len(train) == 0 or len(val) == 0:
        raise UsageError(f"{dataset}: empty training or validation set")
    return train, val


def find_data(
    dataset: str, data_dir: Path, train_samples: int | None, download: bool = True
) -> tuple[int, str]:
    """What a run would train on, without downloading, writing or synchronizing anything (for
    `main.py --check`): the number of training images, and where they come from. Raises the
    run's own error when it would fail for want of data."""
    spec, data_dir = DATASETS[dataset], Path(data_dir)
    if dataset == "synthetic":
        return at_most(train_samples, spec.train_size), "synthetic data, generated from the seed"
    files = FILE_SETS[dataset]
    if must_download(dataset, data_dir, download):
        return (
            at_most(train_samples, spec.train_size),
            f"{files.title} not in {data_dir}: rank 0 will download it ({files.size})",
        )
    # Without a cache yet, the files are decoded here as the run would (Tiny ImageNet: its
    # 110,000 JPEGs, some 15 s), so that a damaged file fails the check.
    cached = read_cache(dataset, data_dir) or files.decode(data_dir / files.folder)
    return at_most(train_samples, len(cached["train_labels"])), f"{files.title} in {data_dir}"


# ----------------------------------------------------------------------------- augmentation


class RandomCropFlip:
    """Per-image random crop from a zero-padded copy and random horizontal flip, batched.

    Same distribution as torchvision's RandomCrop(size, padding=4) + RandomHorizontalFlip, done
    as one gather on the images' own device: a crop at (dy, dx) reads the padded image at a fixed
    pattern of flat offsets shifted by dy * padded_width + dx, and a flip mirrors the columns.
    The two patterns are built once: on a GPU every batch's small kernels are paid in launches.
    """

    # Pixels per gather: its int64 offsets take 8 bytes a pixel (16 MiB at this many), its
    # padded copy and output about 2.6 more; allocated while the epoch is measured, so small
    # beside training's memory (a CIFAR-10 epoch: about 75 gathers, each a few kernels).
    PIXELS_PER_GATHER = 2**21

    def __init__(self, image_shape: tuple, device: torch.device, padding: int = CROP_PADDING):
        c, h, w = image_shape
        pw = w + 2 * padding
        self.padding, self.padded_width = padding, pw
        channel = torch.arange(c, device=device).view(c, 1, 1) * (h + 2 * padding) * pw
        row = torch.arange(h, device=device).view(1, h, 1) * pw
        col = torch.arange(w, device=device).view(1, 1, w)
        self.pattern = (channel + row + col).view(1, -1)
        self.mirrored = (channel + row + (w - 1 - col)).view(1, -1)

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        n, dev, p = len(images), images.device, self.padding
        dy = torch.randint(0, 2 * p + 1, (n, 1), generator=generator, device=dev)
        dx = torch.randint(0, 2 * p + 1, (n, 1), generator=generator, device=dev)
        flip = torch.randint(0, 2, (n, 1), generator=generator, device=dev).bool()
        offsets = torch.where(flip, self.mirrored, self.pattern) + (dy * self.padded_width + dx)
        padded = F.pad(images, (p,) * 4).view(n, -1)
        return padded.gather(1, offsets).view(images.shape)

    def in_place(self, images: torch.Tensor, generator: torch.Generator) -> None:
        """Crops and flips every image, a bounded number of images at a time."""
        per_gather = max(1, self.PIXELS_PER_GATHER // images[0].numel())
        for chunk in images.split(per_gather):
            chunk.copy_(self(chunk, generator))  # self() read the chunk into a padded copy


def augmentation_seed(seed: int, rank: int, epoch: int) -> int:
    """The crop-and-flip stream of one rank's epoch, drawn anew from (seed, rank, epoch): a run
    resumed mid-epoch augments the rest of the epoch as the uninterrupted run did, on any
    device, with no generator state to carry in the checkpoint."""
    return int(np.random.SeedSequence([seed, rank, epoch]).generate_state(1, np.uint64)[0])


class Normalize:
    """uint8 images -> float, scaled to [0, 1] and standardized per channel, on the device."""

    def __init__(
        self, spec: DatasetSpec, device: torch.device, memory_format=torch.contiguous_format
    ):
        # (x / 255 - mean) / std as one multiply-add of the uint8 pixels: x * scale + shift.
        mean = torch.tensor(spec.mean, dtype=torch.float64).view(1, 3, 1, 1)
        std = torch.tensor(spec.std, dtype=torch.float64).view(1, 3, 1, 1)
        dtype = torch.get_default_dtype()  # the run's (session.build_trainer)
        self.scale = (1 / (255 * std)).to(device, dtype)
        self.shift = (-mean / std).to(device, dtype)
        self.memory_format = memory_format

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, non_blocking=True)
        # One operation a batch: addcmul reads the uint8 pixels, writes the run's float dtype.
        return torch.addcmul(self.shift, x, self.scale).contiguous(memory_format=self.memory_format)


# ----------------------------------------------------------------------------- loaders


class ShardSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, for a run resumed mid-epoch."""

    def __init__(self, size: int, world_size: int, rank: int, shuffle: bool, seed: int = 0):
        super().__init__(range(size), world_size, rank, shuffle=shuffle, seed=seed)
        self.skip = 0  # samples of this rank's shard already trained on this epoch

    def epoch_indices(self) -> list[int]:
        """This rank's whole shard of the epoch, in order, the part already trained included."""
        return list(super().__iter__())

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return super().__len__() - self.skip


class TensorLoader:
    """A rank's batches, sliced from the whole data set held as one tensor on the device (the
    module's `tensor` path). The epoch's copy of the rank's shard (CIFAR-10: 150 MiB at one
    rank; Tiny ImageNet: 1.2 GiB) is one buffer, made with the loader and refilled every epoch:
    data set memory (data_mem), never training memory (peak_mem)."""

    def __init__(
        self,
        split: Split,
        sampler: ShardSampler,
        batch_size: int,
        steps: int,
        normalize: Normalize,
        augment: bool,
        generator: torch.Generator,
        seed: int,
        rank: int,
    ):
        device = normalize.device
        # Rows of one flat image each: index_select on them is a plain row copy, many times
        # faster than advanced indexing of the 4-d tensor on the CPU. A copy on the CPU too:
        # the rank then holds its data set as it does on a GPU, not as pages of a mapped file.
        self.images = split.images.to(device, copy=True).view(len(split), -1)
        self.image_shape = tuple(split.images.shape[1:])
        self.labels = split.labels.to(device, copy=True)
        self.sampler, self.batch_size, self.steps = sampler, batch_size, steps
        self.normalize, self.generator = normalize, generator
        self.seed, self.rank = seed, rank
        self.crop_flip = RandomCropFlip(self.image_shape, device) if augment else None
        # Zeros, not empty: every page is resident now, before the memory baseline is taken.
        # As many rows as an epoch takes: validation's last batch may be short, and an `out=`
        # of another size is resized (a deprecated warning, and an error in a later torch).
        images = min(steps * batch_size, sampler.num_samples)
        self.epoch_buffer = torch.zeros_like(self.images[:1]).repeat(images, 1)
        self.epoch_labels = torch.zeros_like(self.labels[:1]).repeat(images)

    def __len__(self) -> int:
        return self.steps

    def epoch_images(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The epoch's images, augmented where asked, and their labels, in the order of its
        batches: all of the rank's shard, also when a resumed run skips its first steps."""
        order = self.sampler.epoch_indices()[: self.steps * self.batch_size]
        indices = torch.tensor(order, device=self.images.device)
        torch.index_select(self.images, 0, indices, out=self.epoch_buffer)
        images = self.epoch_buffer.view(-1, *self.image_shape)
        if self.crop_flip:
            self.generator.manual_seed(augmentation_seed(self.seed, self.rank, self.sampler.epoch))
            self.crop_flip.in_place(images, self.generator)
        labels = torch.index_select(self.labels, 0, indices, out=self.epoch_labels)
        return images, labels

    def __iter__(self):
        """This epoch's batches from the sampler's position on (see Loaders.set_position)."""
        images, labels = self.epoch_images()
        first = self.sampler.skip // self.batch_size
        # The epoch's batches as views, made in one operation each for images and labels.
        batches = zip(images.split(self.batch_size), labels.split(self.batch_size))
        for batch_images, batch_labels in itertools.islice(batches, first, None):
            yield self.normalize(batch_images), batch_labels


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
    require_torchvision("--loader classic")
    from torchvision import transforms as T

    crop = T.RandomCrop(spec.image_shape[1:], padding=CROP_PADDING)
    steps = [crop, T.RandomHorizontalFlip()] if augment else []
    return T.Compose([*steps, T.ToTensor(), T.Normalize(spec.mean, spec.std)])


class ClassicLoader:
    """The course's pipeline: DataLoader workers transform images one by one on the CPU."""

    def __init__(
        self,
        split: Split,
        sampler: ShardSampler,
        batch_size: int,
        steps: int,
        spec: DatasetSpec,
        augment: bool,
        device: torch.device,
        num_workers: int,
        memory_format=torch.contiguous_format,
    ):
        self.loader = DataLoader(
            ImageDataset(split, classic_transform(spec, augment)),
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            persistent_workers=num_workers > 0,
        )
        self.sampler, self.steps, self.device = sampler, steps, device
        self.batch_size, self.memory_format = batch_size, memory_format

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        remaining = self.steps - self.sampler.skip // self.batch_size  # those not yet trained on
        for images, labels in itertools.islice(self.loader, remaining):
            images = images.to(self.device, torch.get_default_dtype(), non_blocking=True)
            yield (
                images.contiguous(memory_format=self.memory_format),
                labels.to(self.device, non_blocking=True),
            )


def validation_weights(
    offset: int, batch_len: int, rank: int, world_size: int, total: int, device: torch.device
) -> torch.Tensor:
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
        loaders = [loader for loader in (self.train, self.val) if isinstance(loader, TensorLoader)]
        return sum(
            t.nbytes
            for loader in loaders
            for t in (loader.images, loader.labels, loader.epoch_buffer, loader.epoch_labels)
        )

    def set_position(self, epoch: int, step: int = 0) -> None:
        """Shuffle for `epoch` (the same order on every rank) and start after `step` batches."""
        # exercise 3.1 begin
        self.train_sampler.set_epoch(epoch)
        # exercise 3.1 end
        self.train_sampler.skip = step * self.train.batch_size


def build_loaders(
    train: Split,
    val: Split,
    spec: DatasetSpec,
    *,
    kind: str,
    rank: int,
    world_size: int,
    global_batch: int,
    seed: int,
    augment: bool,
    device: torch.device,
    num_workers: int = 0,
    memory_format=torch.contiguous_format,
) -> Loaders:
    """Shard both splits over the ranks; training uses only full global batches."""
    local_batch = global_batch // world_size
    # exercise 3.1 begin
    train_sampler = ShardSampler(len(train), world_size, rank, shuffle=True, seed=seed)
    val_sampler = ShardSampler(len(val), world_size, rank, shuffle=False)
    # exercise 3.1 end
    train_steps = len(train) // global_batch
    val_steps = -(-len(val_sampler) // local_batch)
    gen = None
    if kind == "tensor":
        # Per-rank augmentation stream, independent of the sampler's shared permutation.
        gen = torch.Generator(device=device)
        norm = Normalize(spec, device, memory_format)
        make = partial(TensorLoader, normalize=norm, generator=gen, seed=seed, rank=rank)
    else:
        make = partial(
            ClassicLoader,
            spec=spec,
            device=device,
            num_workers=num_workers,
            memory_format=memory_format,
        )
    return Loaders(
        make(train, train_sampler, local_batch, train_steps, augment=augment),
        make(val, val_sampler, local_batch, val_steps, augment=False),
        train_sampler,
        len(val),
        gen,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description="Fetch a data set ahead of a job (e.g. on a login "
        "node with internet), then decode it into the tensor cache."
    )
    p.add_argument("--download", action="store_true", help="download if absent")
    p.add_argument("--data-dir", default="./data", help="target folder (default ./data)")
    p.add_argument(
        "--dataset",
        default="cifar10",
        choices=sorted(FILE_SETS),
        help="which (default cifar10; tinyimagenet has no download: unzip it there)",
    )
    args = p.parse_args(argv)
    try:
        train, val = load_files(
            args.dataset, Path(args.data_dir), download=args.download, fetch_hint=False
        )  # this command is the fetch
    except UsageError as e:
        fail(str(e))
    print(
        f"{FILE_SETS[args.dataset].title} ready in {args.data_dir}: {len(train)} training "
        f"and {len(val)} validation images"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
