"""Fashion-MNIST and Tiny ImageNet from files the tests write in their real formats: IDX files
(gzipped and plain) and JPEGs in the standard folder layout. What decoding yields, runs of
main.py on both sets with both loaders, and the one-line errors for missing or damaged files."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import data
from conftest import assert_one_line_error, config_in, main_on_ranks, metrics_in, run_main
from dataset_files import FASHION_FILES, FASHION_FOLDER, FASHION_URL, TINY_FOLDER, TINY_URL
from model import build_model
from utils import UsageError

RUN_TIMEOUT_S = 120  # each run below takes seconds; a hang fails instead of stalling the suite


# ----------------------------------------------------------------------------- Fashion-MNIST


def write_idx(path, array: np.ndarray, gz: bool) -> None:
    """An IDX file of unsigned bytes: magic 0x0800 + dims, each size (big-endian), the bytes."""
    blob = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    blob += array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(blob)
    else:
        path.write_bytes(blob)


# Two of the four files gzipped, two plain: the forms a download leaves and an unpacked copy.
FASHION_GZIPPED = {
    "train_images": True,
    "train_labels": False,
    "val_images": False,
    "val_labels": True,
}


def write_fashion_dir(root, n_train=40, n_val=16, seed=0) -> dict[str, np.ndarray]:
    """A small Fashion-MNIST in torchvision's layout (root/FashionMNIST/raw); what was written."""
    rng = np.random.default_rng(seed)
    folder = root / FASHION_FOLDER
    folder.mkdir(parents=True)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28)),
        "train_labels": rng.integers(0, 10, n_train),
        "val_images": rng.integers(0, 256, (n_val, 28, 28)),
        "val_labels": rng.integers(0, 10, n_val),
    }
    for key, (name, _) in FASHION_FILES.items():
        write_idx(folder / name, arrays[key], FASHION_GZIPPED[key])
    return arrays


def fashion_file(root, key: str):
    name = FASHION_FILES[key][0]
    return root / FASHION_FOLDER / (name + ".gz" * FASHION_GZIPPED[key])


def test_fashionmnist_decodes_to_padded_3_channel_images_with_their_labels(tmp_path):
    written = write_fashion_dir(tmp_path)
    train, val = data.load_files("fashionmnist", tmp_path, download=False)
    for split, prefix in ((train, "train"), (val, "val")):
        images = written[f"{prefix}_images"]
        assert split.images.shape == (len(images), 3, 32, 32)
        assert split.images.dtype == torch.uint8
        for c in range(3):  # the grey image in every channel, inside a 2-pixel black border
            assert np.array_equal(split.images[:, c, 2:30, 2:30].numpy(), images)
        border = split.images.clone()
        border[:, :, 2:30, 2:30] = 0
        assert not border.any()
        assert split.labels.tolist() == written[f"{prefix}_labels"].tolist()
    assert (tmp_path / "fashionmnist_uint8.pt").is_file(), "decoded once, into the cache"
    cached_train, _ = data.load_files("fashionmnist", tmp_path, download=False)
    assert torch.equal(cached_train.images, train.images)


def test_fashionmnist_download_uses_torchvisions_urls_and_md5s():
    """No download can run here: the table must be what torchvision's FashionMNIST fetches."""
    from torchvision.datasets import FashionMNIST

    ours = [(FASHION_URL + name + ".gz", md5) for name, md5 in FASHION_FILES.values()]
    theirs = [(FashionMNIST.mirrors[0] + name, md5) for name, md5 in FashionMNIST.resources]
    assert ours == theirs
    assert FASHION_FOLDER == "FashionMNIST/raw"


