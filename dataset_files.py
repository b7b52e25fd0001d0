"""The data sets kept as files under --data-dir: how each is downloaded, read and checked, and
the cache of decoded tensors that rank 0 writes beside them (data.py decides who calls what).

CIFAR-10 is python pickles, Fashion-MNIST gzipped IDX files, Tiny ImageNet JPEGs (no download:
the user unzips it). Each decodes to uint8 images (N, 3, H, W) and int64 labels: CIFAR-10
32x32; Fashion-MNIST's 28x28 grey images padded to 32x32 and the channel repeated, so that
every model and the crop/flip take them unchanged; Tiny ImageNet 64x64, grey JPEGs made RGB.
A damaged or foreign file is a one-line UsageError that says what to do.
"""

import gzip
import math
import struct
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import safe_load
from utils import UsageError, require_torchvision, write_atomically

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
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
SPLITS = ("train_images", "train_labels", "val_images", "val_labels")  # what a set decodes to
REDOWNLOAD = "; delete it and download again"  # what to do with a damaged file
REUNZIP = f"; unzip {TINY_FOLDER}.zip again"


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


@contextmanager
def reading(path: Path, what: str, remedy: str, errors=(Exception,)):
    """A failure to read `path` as a one-line UsageError: `{path} is missing`, or `{path} is not
    {what} (the error){remedy}`. Damaged and foreign files fail in many ways in the readers."""
    try:
        yield
    except FileNotFoundError:
        raise UsageError(f"{path} is missing") from None
    except UsageError:
        raise
    except errors as e:
        raise UsageError(f"{path} is not {what} ({type(e).__name__}: {e}){remedy}") from None


def as_splits(*arrays) -> dict[str, torch.Tensor]:
    """Images and labels of training, then validation, keyed as SPLITS."""
    return {key: torch.as_tensor(a) for key, a in zip(SPLITS, arrays)}


def check_split(images: np.ndarray, labels: np.ndarray, shape: tuple, classes: int, where: Path):
    """n images of `shape` bytes and n labels, each a class; else a one-line error."""
    if images.shape[1:] != shape or len(labels) != len(images):
        raise UsageError(
            f"{where}: expected n images of {'x'.join(map(str, shape))} bytes and n labels, got "
            f"{images.shape} and {labels.shape}"
        )
    if len(labels) and not (0 <= labels.min() and labels.max() < classes):
        raise UsageError(f"{where}: labels outside 0..{classes - 1}")


# ----------------------------------------------------------------------------- CIFAR-10 files


def download_cifar10(data_dir: Path) -> None:
    """Fetch and unpack the official archive; torchvision verifies its md5 after download."""
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(
        CIFAR10_URL, str(data_dir), filename=CIFAR10_ARCHIVE, md5=CIFAR10_MD5, remove_finished=True
    )


def cifar10_sources(folder: Path) -> list[Path]:
    return [folder / f for f in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)]


