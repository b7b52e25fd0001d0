"""The model's cost, predicted from its parameter shapes alone (no weights, no data): the FLOPs
of a training image against a device's peak (the `[METRIC]` line's tflops and mfu), and the
bytes of state one rank keeps between steps (state_pred).

FLOPs: a step's useful arithmetic is the model's convolutions and matrix products, forward and
backward, which torch's FlopCounterMode counts once per image on the meta device. tflops is that
times the images a second per device; mfu, in percent, is tflops against the device's dense peak
at the run's precision (PEAK_TFLOPS, or --peak-tflops; `na` where none is known). What the
framework adds (augmentation, element-wise layers, the optimizer, communication) is the overhead
MFU measures.

State: the ZeRO paper's count (Rajbhandari et al. 2020: 16 bytes a parameter with Adam, 16/N
sharded over N ranks) made exact for this project's wrappers: parameters, gradients and the
optimizer's state, in the storage dtype, of what each rank keeps of each parameter (`held`:
whole, its stage's, FSDP2's rows or FSDP1's overlap with its flat chunk). It equals what
measure.state_bytes measures after a step, to the byte (tests/test_memory_model.py); what it
leaves out, as state_bytes does (padding, buffers, what is transient): docs/metrics.md.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import FLAT_SHARDS, SHARDED, STAGED, Config
from model import build_model, cut, unit_parameters
from precision import DTYPES, PEAK_KEYS, storage_dtype
from utils import MB

# ----------------------------------------------------------------------------- FLOPs


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
    # Imported here: about 0.15 s that `main.py --check`, which asks this module for the state
    # alone, need not pay.
    from torch.utils.flop_counter import FlopCounterMode

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


# ----------------------------------------------------------------------------- state

# Where FSDP1 starts each parameter in its flat buffer: a multiple of 16 bytes of the unit's
# compute dtype (torch's _flat_param._get_aligned_numel, with use_orig_params).
FSDP1_ALIGNMENT = 16

# Per --optimizer: its tensors of a parameter's size (Adam's exp_avg and exp_avg_sq, SGD's
# momentum_buffer), and its bytes of scalars a parameter (Adam's step count: a float32 scalar
# in fused Adam, optim.make_optimizer, whatever the parameters' dtype).
OPTIMIZER_STATE = {"adam": (2, 4), "sgd": (1, 0)}


@dataclass(frozen=True)
class RankState:
    """Bytes one rank keeps between steps."""

    parameters: int
    gradients: int
    optimizer: int
    on_host: bool = False  # --cpu-offload: all of it in host memory, none on the GPU

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def on_device(self) -> int:
        return 0 if self.on_host else self.total


def shard_ranks(sharding: str, world_size: int, nodes: int) -> int:
    """The ranks an FSDP shard is cut over: every rank, or a node's (hybrid, nodes of equal
    ranks, as fsdp_utils.hybrid_mesh demands)."""
    if sharding != "hybrid":
        return world_size
    if world_size % nodes:
        raise ValueError(f"hybrid sharding: {world_size} ranks do not split over {nodes} nodes")
    return world_size // nodes


def fsdp2_held(shape: tuple[int, ...], ranks: int, index: int) -> int:
    """The elements of a parameter of this shape in chunk `index` of `ranks` (fully_shard)."""
    chunk = -(-shape[0] // ranks)
    rows = max(0, min(chunk, shape[0] - index * chunk))
    return rows * math.prod(shape[1:])


def fsdp1_held(numels: list[int], align: int, ranks: int, index: int) -> list[int | None]:
    """The elements of each parameter of one FSDP1 unit (their numels, in its order) in chunk
    `index` of `ranks` of its flat parameter, each starting at a multiple of `align` elements."""
    spans, end = [], 0
    for numel in numels:
        end += -end % align
        spans.append((end, end + numel))
        end += numel
    chunk = -(-end // ranks)  # the flat parameter padded to a multiple of ranks
    low, high = index * chunk, (index + 1) * chunk
    overlaps = [min(stop, high) - max(start, low) for start, stop in spans]
    return [n if n > 0 else None for n in overlaps]


def held(cfg: Config, model: nn.Module, world_size: int, nodes: int, rank: int) -> list[int | None]:
    """What rank `rank` keeps of each parameter: its elements, or None for no part of it."""
    if cfg.strategy in STAGED:
        return [p.numel() for p in cut(model, world_size)[rank].parameters()]
    if cfg.strategy not in SHARDED:
        return [p.numel() for p in model.parameters()]
    ranks = shard_ranks(cfg.sharding, world_size, nodes)
    index = rank % ranks  # ranks laid out in blocks, a node's consecutive
    if cfg.strategy not in FLAT_SHARDS:  # fully_shard: each parameter on its first dimension
        return [fsdp2_held(tuple(p.shape), ranks, index) for p in model.parameters()]
    align = FSDP1_ALIGNMENT // DTYPES[cfg.precision].itemsize
    return [
        n
        for unit in unit_parameters(model).values()  # FSDP1 flattens each in module order
        for n in fsdp1_held([p.numel() for p in unit], align, ranks, index)
    ]


def offloaded(cfg: Config) -> bool:
    """Whether the state lives in host memory: FSDP's --cpu-offload (its shards, their gradients,
    and so the optimizer's state made like them)."""
    return cfg.cpu_offload and cfg.strategy in SHARDED


def rank_state(
    cfg: Config, model: nn.Module, world_size: int, nodes: int = 1, rank: int = 0
) -> RankState:
    """The bytes rank `rank` of `world_size` (over `nodes`) keeps between steps of `model` (its
    parameters' shapes alone are read: a model on the meta device will do)."""
    kept = [n for n in held(cfg, model, world_size, nodes, rank) if n is not None]
    elements, size = sum(kept), storage_dtype(cfg.precision).itemsize
    tensors, scalar_bytes = OPTIMIZER_STATE[cfg.optimizer]
    return RankState(
        parameters=elements * size,
        gradients=elements * size,
        optimizer=tensors * elements * size + scalar_bytes * len(kept),
        on_host=offloaded(cfg),
    )


def state_mem(cfg: Config, model: nn.Module, world_size: int, nodes: int = 1) -> int:
    """The [METRIC] line's state_mem, predicted: the most any rank keeps."""
    return max(rank_state(cfg, model, world_size, nodes, r).total for r in range(world_size))


def describe(cfg: Config, model: nn.Module, world_sizes: list[int], nodes: int) -> str:
    """`main.py --check`'s word on the state a rank will keep at each world size."""
    said = []
    for size in world_sizes:
        try:
            said.append(f"{state_mem(cfg, model, size, nodes) / MB:.1f} MB at {size}")
        except ValueError:  # hybrid sharding of a world that does not split over the nodes
            said.append(f"n/a at {size}")
    where = ", ".join(said) + (" in host memory" if offloaded(cfg) else "")
    return f"state per rank (parameters, gradients, optimizer state), predicted: {where}"


def bytes_per_parameter(optimizer: str, precision: str) -> int:
    """What a replicated rank keeps of each parameter element: the element, its gradient and the
    optimizer's tensors of its size, in the storage dtype (the ZeRO paper's 16 with Adam in
    fp32; the optimizer's scalars, bytes a tensor rather than an element, left out)."""
    tensors, _ = OPTIMIZER_STATE[optimizer]
    return (2 + tensors) * storage_dtype(precision).itemsize