def test_fashionmnist_download_fetches_the_missing_files_into_torchvisions_folder(
    tmp_path, monkeypatch
):
    import torchvision.datasets.utils as tv_utils

    written = write_fashion_dir(tmp_path)
    fashion_file(tmp_path, "val_labels").unlink()
    calls = []

    def fake_download(url, root, filename, md5, remove_finished):  # no internet here
        calls.append((url, root, filename, md5))
        write_idx(Path(root) / filename.removesuffix(".gz"), written["val_labels"], gz=False)

    monkeypatch.setattr(tv_utils, "download_and_extract_archive", fake_download)
    _, val = data.load_files("fashionmnist", tmp_path, download=True)
    name, md5 = FASHION_FILES["val_labels"]
    assert calls == [
        (FASHION_URL + name + ".gz", str(tmp_path / FASHION_FOLDER), name + ".gz", md5)
    ]
    assert val.labels.tolist() == written["val_labels"].tolist()


def truncate(path) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])


@pytest.mark.parametrize(
    "key,damage,message",
    [
        ("train_images", truncate, "is not readable"),  # a cut gzip stream
        ("val_labels", lambda p: p.write_bytes(b"not gzip at all"), "is not readable"),
        ("val_images", truncate, "its header announces 16x28x28 bytes"),
        ("train_labels", lambda p: p.write_bytes(b"\0\0\x08\x03" + bytes(20)), "wrong magic"),
    ],
)
def test_damaged_fashionmnist_file_is_a_clear_error(tmp_path, key, damage, message):
    write_fashion_dir(tmp_path)
    path = fashion_file(tmp_path, key)
    damage(path)
    with pytest.raises(UsageError, match=message) as caught:
        data.load_files("fashionmnist", tmp_path, download=False)
    assert path.name in str(caught.value)


# ----------------------------------------------------------------------------- Tiny ImageNet


