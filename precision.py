"""What numbers a step computes with, for each `--precision`: the dtypes, autocast and FSDP's
mixed precision, the loss scaler, what fp32 means on a GPU, the device peak a precision runs at,
and deterministic kernels. It asks only torch (and config.py for the strategies' traits).

Mixed precision computes in bf16 or fp16 from fp32 parameters and reduces gradients in fp32:
autocast for an unsharded model (DDP, DP, single), FSDP's own policy for a sharded one
(fsdp_utils). fp16 adds a gradient scaler; bf16 needs none. fp64 stores and computes everything
in float64 (verify.py's equivalence check).
"""

import contextlib
import os
from dataclasses import dataclass

import torch

from config import FLAT_SHARDS, SHARDED

# The compute dtype of each --precision (tf32 is fp32 storage with TF32 matrix math on GPUs), what
# FSDP gathers and aligns its flat parameters in.
DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}

# Mixed precision: those that compute in a 16-bit dtype from fp32 parameters. Of them, those
# whose step scales its loss: fp16's narrow exponent range lets small gradients underflow; bf16
# has fp32's.
MIXED = tuple(name for name, dtype in DTYPES.items() if dtype.itemsize < 4)
LOSS_SCALED = ("fp16",)

# The arithmetic each --precision runs on, which sets a device's peak (cost_model.PEAK_TFLOPS):
# IEEE fp32 on the CUDA cores (set_process_precision), TF32 and 16-bit on the tensor cores, bf16
# and fp16 at the same rate. fp64 has none in the table.
PEAK_KEYS = {"fp32": "fp32", "tf32": "tf32", "bf16": "16-bit", "fp16": "16-bit"}


def low_precision(precision: str) -> torch.dtype | None:
    """The 16-bit dtype a step computes in (autocast, FSDP's mixed precision), or None."""
    return DTYPES[precision] if precision in MIXED else None


def storage_dtype(precision: str) -> torch.dtype:
    """What parameters, gradients, batches and sums are held in: float64 for fp64; float32
    otherwise (bf16 and fp16 compute in theirs from fp32 parameters)."""
    return max(DTYPES[precision], torch.float32, key=lambda dtype: dtype.itemsize)


def wire_dtypes(precision: str, strategy: str) -> tuple[torch.dtype, torch.dtype]:
    """What this strategy's collectives carry at this --precision: (the parameters FSDP
    gathers, the gradients every strategy reduces). FSDP gathers in its compute dtype where it
    has one (fsdp_utils: param_dtype). Gradients are reduced in the storage dtype: DDP's buckets
    hold the parameters' own gradients (under autocast too), FSDP's reduce_dtype is fp32 under
    bf16 and fp16 and the parameters' dtype otherwise; so 8 bytes a parameter in fp64."""
    stored = storage_dtype(precision)
    return (DTYPES[precision] if strategy in SHARDED else stored), stored


def loss_input(logits: torch.Tensor) -> torch.Tensor:
    """Logits computed in bf16 or fp16, in fp32 for the loss; fp32's and fp64's as they are."""
    return logits.float() if logits.dtype.itemsize < 4 else logits


@dataclass
class Precision:
    """How a step runs in low precision: autocast (DDP), and a loss scaler enabled for fp16."""

    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler
    cache: bool = True  # autocast's cache of cast weights (off in a CUDA graph)

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype, cache_enabled=self.cache)


def make_precision(
    precision: str, device: torch.device, cuda_graphs: bool = False, strategy: str | None = None
) -> Precision:
    """How a step of this strategy (None: one process, the whole model) runs at this
    --precision: a sharded model casts through its wrapper's policy (fsdp_utils); every other
    needs autocast, without its cache of cast weights in a CUDA graph (torch's notes: the cache
    would hold tensors of the capture)."""
    scaled = precision in LOSS_SCALED
    if strategy in FLAT_SHARDS:
        # Imported here: FSDP's modules take seconds to import, which `main.py --check` never
        # needs.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type, enabled=scaled)
    else:
        scaler = torch.amp.GradScaler(device.type, enabled=scaled)
    autocast = None if strategy in SHARDED else low_precision(precision)
    return Precision(autocast, scaler, cache=not cuda_graphs)


def set_process_precision(precision: str) -> str:
    """This process computes at --precision from here on: every tensor made without a dtype in
    the storage dtype, and fp32 math as asked: IEEE fp32 for fp32 (cuDNN's default is TF32
    convolutions), TF32 for tf32 in convolutions and matrix products alike (no effect on a
    CPU). Returns what fp32 operations run as."""
    torch.set_default_dtype(storage_dtype(precision))
    math = "tf32" if precision == "tf32" else "ieee"
    # The legacy switches first, to the same answer: code that still reads them (torch.compile's
    # in some versions) raises where only the per-operation settings below were made.
    torch.set_float32_matmul_precision("high" if math == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = math == "tf32"
    torch.backends.cuda.matmul.fp32_precision = math
    torch.backends.cudnn.conv.fp32_precision = math
    torch.backends.cudnn.rnn.fp32_precision = math
    return math


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels only (an error names any op that has none); cuBLAS needs its
    workspace fixed before CUDA starts for that."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # cuDNN tries its algorithms on the first batch of each shape and keeps the fastest: the
    # fastest may not be deterministic.
    torch.backends.cudnn.benchmark = not enabled
    torch.use_deterministic_algorithms(enabled)
