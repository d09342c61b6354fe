"""ResNet-50, defined here so the example needs nothing beyond torch.

The standard bottleneck architecture (He et al., 2016, "v1.5": the stride of
a downsampling block sits on its 3x3 convolution): stages of [3, 4, 6, 3]
bottleneck blocks with widths 64/128/256/512 and expansion 4, BatchNorm after
every convolution, global average pooling and one linear classifier.

Two stems:

* ``"imagenet"``: 7x7 convolution with stride 2 and a 3x3 max-pool
  (224x224 inputs become 56x56 feature maps);
* ``"small"``: one 3x3 convolution with stride 1 and no max-pool, for small
  images (32x32, 64x64) that the ImageNet stem would shrink to almost
  nothing. Depth and width stay those of ResNet-50: ~23.5M parameters with
  10 classes, ~25.6M with 1000.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["Bottleneck", "ResNet", "resnet50"]


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand, plus the shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = conv1x1(cin, width), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = conv3x3(width, width, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = conv1x1(width, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A bottleneck ResNet.

    Args:
        layers: blocks per stage ([3, 4, 6, 3] for ResNet-50).
        num_classes: outputs of the classifier.
        stem: ``"imagenet"`` or ``"small"`` (see the module docstring).
        zero_init_residual: start every block's last BatchNorm at zero, so
            each block begins as the identity (helps large-batch training).
    """

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000, *, stem: str = "imagenet",
                 zero_init_residual: bool = False) -> None:
        super().__init__()
        if stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        elif stem == "small":
            self.stem = nn.Sequential(conv3x3(3, 64), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        else:
            raise ValueError(f"stem must be 'imagenet' or 'small', got {stem!r}")
        cin, stages = 64, []
        for i, (width, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stride = 1 if i == 0 else 2
            stage = [Bottleneck(cin, width, stride)]
            cin = width * Bottleneck.expansion
            stage += [Bottleneck(cin, width) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # mean over the image, not AdaptiveAvgPool2d: its CUDA backward has no deterministic kernel
        return self.fc(x.mean(dim=(2, 3)))


def resnet50(num_classes: int = 1000, *, stem: str = "imagenet", zero_init_residual: bool = False) -> ResNet:
    """ResNet-50: [3, 4, 6, 3] bottleneck blocks, expansion 4."""
    return ResNet((3, 4, 6, 3), num_classes, stem=stem, zero_init_residual=zero_init_residual)
