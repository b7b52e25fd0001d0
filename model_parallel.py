"""Naive model parallelism (--strategy model): one process places consecutive parts of the
model on consecutive GPUs and moves the activations from one to the next. No micro-batches:
while one GPU computes, the others wait, so it is slower than one GPU for a model that fits on
one; it is the baseline that the pipeline (pipeline_utils.py) improves on, and the way to run a
model too large for one GPU's memory.
"""

import torch
import torch.nn as nn

from model import cut
from utils import log0


def usable_devices(units: int, device: torch.device) -> list[torch.device]:
    """The visible GPUs a model's units cut into equal parts over, the most there can be
    (4 units: 4 GPUs of 8, 2 of 3); on a CPU, the one device."""
    if device.type != "cuda":
        return [device]
    visible = torch.cuda.device_count()
    count = max(n for n in range(1, min(units, visible) + 1) if units % n == 0)
    return [torch.device("cuda", i) for i in range(count)]


class ModelParallel(nn.Module):
    """The model's parts, each on its device, run one after the other. The pieces keep their
    names in the model, so its state dict is the model's, device aside."""

    def __init__(self, model: nn.Module, devices: list[torch.device]):
        super().__init__()
        self.devices = devices
        self.parts = [part.to(d) for part, d in zip(cut(model, len(devices)), devices)]
        for part in self.parts:
            for name, piece in part.named_children():
                self.add_module(name, piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each part where its parameters are, the output back where the input came from, to
        meet its labels."""
        source = x.device
        for part, device in zip(self.parts, self.devices):
            x = part(x.to(device))
        return x.to(source)


def get_model_parallel(model: nn.Module, device: torch.device) -> ModelParallel:
    devices = usable_devices(len(model.shard_units()), device)
    if len(devices) == 1:
        log0(f"model: one device here ({device}): the model runs whole on it")
    else:
        log0(f"model: its parts on {', '.join(map(str, devices))}")
    return ModelParallel(model, devices)
