"""The models, built from blocks that FSDP can shard one by one.

Nothing here knows about distribution: DDP and FSDP wrap these models unchanged. Each model
names its sharding units (`shard_units()`): the course CNN's conv blocks and classifier, a
ResNet's four residual stages; those large enough (`own_units`) become FSDP units of their own,
the root holds the rest. FSDP (fsdp_utils.py) gathers each unit's parameters just before it
runs and frees them right after. Each model also lists its forward as named pieces
(`forward_pieces()`), so that `cut` can split it at those units into consecutive parts: a
pipeline's stages (pipeline_utils.py) or the devices of naive model parallelism.
"""

from collections import OrderedDict

import torch
import torch.nn as nn

from utils import FSDP_ROOT_UNIT, require_torchvision

IMAGE_SHAPE = (3, 32, 32)  # CIFAR-10's, the course CNN's default
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
    """conv 3->16->32->64 with pooling (32x32 -> 4x4), then fc 1024->512->10; for other image
    sizes (divisible by 8) the classifier takes what the convolutions leave: 64x64 -> 8x8,
    fc 4096->512."""

    def __init__(
        self,
        width: int = 16,
        num_classes: int = NUM_CLASSES,
        image_shape: tuple[int, int, int] = IMAGE_SHAPE,
    ):
        super().__init__()
        h, w = image_shape[1:]
        if h % 8 or w % 8:
            raise ValueError(f"the CNN halves the image three times: {h}x{w} is not divisible by 8")
        c1, c2, c3 = width, 2 * width, 4 * width
        self.conv1 = ConvBlock(image_shape[0], c1)
        self.conv2 = ConvBlock(c1, c2)
        self.conv3 = ConvBlock(c2, c3)
        self.classifier = Classifier(c3 * (h // 8) * (w // 8), 512, num_classes)
        self.channels = (c1, c2, c3)
        self.num_classes = num_classes
        self.image_shape = tuple(image_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        c1, c2, c3 = self.channels
        h, w = self.image_shape[1:]
        assert x.shape[1:] == self.image_shape, (
            f"expected (N, {', '.join(map(str, self.image_shape))}) input, got {tuple(x.shape)}"
        )
        x = self.conv1(x)
        assert x.shape == (n, c1, h // 2, w // 2), x.shape
        x = self.conv2(x)
        assert x.shape == (n, c2, h // 4, w // 4), x.shape
        x = self.conv3(x)
        assert x.shape == (n, c3, h // 8, w // 8), x.shape
        x = self.classifier(x)
        assert x.shape == (n, self.num_classes), x.shape
        return x

    def shard_units(self) -> list[nn.Module]:
        return [self.conv1, self.conv2, self.conv3, self.classifier]

    def forward_pieces(self) -> list[tuple[str, nn.Module]]:
        return [(name, getattr(self, name)) for name in ("conv1", "conv2", "conv3", "classifier")]


def small_image_resnet(depth: int, num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 or -50 for 32x32 and 64x64 images: a 3x3 stride-1 stem and no
    max-pool (the ImageNet stem, 7x7 stride 2 and a pool, would shrink a 32x32 image to 8x8
    before the first residual stage), as is usual for CIFAR. torchvision is imported here, not
    above: it takes about a second, which every rank of every other model would pay."""
    require_torchvision(f"--model resnet{depth}")
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    class SmallImageResNet(ResNet):
        def __init__(self):
            block, layers = {18: (BasicBlock, [2, 2, 2, 2]), 50: (Bottleneck, [3, 4, 6, 3])}[depth]
            super().__init__(block, layers, num_classes=num_classes)
            self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()

        def shard_units(self) -> list[nn.Module]:
            return [self.layer1, self.layer2, self.layer3, self.layer4]

        def forward_pieces(self) -> list[tuple[str, nn.Module]]:
            names = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
            head = [("avgpool", self.avgpool), ("flatten", nn.Flatten(1)), ("fc", self.fc)]
            return [*((name, getattr(self, name)) for name in names), *head]

    return SmallImageResNet()


# Model choices by name (config.MODELS), each given the data set's number of classes and image
# shape (the ResNets pool adaptively: any size). cnn-wide keeps the architecture and quadruples
# the channels: a heavier compute load for scaling studies.
MODELS = {
    "cnn": lambda classes, shape: CNN(width=16, num_classes=classes, image_shape=shape),
    "cnn-wide": lambda classes, shape: CNN(width=64, num_classes=classes, image_shape=shape),
    "resnet18": lambda classes, shape: small_image_resnet(18, classes),
    "resnet50": lambda classes, shape: small_image_resnet(50, classes),
}


def build_model(
    name: str, num_classes: int = NUM_CLASSES, image_shape: tuple[int, int, int] = IMAGE_SHAPE
) -> nn.Module:
    return MODELS[name](num_classes, tuple(image_shape))


# The fewest parameters a shard unit needs for an FSDP unit of its own (as torch's
# size_based_auto_wrap_policy's min_num_params, 1e8 by default, sized for this project's models):
# 400 KB in fp32, a few microseconds on NVLink, less than the fixed cost of gathering it. Here,
# not in fsdp_utils.py: cost_model.py (and `main.py --check`) ask without loading FSDP.
MIN_UNIT_PARAMS = 100_000


def own_units(model: nn.Module) -> list[nn.Module]:
    """The shard units that become FSDP units of their own (fsdp_utils.py); the root holds the
    others."""
    return [unit for unit in model.shard_units() if count_parameters(unit) >= MIN_UNIT_PARAMS]


def unit_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The parameters of each FSDP unit by name: each of own_units (the model's children), then
    the root (utils.FSDP_ROOT_UNIT), which holds the rest, where there are any."""
    units = own_units(model)
    named = {name: list(m.parameters()) for name, m in model.named_children() if m in units}
    inside = {id(p) for params in named.values() for p in params}
    root = [p for p in model.parameters() if id(p) not in inside]
    return {**named, **({FSDP_ROOT_UNIT: root} if root else {})}


class Part(nn.Sequential):
    """Consecutive pieces of a model's forward, each under its name in the model: a part's
    state-dict keys are the whole model's, so that the parts' state dicts together are the
    model's."""

    def __init__(self, pieces: list[tuple[str, nn.Module]]):
        super().__init__(OrderedDict(pieces))


def cut(model: nn.Module, parts: int) -> list[Part]:
    """The model's forward cut into `parts` consecutive parts at its units (`shard_units()`),
    the same number of units each (parts must divide them); what comes before the first unit
    (a ResNet's stem) goes with it, what comes after the last (the head) with the last."""
    pieces, units = model.forward_pieces(), model.shard_units()
    if len(units) % parts:
        raise ValueError(f"{len(units)} units do not cut into {parts} equal parts")
    starts = [i for i, (_, piece) in enumerate(pieces) if any(piece is u for u in units)]
    per_part = len(units) // parts
    bounds = [0, *(starts[k * per_part] for k in range(1, parts)), len(pieces)]
    return [Part(pieces[a:b]) for a, b in zip(bounds, bounds[1:])]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
