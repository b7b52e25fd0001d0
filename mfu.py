"""How close to the hardware a run came: the model's FLOPs, and the device's peak.

A training step's useful arithmetic is the model's convolutions and matrix products, forward
and backward. torch's FlopCounterMode counts them once, per image, on the meta device (shapes
only: no weights, no data, no random numbers drawn). Each `[METRIC]` line then reports

    tflops  the model TFLOP/s each device achieved: FLOPs per image x images / time / devices
    mfu     model FLOPs utilisation, percent: tflops against the device's dense peak for the
            run's precision (PEAK_TFLOPS, or --peak-tflops); `na` where the peak is unknown

The count is the model's, not the kernels': what the framework adds (augmentation,
element-wise layers, the optimizer, communication) is the overhead MFU measures.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from model import build_model
from precision import PEAK_KEYS


def peaks(fp32: float, tf32: float, half: float) -> dict[str, float]:
    """A device's peaks by the arithmetic a precision runs on (precision.PEAK_KEYS)."""
    return {"fp32": fp32, "tf32": tf32, "16-bit": half}


# Dense (no sparsity) peak TFLOP/s of one device, from NVIDIA's data sheets: IEEE fp32 on the
# CUDA cores (what --precision fp32 runs: precision.set_process_precision), TF32 and 16-bit on the
# tensor cores. Matched against torch.cuda.get_device_name() in this order, first match wins: GH200
# before H200 before H100, the PCIe and NVL parts before the SXM part they name.
PEAK_TFLOPS = (
    ("GH200", peaks(67.0, 494.5, 989.5)),
    ("H200 NVL", peaks(60.0, 417.5, 835.5)),
    ("H200", peaks(67.0, 494.5, 989.5)),
    ("H100 PCIe", peaks(51.0, 378.0, 756.5)),
    ("H100 NVL", peaks(60.0, 417.5, 835.5)),
    ("H100", peaks(67.0, 494.5, 989.5)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", peaks(19.5, 156.0, 312.0)),  # SXM and PCIe alike
)

UNKNOWN = "na"  # the field's value where no peak is known


def training_flops_per_image(
    model_name: str, num_classes: int, image_shape: tuple[int, int, int]
) -> int:
    """FLOPs of one training image: forward and backward through the model (the backward of
    each layer computes its weight gradient and, but for the first, its input gradient)."""
    batch = 2  # more than one image: BatchNorm's training forward needs it
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(model_name, num_classes, image_shape)
        images = torch.empty(batch, *image_shape)
        labels = torch.zeros(batch, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), labels).backward()
    return counter.get_total_flops() // batch


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak TFLOP/s at this precision, or None where the table has none
    (CPUs, GPUs not listed)."""
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device), precision)


def peak_for_name(name: str, precision: str) -> float | None:
    key = PEAK_KEYS.get(precision)
    return next((by.get(key) for part, by in PEAK_TFLOPS if part in name), None)


@dataclass(frozen=True)
class ModelFlops:
    """What a run needs to turn its images/s into tflops and mfu."""

    per_image: int  # training_flops_per_image
    devices: int  # the devices that computed those images (strategies.devices_per_rank)
    peak_tflops: float | None  # of one device (device_peak_tflops or --peak-tflops)

    def fields(self, images_per_second: float) -> dict:
        """The `[METRIC]` fields: tflops per device, and mfu in percent (UNKNOWN without a
        peak)."""
        tflops = self.per_image * images_per_second / self.devices / 1e12
        mfu = 100 * tflops / self.peak_tflops if self.peak_tflops else UNKNOWN
        return {"tflops": tflops, "mfu": mfu}


def implausible(fields: dict) -> str | None:
    """A warning where the MFU is over 100%: the peak is wrong for this device (--peak-tflops),
    or the time is."""
    mfu = fields.get("mfu")
    if isinstance(mfu, float) and mfu > 100:
        return (
            f"warning: epoch {fields['epoch']}: mfu={mfu:.0f}% is above the device's peak of "
            f"{fields['tflops'] / mfu * 100:.4g} TFLOP/s: the peak is wrong for this device "
            "(set --peak-tflops) or the epoch's time is"
        )
    return None
