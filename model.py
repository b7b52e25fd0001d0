"""The course CNN for 32x32 RGB images, built from blocks that FSDP can shard one by one.

Nothing here knows about distribution: DDP and FSDP wrap this model unchanged. The blocks
(`ConvBlock`, `Classifier`) are the units of FSDP's wrap policy (see fsdp_utils.py): each one's
parameters are gathered just before it runs and freed right after.
"""

import torch
import torch.nn as nn

IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10


class ConvBlock(nn.Sequential):
    """3x3 convolution, ReLU, 2x2 max pooling: halves the resolution."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )


class Classifier(nn.Sequential):
    def __init__(self, in_features: int, hidden: int, num_classes: int):
        super().__init__(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )


class CNN(nn.Module):
    """conv 3->16->32->64 with pooling (32x32 -> 4x4), then fc 1024->512->10."""

    def __init__(self, width: int = 16, num_classes: int = NUM_CLASSES):
        super().__init__()
        c1, c2, c3 = width, 2 * width, 4 * width
        self.conv1 = ConvBlock(IMAGE_SHAPE[0], c1)
        self.conv2 = ConvBlock(c1, c2)
        self.conv3 = ConvBlock(c2, c3)
        self.classifier = Classifier(c3 * 4 * 4, 512, num_classes)
        self.channels = (c1, c2, c3)
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        c1, c2, c3 = self.channels
        assert x.shape[1:] == IMAGE_SHAPE, f"expected (N, 3, 32, 32) input, got {tuple(x.shape)}"
        x = self.conv1(x)
        assert x.shape == (n, c1, 16, 16), x.shape
        x = self.conv2(x)
        assert x.shape == (n, c2, 8, 8), x.shape
        x = self.conv3(x)
        assert x.shape == (n, c3, 4, 4), x.shape
        x = self.classifier(x)
        assert x.shape == (n, self.num_classes), x.shape
        return x


# Model choices by name, as `--model` offers them. `cnn-wide` keeps the architecture and
# quadruples the channels: a heavier compute load for scaling studies.
MODELS = {
    "cnn": lambda: CNN(width=16),
    "cnn-wide": lambda: CNN(width=64),
}

# The blocks FSDP wraps as units (fsdp_utils.py reads this).
SHARDABLE_BLOCKS = {ConvBlock, Classifier}


def build_model(name: str) -> nn.Module:
    return MODELS[name]()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