# What a CIFAR-10 python batch may name: a dict of bytes keys, lists, and numpy arrays, pickled
# by numpy 1 (numpy.core; the real files, python 2 pickles) or 2 (numpy._core: protocol 5 keeps
# the buffer apart, _frombuffer), with python 3's bytes at protocol 2 (_codecs.encode).
CIFAR10_PICKLE_GLOBALS = frozenset(
    [("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")]
    + [(f"numpy.{core}.multiarray", "_reconstruct") for core in ("core", "_core")]
    + [(f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")]
)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One file of CIFAR-10's python format: images (n, 3, 32, 32) uint8 and labels (n,).

    Unlike torchvision's CIFAR10, no md5 of the files is required, so directories of any size
    in the same format load too. The format is a pickle, so it is read by an unpickler that
    admits only what the format holds (safe_load): a crafted file is refused, its code not
    run.
    """
    with reading(path, "a CIFAR-10 python batch", REDOWNLOAD), open(path, "rb") as f:
        try:
            batch = safe_load.pickle(f, CIFAR10_PICKLE_GLOBALS, encoding="bytes")
        except safe_load.Refused as e:
            raise UsageError(
                f"{path} is not a CIFAR-10 python batch and was not loaded: {e} (a pickle can "
                "run code; this one was stopped before it could). Delete it and download again"
            ) from None
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
        check_split(data, labels, (3 * 32 * 32,), 10, path)  # a lone label: one line too
    return data.reshape(-1, 3, 32, 32), labels


def decode_cifar10(folder: Path) -> dict[str, torch.Tensor]:
    train = [read_cifar_batch(folder / f) for f in CIFAR10_TRAIN_FILES]
    images, labels = (np.concatenate(parts) for parts in zip(*train))
    return as_splits(images, labels, *read_cifar_batch(folder / CIFAR10_TEST_FILE))


# ----------------------------------------------------------------------------- Fashion-MNIST files


def download_fashionmnist(data_dir: Path) -> None:
    """Fetch the missing IDX files as torchvision's FashionMNIST does (same URLs and md5s)."""
    from torchvision.datasets.utils import download_and_extract_archive

    folder = data_dir / FASHION_FOLDER
    for name, md5 in FASHION_FILES.values():
        if idx_path(folder, name) is None:
            archive = name + ".gz"
            download_and_extract_archive(
                FASHION_URL + archive, str(folder), filename=archive, md5=md5, remove_finished=True
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
    with reading(path, "readable", REDOWNLOAD, (OSError, EOFError, zlib.error)):
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            blob = f.read()
    header = 4 * (dims + 1)
    if len(blob) < header or struct.unpack(">I", blob[:4])[0] != 0x0800 + dims:
        raise UsageError(
            f"{path} is not an IDX file of {dims}-d unsigned bytes (wrong magic number)"
            + REDOWNLOAD
        )
    shape = struct.unpack(f">{dims}I", blob[4:header])
    if len(blob) - header != math.prod(shape):
        raise UsageError(
            f"{path}: its header announces {'x'.join(map(str, shape))} bytes, "
            f"{len(blob) - header} follow{REDOWNLOAD}"
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
        where = folder / FASHION_FILES[f"{split}_images"][0]
        check_split(arrays[f"{split}_images"], arrays[f"{split}_labels"], (28, 28), 10, where)
    return {
        key: fashion_to_rgb32(a) if key.endswith("images") else torch.from_numpy(a).long()
        for key, a in arrays.items()
    }


# ----------------------------------------------------------------------------- Tiny ImageNet files


def read_list(path: Path) -> str:
    """A text file of Tiny ImageNet's, or a one-line error."""
    with reading(path, "readable", "", (OSError, UnicodeDecodeError)):
        return path.read_text()


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
            raise UsageError(f"{images} is missing or holds no .JPEG image{REUNZIP}")
        pairs += [(f, label) for f in files]
    return pairs


def read_jpeg(path: Path, out: np.ndarray) -> None:
    """Decode one image into out (3, 64, 64); grey (and CMYK) JPEGs become RGB."""
    from PIL import Image

    with reading(path, "a readable image", REUNZIP), Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
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
    train = decode_images(tiny_train_images(folder, wnids))
    return as_splits(*train, *decode_images(tiny_val_annotations(folder, wnids)))


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
    return data_dir / f"{dataset}_uint8.pt"


def _source_signature(files: FileSet, folder: Path) -> list:
    def stat(path: Path) -> tuple:
        try:
            s = path.stat()
            return str(path.relative_to(folder)), s.st_size, s.st_mtime_ns
        except OSError:  # missing: decoding will say so
            return str(path.relative_to(folder)), None, None

    return [stat(p) for p in files.sources(folder)]


def open_cache(path: Path) -> dict:
    """A decoded cache's tensors, memory-mapped, read weights-only: torch's own format, which
    this loader keeps to tensors and plain data (docs/reliability.md#what-the-run-trusts)."""
    return torch.load(path, mmap=True, weights_only=True)


def read_cache(dataset: str, data_dir: Path) -> dict | None:
    """The cached tensors (memory-mapped), if the cache matches the source files."""
    files = FILE_SETS[dataset]
    try:
        cached = open_cache(cache_path(dataset, data_dir))
        if cached["signature"] == _source_signature(files, data_dir / files.folder):
            return cached
    except Exception:
        pass  # absent or unreadable cache: (re)build it
    return None


def build_cache(dataset: str, data_dir: Path) -> Path:
    """Decode once into one tensor file; rebuilt whenever the source files change."""
    files, cache = FILE_SETS[dataset], cache_path(dataset, data_dir)
    if read_cache(dataset, data_dir) is not None:
        return cache
    folder = data_dir / files.folder
    signature = _source_signature(files, folder)  # before decoding: a change meanwhile shows
    print(f"[rank 0] decoding {files.title} into {cache} (once: later runs read that)", flush=True)
    tensors = files.decode(folder)

    def save(temp: Path) -> None:  # opened here: a read-only folder is then an OSError
        with open(temp, "wb") as f:
            torch.save({**tensors, "signature": signature}, f)

    write_atomically(cache, save)  # a crash never leaves a half-written cache
    return cache


def fetch_command(dataset: str, data_dir: Path) -> str:
    return f"python data.py --download --data-dir {data_dir}" + (
        "" if dataset == "cifar10" else f" --dataset {dataset}"
    )


def not_found(dataset: str, data_dir: Path) -> str:
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


def must_download(dataset: str, data_dir: Path, download: bool) -> bool:
    """Whether the set's files are still to be downloaded; the run's UsageError where they are
    absent and cannot be (downloading off, or a set the user fetches, or no torchvision)."""
    files = FILE_SETS[dataset]
    if files.present(data_dir / files.folder):
        return False
    if not download or files.download is None:
        raise UsageError(not_found(dataset, data_dir))
    require_torchvision(f"downloading {files.title}")  # before the network can be blamed
    return True


def prepare(dataset: str, data_dir: Path, download: bool, fetch_hint: bool = True) -> str | None:
    """Rank 0's part of data.load_files: download if needed and build the cache; returns the
    cache's path (None: no cache)."""
    files = FILE_SETS[dataset]
    folder = data_dir / files.folder
    if must_download(dataset, data_dir, download):
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