def colour(index: int) -> tuple[int, int, int]:
    """A solid colour per image, distinct, that JPEG keeps within a few levels."""
    return (40 + 9 * (index % 20), 30 + 7 * (index // 20 % 20), 200 - 5 * (index % 7))


def write_jpeg(path, index: int, grey: bool = False) -> np.ndarray:
    """A 64x64 image of one colour (grey: one channel); returns its pixels (64, 64, 3) as
    written, before JPEG's rounding."""
    rgb = np.broadcast_to(np.array(colour(index), dtype=np.uint8), (64, 64, 3))
    if grey:
        rgb = np.broadcast_to(rgb[..., :1], (64, 64, 3))
        Image.fromarray(np.ascontiguousarray(rgb[..., 0]), mode="L").save(path, "JPEG")
    else:
        Image.fromarray(np.ascontiguousarray(rgb)).save(path, "JPEG")
    return rgb


def write_tiny_dir(root, classes=3, per_class=8, n_val=9, grey=(0, 5)):
    """A small Tiny ImageNet in the zip's layout. Image i (training, then validation) has
    colour(i); the images listed in `grey` (by that index) are single-channel JPEGs. Returns
    the wnids and, per split, the (colour index, label) pairs in the order the set lists them."""
    folder = root / TINY_FOLDER
    wnids = [f"n0{1000 + 17 * k}" for k in range(classes)]
    folder.mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(wnids) + "\n")
    index, train = 0, []
    for label, wnid in enumerate(wnids):
        images = folder / "train" / wnid / "images"
        images.mkdir(parents=True)
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text("")  # as in the zip
        for k in range(per_class):
            write_jpeg(images / f"{wnid}_{k}.JPEG", index, index in grey)
            train.append((index, label))
            index += 1
    (folder / "val" / "images").mkdir(parents=True)
    val, lines = [], []
    for k in range(n_val):
        label = (k * 2 + 1) % classes  # not in class order: the annotations decide
        write_jpeg(folder / "val" / "images" / f"val_{k}.JPEG", index)
        lines.append(f"val_{k}.JPEG\t{wnids[label]}\t0\t0\t63\t63")
        val.append((index, label))
        index += 1
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return wnids, train, val


def test_tinyimagenet_decodes_64x64_rgb_images_with_their_labels(tmp_path):
    wnids, written_train, written_val = write_tiny_dir(tmp_path)
    train, val = data.load_files("tinyimagenet", tmp_path, download=False)
    folder = tmp_path / TINY_FOLDER
    for split, written in ((train, written_train), (val, written_val)):
        assert split.images.shape == (len(written), 3, 64, 64)
        assert split.labels.tolist() == [label for _, label in written]
        for image, (index, _) in zip(split.images, written):
            expected = np.array(colour(index)).reshape(3, 1, 1)
            if index in (0, 5):
                expected = np.full((3, 1, 1), colour(index)[0])
            assert np.abs(image.numpy().astype(int) - expected).max() <= 3, index
    # Exactly PIL's decoding of the file: a grey JPEG's one channel in all three.
    grey = np.asarray(Image.open(folder / "train" / wnids[0] / "images" / f"{wnids[0]}_5.JPEG"))
    assert grey.ndim == 2
    for c in range(3):
        assert np.array_equal(train.images[5, c].numpy(), grey)
    first_val = np.asarray(Image.open(folder / "val" / "images" / "val_0.JPEG"))
    assert np.array_equal(val.images[0].permute(1, 2, 0).numpy(), first_val)


def test_tinyimagenet_cache_is_rebuilt_when_images_are_added(tmp_path):
    wnids, _, _ = write_tiny_dir(tmp_path)
    assert len(data.load_files("tinyimagenet", tmp_path)[0]) == 24
    assert (tmp_path / "tinyimagenet_uint8.pt").is_file()
    write_jpeg(tmp_path / TINY_FOLDER / "train" / wnids[1] / "images" / "extra.JPEG", 99)
    train, _ = data.load_files("tinyimagenet", tmp_path)
    assert len(train) == 25 and train.labels.tolist().count(1) == 9


def remove_val_image(folder):
    (folder / "val" / "images" / "val_3.JPEG").unlink()
    return "val_3.JPEG is missing"


def remove_class_folder(folder):
    for path in (folder / "train" / "n01017" / "images").iterdir():
        path.unlink()
    return "n01017/images is missing or holds no .JPEG image"


def garble_jpeg(folder):
    (folder / "train" / "n01034" / "images" / "n01034_2.JPEG").write_bytes(b"\xff\xd8garbage")
    return "n01034_2.JPEG is not a readable image"


def truncate_jpeg(folder):
    truncate(folder / "val" / "images" / "val_8.JPEG")
    return "val_8.JPEG is not a readable image"


def unknown_wnid(folder):
    path = folder / "val" / "val_annotations.txt"
    path.write_text(path.read_text().replace("n01017", "n09999", 1))
    return "val_annotations.txt line 1"


def wrong_size(folder):
    Image.new("RGB", (32, 64)).save(folder / "val" / "images" / "val_2.JPEG", "JPEG")
    return "val_2.JPEG: expected a 64x64 image, got 32x64"


@pytest.mark.parametrize(
    "damage",
    [remove_val_image, remove_class_folder, garble_jpeg, truncate_jpeg, unknown_wnid, wrong_size],
)
def test_damaged_tinyimagenet_is_a_clear_error(tmp_path, damage):
    write_tiny_dir(tmp_path)
    message = damage(tmp_path / TINY_FOLDER)
    with pytest.raises(UsageError, match=message):
        data.load_files("tinyimagenet", tmp_path)


def test_tinyimagenet_without_files_says_where_to_get_it(tmp_path):
    for download in (True, False):  # there is no download to turn on or off
        with pytest.raises(UsageError) as caught:
            data.load_files("tinyimagenet", tmp_path / "none", download=download)
        message = str(caught.value)
        assert "\n" not in message
        assert TINY_URL in message and f"unzip it in {tmp_path / 'none'}" in message


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_models_take_the_data_sets_classes_and_image_size(name):
    spec = data.DATASETS["tinyimagenet"]
    model = build_model(name, spec.num_classes, spec.image_shape)
    assert model(torch.zeros(2, *spec.image_shape)).shape == (2, 200)
    if name == "cnn":
        with pytest.raises(AssertionError, match=r"\(N, 3, 64, 64\)"):
            model(torch.zeros(2, 3, 32, 32))


# ----------------------------------------------------------------------------- main.py


def run_args(dataset: str, root, loader: str) -> list:
    options = "--epochs 1 --batch-size 8 --num-workers 1 --print-every 1000 --no-checkpoint"
    return ["--dataset", dataset, "--data-dir", root, "--loader", loader, *options.split()]


@pytest.mark.parametrize(
    "dataset,loader,nproc",
    [
        ("fashionmnist", "tensor", 2),
        ("fashionmnist", "classic", None),
        ("tinyimagenet", "tensor", None),
        ("tinyimagenet", "classic", 2),
    ],
)
def test_training_run_on_each_set_with_each_loader(tmp_path, dataset, loader, nproc):
    write = write_fashion_dir if dataset == "fashionmnist" else write_tiny_dir
    write(tmp_path)
    done, _ = main_on_ranks(
        [*run_args(dataset, tmp_path, loader), "--train-samples", "16"],
        nproc or 1,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (metric,) = metrics_in(done.stdout)
    assert metric["dataset"] == dataset and metric["world_size"] == (nproc or 1)
    assert metric["train_images"] == 16
    config = config_in(done.stdout)
    spec = data.DATASETS[dataset]
    assert config["parameters"] == sum(
        p.numel() for p in build_model("cnn", spec.num_classes, spec.image_shape).parameters()
    )
    assert config["val_size"] == (16 if dataset == "fashionmnist" else 9)


@pytest.mark.parametrize("dataset", ["fashionmnist", "tinyimagenet"])
def test_check_finds_each_set_and_what_it_would_fail_on(tmp_path, dataset):
    write = write_fashion_dir if dataset == "fashionmnist" else write_tiny_dir
    write(tmp_path)
    args = [*run_args(dataset, tmp_path, "tensor"), "--check", "1", "2"]
    done = run_main([*args, "--train-samples", "20"], timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "20 training images" in done.stdout
    assert not list(tmp_path.glob("*.pt")), "--check writes nothing"
    assert_one_line_error(
        run_main([*args, "--data-dir", tmp_path / "none", "--no-download"], timeout=RUN_TIMEOUT_S),
        "not found in",
    )


def corrupt_fashion(root):
    write_fashion_dir(root)
    truncate(fashion_file(root, "train_images"))
    return ("train-images-idx3-ubyte.gz is not readable",)


def missing_fashion(root):
    write_fashion_dir(root)
    fashion_file(root, "val_labels").unlink()
    return (
        "Fashion-MNIST not found in",
        "downloading is off",
        "python data.py --download --data-dir",
        "--dataset fashionmnist",
    )


def no_tiny(root):
    return ("Tiny ImageNet not found in", TINY_URL, f"unzip it in {root}")


@pytest.mark.parametrize(
    "dataset,setup",
    [
        ("fashionmnist", corrupt_fashion),
        ("fashionmnist", missing_fashion),
        ("tinyimagenet", no_tiny),
    ],
)
def test_bad_files_are_one_line_errors_from_main(tmp_path, dataset, setup):
    """Through main.py, a damaged file, a missing one and a missing set are one line each. Tiny
    ImageNet's damaged files raise their UsageError in load_files as Fashion-MNIST's do:
    test_damaged_tinyimagenet_is_a_clear_error reads their words."""
    fragments = setup(tmp_path)
    done = run_main(
        [*run_args(dataset, tmp_path, "tensor"), "--no-download"], timeout=RUN_TIMEOUT_S
    )
    assert_one_line_error(done, *fragments)
