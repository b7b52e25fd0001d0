"""CIFAR-10, Fashion-MNIST, Tiny ImageNet (or a synthetic stand-in) for data-parallel
training: each rank a disjoint shard.

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

Images are uint8 (3, H, W): CIFAR-10 32x32; Fashion-MNIST's 28x28 grey images padded to 32x32
and the channel repeated, at decoding; Tiny ImageNet 64x64 (grey JPEGs made RGB), no download.
Run `python data.py --download --data-dir DIR [--dataset fashionmnist]` on a machine with
internet (e.g. a login node) to fetch a data set before a job.
"""

import argparse
import gzip
import itertools
import math
import os
import pickle
import struct
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from distributed_utils import on_rank0
from model import IMAGE_SHAPE, NUM_CLASSES
from utils import UsageError, fail

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CACHE_FILE = "cifar10_uint8.pt"  # decoded tensors, beside the python batches
# Fashion-MNIST's files and their .gz md5s, as torchvision's FashionMNIST has them, in its folder.
FASHION_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_FILES = {
    "train_images": ("train-images-idx3-ubyte", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    "train_labels": ("train-labels-idx1-ubyte", "25c81989df183df01b3e8a0aad5dffbe"),
    "val_images": ("t10k-images-idx3-ubyte", "bef4ecab320f06d8554ea6380940ec79"),
    "val_labels": ("t10k-labels-idx1-ubyte", "bb300cfdad3c16e7a12a480ee83cd310"),
}
FASHION_FOLDER = "FashionMNIST/raw"
FASHION_PAD = 2  # 28x28 -> 32x32
TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_FOLDER = "tiny-imagenet-200"
TINY_SHAPE = (3, 64, 64)
TINY_CLASSES = 200
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


@dataclass(frozen=True)
class FileSet:
    """A data set kept as files under --data-dir, decoded once into a tensor cache beside them.

    Every function takes the data set's folder (download: --data-dir). CIFAR-10's are lambdas
    that look their function up when called, so that tests can replace it in this module.
    """

    title: str  # as messages name it
    folder: str  # under --data-dir
    present: Callable[[Path], bool]  # are the source files there?
    sources: Callable[[Path], list[Path]]  # whose sizes and times key the cache
    decode: Callable[[Path], dict[str, torch.Tensor]]  # {train,val}_{images,labels}
    download: Callable[[Path], None] | None  # None: the user fetches it (see `manual`)
    size: str = ""  # of the download, for --check
    manual: str = ""  # where to get a set without download; {data_dir} is filled in


# ----------------------------------------------------------------------------- CIFAR-10 files


def download_cifar10(data_dir: Path) -> None:
    """Fetch and unpack the official archive; torchvision verifies its md5 after download."""
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(
        CIFAR10_URL, str(data_dir), filename=CIFAR10_ARCHIVE, md5=CIFAR10_MD5, remove_finished=True
    )


def cifar10_sources(folder: Path) -> list[Path]:
    return [folder / f for f in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)]


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
        raise UsageError(
            f"{path} is not a CIFAR-10 python batch ({type(e).__name__}: {e}); "
            "delete it and download again"
        ) from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise UsageError(
            f"{path}: expected n x 3072 pixels and n labels, got {data.shape} and {labels.shape}"
        )
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


# ----------------------------------------------------------------------------- Fashion-MNIST files


def download_fashionmnist(data_dir: Path) -> None:
    """Fetch the missing IDX files as torchvision's FashionMNIST does (same URLs and md5s)."""
    from torchvision.datasets.utils import download_and_extract_archive

    folder = data_dir / FASHION_FOLDER
    for name, md5 in FASHION_FILES.values():
        if idx_path(folder, name) is None:
            download_and_extract_archive(
                FASHION_URL + name + ".gz",
                str(folder),
                filename=name + ".gz",
                md5=md5,
                remove_finished=True,
            )


def idx_path(folder: Path, name: str) -> Path | None:
    """The IDX file `name`, as is or gzipped (the form it is downloaded in); None if neither."""
    return next((p for p in (folder / name, folder / f"{name}.gz") if p.is_file()), None)


def fashionmnist_sources(folder: Path) -> list[Path]:
    """The four files in FASHION_FILES' order (a missing one by its plain name)."""
    return [idx_path(folder, name) or folder / name for name, _ in FASHION_FILES.values()]


def read_idx(path: Path, dims: int) -> np.ndarray:
    """An IDX file of unsigned bytes with `dims` dimensions (MNIST's format): a big-endian
    header (magic 0x0800 + dims, then each size) and the bytes; gzipped if it ends in .gz."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise UsageError(f"{path} is missing") from None
    except (OSError, EOFError, zlib.error) as e:  # a damaged gzip fails in any of these
        raise UsageError(
            f"{path} is not readable ({type(e).__name__}: {e}); delete it and download again"
        ) from None
    header = 4 * (dims + 1)
    if len(blob) < header or struct.unpack(">I", blob[:4])[0] != 0x0800 + dims:
        raise UsageError(
            f"{path} is not an IDX file of {dims}-d unsigned bytes (wrong magic "
            "number); delete it and download again"
        )
    shape = struct.unpack(f">{dims}I", blob[4:header])
    if len(blob) - header != math.prod(shape):
        raise UsageError(
            f"{path}: its header announces {'x'.join(map(str, shape))} bytes, "
            f"{len(blob) - header} follow; delete it and download again"
        )
    # A copy: torch wants writable memory, and the bytes object is read-only.
    return np.frombuffer(blob, dtype=np.uint8, offset=header).reshape(shape).copy()


def fashion_to_rgb32(images: np.ndarray) -> torch.Tensor:
    """28x28 grey -> 3x32x32: zero-padded by 2 pixels (black, the images' own background) and
    the grey channel repeated, so that every model and the crop/flip take them unchanged."""
    padded = F.pad(torch.from_numpy(images), (FASHION_PAD,) * 4)
    return padded.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def decode_fashionmnist(folder: Path) -> dict[str, torch.Tensor]:
    paths = dict(zip(FASHION_FILES, fashionmnist_sources(folder)))
    arrays = {
        key: read_idx(path, 3 if key.endswith("images") else 1) for key, path in paths.items()
    }
    for split in ("train", "val"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        where = folder / FASHION_FILES[f"{split}_images"][0]
        if images.shape[1:] != (28, 28) or len(images) != len(labels):
            raise UsageError(
                f"{where}: expected n 28x28 images and n labels, got "
                f"{images.shape} and {labels.shape}"
            )
        check_labels(labels, 10, where)
    return {
        key: fashion_to_rgb32(a) if key.endswith("images") else torch.from_numpy(a).long()
        for key, a in arrays.items()
    }


def check_labels(labels: np.ndarray, classes: int, where: Path) -> None:
    if len(labels) and not (0 <= labels.min() and labels.max() < classes):
        raise UsageError(f"{where}: labels outside 0..{classes - 1}")


# ----------------------------------------------------------------------------- Tiny ImageNet files


def read_list(path: Path) -> str:
    """A text file of Tiny ImageNet's, or a one-line error."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not readable ({type(e).__name__}: {e})") from None


def tiny_wnids(folder: Path) -> list[str]:
    """The class ids in label order: wnids.txt, one per line."""
    path = folder / "wnids.txt"
    wnids = read_list(path).split()
    if not wnids or len(set(wnids)) != len(wnids) or len(wnids) > TINY_CLASSES:
        raise UsageError(
            f"{path}: expected up to {TINY_CLASSES} distinct class ids, one a "
            f"line, got {len(wnids)} ({len(set(wnids))} distinct)"
        )
    return wnids


def tiny_val_annotations(folder: Path, wnids: list[str]) -> list[tuple[Path, int]]:
    """(image, label) of the validation set, in val_annotations.txt's order: lines of
    `file<TAB>wnid<TAB>box`, the box ignored."""
    path, label_of = folder / "val" / "val_annotations.txt", {w: i for i, w in enumerate(wnids)}
    lines = read_list(path).splitlines()
    pairs = []
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in label_of:
            raise UsageError(
                f"{path} line {number}: expected `image<TAB>wnid ...` with a wnid "
                f"of wnids.txt, got {line[:60]!r}"
            )
        pairs.append((folder / "val" / "images" / fields[0], label_of[fields[1]]))
    return pairs


def tiny_train_images(folder: Path, wnids: list[str]) -> list[tuple[Path, int]]:
    """(image, label) of the training set: train/<wnid>/images/*.JPEG, class by class."""
    pairs = []
    for label, wnid in enumerate(wnids):
        images = folder / "train" / wnid / "images"
        files = sorted(images.glob("*.JPEG"))
        if not files:
            raise UsageError(
                f"{images} is missing or holds no .JPEG image; unzip {TINY_FOLDER}.zip again"
            )
        pairs += [(f, label) for f in files]
    return pairs


def read_jpeg(path: Path, out: np.ndarray) -> None:
    """Decode one image into out (3, 64, 64); grey (and CMYK) JPEGs become RGB."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
    except FileNotFoundError:
        raise UsageError(f"{path} is missing") from None
    except Exception as e:  # PIL fails in many ways on a damaged file
        raise UsageError(
            f"{path} is not a readable image ({type(e).__name__}: {e}); unzip "
            f"{TINY_FOLDER}.zip again"
        ) from None
    if pixels.shape != out.shape[1:] + out.shape[:1]:
        raise UsageError(
            f"{path}: expected a {out.shape[2]}x{out.shape[1]} image, got "
            f"{pixels.shape[1]}x{pixels.shape[0]}"
        )
    out[:] = pixels.transpose(2, 0, 1)


def decode_images(pairs: list[tuple[Path, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    images = np.empty((len(pairs), *TINY_SHAPE), dtype=np.uint8)  # filled in place: one copy
    for i, (path, _) in enumerate(pairs):
        read_jpeg(path, images[i])
    labels = torch.tensor([label for _, label in pairs], dtype=torch.int64)
    return torch.from_numpy(images), labels


def decode_tinyimagenet(folder: Path) -> dict[str, torch.Tensor]:
    wnids = tiny_wnids(folder)
    train_images, train_labels = decode_images(tiny_train_images(folder, wnids))
    val_images, val_labels = decode_images(tiny_val_annotations(folder, wnids))
    return {
        "train_images": train_images,
        "train_labels": train_labels,
        "val_images": val_images,
        "val_labels": val_labels,
    }


def tinyimagenet_sources(folder: Path) -> list[Path]:
    """What keys the cache: the two lists and the image folders. A folder's time changes when
    a file in it is added, removed or renamed (statting 110,000 JPEGs would take long on a
    parallel file system); a JPEG rewritten in place goes unnoticed: delete the cache then."""
    try:
        wnids = tiny_wnids(folder)
    except UsageError:
        wnids = []  # decoding will say what is wrong
    return [
        folder / "wnids.txt",
        folder / "val" / "val_annotations.txt",
        folder / "val" / "images",
        *(folder / "train" / w / "images" for w in wnids),
    ]


# ----------------------------------------------------------------------------- the decoded cache

FILE_SETS = {  # the data sets kept in files, by config.DATASETS name
    "cifar10": FileSet(
        "CIFAR-10",
        CIFAR10_FOLDER,
        present=lambda folder: all(p.is_file() for p in cifar10_sources(folder)),
        sources=lambda folder: cifar10_sources(folder),
        decode=lambda folder: decode_cifar10(folder),
        download=lambda data_dir: download_cifar10(data_dir),
        size="170 MB",
    ),
    "fashionmnist": FileSet(
        "Fashion-MNIST",
        FASHION_FOLDER,
        present=lambda folder: all(idx_path(folder, n) for n, _ in FASHION_FILES.values()),
        sources=fashionmnist_sources,
        decode=decode_fashionmnist,
        download=download_fashionmnist,
        size="30 MB",
    ),
    "tinyimagenet": FileSet(
        "Tiny ImageNet",
        TINY_FOLDER,
        present=lambda folder: (folder / "wnids.txt").is_file(),
        sources=tinyimagenet_sources,
        decode=decode_tinyimagenet,
        download=None,
        manual=f"download {TINY_URL} (240 MB) and unzip it in {{data_dir}}",
    ),
}


def cache_path(dataset: str, data_dir: Path) -> Path:
    return data_dir / f"{dataset}_uint8.pt"  # cifar10: CACHE_FILE


def _source_signature(files: FileSet, folder: Path) -> list:
    def stat(path: Path) -> tuple:
        try:
            s = path.stat()
            return str(path.relative_to(folder)), s.st_size, s.st_mtime_ns
        except OSError:  # missing: decoding will say so
            return str(path.relative_to(folder)), None, None

    return [stat(p) for p in files.sources(folder)]


def _read_cache(dataset: str, data_dir: Path) -> dict | None:
    """The cached tensors (memory-mapped), if the cache matches the source files."""
    files = FILE_SETS[dataset]
    try:
        cached = torch.load(cache_path(dataset, data_dir), mmap=True)
        if cached["signature"] == _source_signature(files, data_dir / files.folder):
            return cached
    except Exception:
        pass  # absent or unreadable cache: (re)build it
    return None


def build_cache(dataset: str, data_dir: Path) -> Path:
    """Decode once into one tensor file; rebuilt whenever the source files change."""
    files, cache = FILE_SETS[dataset], cache_path(dataset, data_dir)
    folder = data_dir / files.folder
    signature = _source_signature(files, folder)
    if _read_cache(dataset, data_dir) is not None:
        return cache
    print(f"[rank 0] decoding {files.title} into {cache} (once: later runs read that)", flush=True)
    tensors = files.decode(folder)
    # Write to a temporary name, then rename: a crash never leaves a half-written cache.
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=cache.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save({**tensors, "signature": signature}, tmp)
        os.replace(tmp, cache)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return cache


def fetch_command(dataset: str, data_dir: Path) -> str:
    return f"python data.py --download --data-dir {data_dir}" + (
        "" if dataset == "cifar10" else f" --dataset {dataset}"
    )


def _not_found(dataset: str, data_dir: Path) -> str:
    files = FILE_SETS[dataset]
    where = f"{files.title} not found in {data_dir / files.folder}"
    if files.download is None:
        how = files.manual.format(data_dir=data_dir)
    else:
        how = f"downloading is off; fetch it with: {fetch_command(dataset, data_dir)}"
    return f"{where}: {how} (or train without it: --dataset synthetic)"


def _download_failed(dataset: str, data_dir: Path, error: Exception, fetch_hint: bool) -> str:
    where = (
        "fetch it on a machine with internet (e.g. a login node) with: "
        f"{fetch_command(dataset, data_dir)}, or "
        if fetch_hint
        else ""
    )
    return (
        f"downloading {FILE_SETS[dataset].title} into {data_dir} failed ({error}); this "
        f"machine may have no internet: {where}train without it: --dataset synthetic"
    )


def _prepare_on_rank0(
    dataset: str, data_dir: Path, download: bool, fetch_hint: bool = True
) -> str | None:
    """Download if needed and build the cache; returns the cache's path (None: no cache)."""
    files = FILE_SETS[dataset]
    folder = data_dir / files.folder
    if not files.present(folder):
        if not download or files.download is None:
            raise UsageError(_not_found(dataset, data_dir))
        print(f"[rank 0] {files.title} not found in {data_dir}, downloading ...", flush=True)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            files.download(data_dir)
        except Exception as e:
            raise UsageError(_download_failed(dataset, data_dir, e, fetch_hint)) from None
        if not files.present(folder):
            raise UsageError(f"the download did not produce {folder}")
    try:
        return str(build_cache(dataset, data_dir))
    except OSError as e:  # read-only data folder: every rank decodes the files itself
        print(
            f"[rank 0] warning: cannot write {cache_path(dataset, data_dir)} ({e}); "
            "decoding without a cache",
            flush=True,
        )
        files.decode(folder)  # validate once, here, with a clear error
        return None


def load_files(
    dataset: str, data_dir: Path, download: bool = True, fetch_hint: bool = True
) -> tuple[Split, Split]:
    """Every rank calls this; rank 0 alone touches the network and writes files."""
    data_dir = Path(data_dir)
    # exercise 3.1 begin
    cache = on_rank0(_prepare_on_rank0, dataset, data_dir, download, fetch_hint)
    # exercise 3.1 end
    t = (
        torch.load(cache, mmap=True)
        if cache
        else FILE_SETS[dataset].decode(data_dir / FILE_SETS[dataset].folder)
    )
    return Split(t["train_images"], t["train_labels"]), Split(t["val_images"], t["val_labels"])


def load_cifar10(
    data_dir: Path, download: bool = True, fetch_hint: bool = True
) -> tuple[Split, Split]:
    return load_files("cifar10", data_dir, download, fetch_hint)


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
            train_samples or spec.train_size, val_samples or spec.val_size, seed
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
        return train_samples or spec.train_size, "synthetic data, generated from the seed"
    files = FILE_SETS[dataset]
    folder = data_dir / files.folder
    if not files.present(folder):
        if not download or files.download is None:
            raise UsageError(_not_found(dataset, data_dir))
        return (
            min(train_samples or spec.train_size, spec.train_size),
            f"{files.title} not in {data_dir}: rank 0 will download it ({files.size})",
        )
    # Without a cache yet, the files are decoded here as the run would (Tiny ImageNet: its
    # 110,000 JPEGs, some 15 s), so that a damaged file fails the check.
    cached = _read_cache(dataset, data_dir)
    labels = (cached or files.decode(folder))["train_labels"]
    size = len(labels) if train_samples is None else min(train_samples, len(labels))
    return size, f"{files.title} in {data_dir}"


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
        # One operation per batch: addcmul reads the uint8 pixels and writes float32 (fp64's
        # float64).
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

    def steps_left(self, steps: int, batch_size: int) -> int:
        """Of an epoch's `steps` batches, those not yet trained on."""
        return steps - self.skip // batch_size


class TensorLoader:
    """A rank's batches, sliced from the whole data set held as one tensor on the device.

    At the start of an epoch, the rank's shard in the sampler's order (a DistributedSampler) is
    gathered into one uint8 tensor, cropped and flipped as a whole; a step then slices its batch
    and normalizes it. The epoch's copy is the size of the rank's shard (CIFAR-10: 150 MiB at
    one rank, less at more; Tiny ImageNet: 1.2 GiB): one buffer, made with the loader and
    refilled every epoch, so that it is data set (data_mem) and never training memory
    (peak_mem), and no epoch allocates its size anew. The gathers are bounded
    (RandomCropFlip.PIXELS_PER_GATHER).
    """

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
            drop_last=False,
            persistent_workers=num_workers > 0,
        )
        self.sampler, self.steps, self.device = sampler, steps, device
        self.batch_size, self.memory_format = batch_size, memory_format

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        remaining = self.sampler.steps_left(self.steps, self.batch_size)
        for _, (images, labels) in zip(range(remaining), self.loader):
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
        norm = Normalize(spec, device, memory_format)
        # Per-rank augmentation stream, independent of the sampler's shared permutation.
        gen = torch.Generator(device=device)

        def make(split, sampler, steps, aug):
            return TensorLoader(split, sampler, local_batch, steps, norm, aug, gen, seed, rank)
    else:

        def make(split, sampler, steps, aug):
            return ClassicLoader(
                split, sampler, local_batch, steps, spec, aug, device, num_workers, memory_format
            )

    return Loaders(
        make(train, train_sampler, train_steps, augment),
        make(val, val_sampler, val_steps, False),
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
