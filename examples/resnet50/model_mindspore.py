"""ResNet-50 in ``mindspore.nn``: the MindSpore twin of ``model.py``.

The same architecture and options as the torch model (bottleneck "v1.5",
stages of [3, 4, 6, 3] blocks, BatchNorm after every convolution, the
``"imagenet"`` and ``"small"`` stems, ``zero_init_residual``), and the same
module layout, so parameter names line up with the torch ``state_dict``
except for MindSpore's BatchNorm names (``gamma``/``beta``/``moving_mean``/
``moving_variance`` for ``weight``/``bias``/``running_mean``/``running_var``;
there is no ``num_batches_tracked``).

Initial values come from numpy, not from MindSpore's initializers: every
parameter is drawn from its own ``numpy.random.Generator`` seeded by
``(seed, parameter name)``. Two processes given the same seed therefore build
bit-identical networks whatever MindSpore's RNG does, and the values do not
depend on the order in which parameters are created.

On CPU, MindSpore 2.10's oneDNN runs 3x3 convolutions in its plain NCHW
layout; on a CPU with AVX-512 it picks a reference kernel for them
(``jit_uni_ncsp:conv+ref``), about 30x slower per training step than with
``ONEDNN_MAX_CPU_ISA=AVX2`` in the environment before the first convolution
(which gives oneDNN's gemm kernels). Results are bit-reproducible under either
setting but differ between them: every process of a job, and every relaunch
whose state must match, needs the same setting.
"""

from __future__ import annotations

import zlib

import mindspore as ms
import mindspore.nn as nn
import mindspore.ops as ops
import numpy as np

__all__ = ["Bottleneck", "ResNet", "init_weights", "resnet50"]


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    # pad_mode="pad" pads 1 on every side, as torch does; MindSpore's default
    # "same" pads a strided convolution asymmetrically.
    return nn.Conv2d(cin, cout, 3, stride=stride, pad_mode="pad", padding=1, has_bias=False, weight_init="zeros")


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, pad_mode="valid", has_bias=False, weight_init="zeros")


class Bottleneck(nn.Cell):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand, plus the shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = conv1x1(cin, width), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = conv3x3(width, width, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = conv1x1(width, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.SequentialCell(conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Cell):
    """A bottleneck ResNet.

    Args:
        layers: blocks per stage ([3, 4, 6, 3] for ResNet-50).
        num_classes: outputs of the classifier.
        stem: ``"imagenet"`` or ``"small"`` (see ``model.py``).
        zero_init_residual: start every block's last BatchNorm at zero, so
            each block begins as the identity.
        seed: seeds the initial values (see :func:`init_weights`); ``None``
            takes MindSpore's global seed (``mindspore.set_seed``).

    Raises:
        ValueError: an unknown ``stem``, or no seed given and none set.
    """

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000, *, stem: str = "imagenet",
                 zero_init_residual: bool = False, seed: int | None = None) -> None:
        super().__init__()
        if seed is None:
            seed = ms.get_seed()
            if seed is None:
                raise ValueError("the initial weights need a seed: call mindspore.set_seed(seed) or pass seed=")
        if stem == "imagenet":
            self.stem = nn.SequentialCell(
                nn.Conv2d(3, 64, 7, stride=2, pad_mode="pad", padding=3, has_bias=False, weight_init="zeros"),
                nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="pad", padding=1))
        elif stem == "small":
            self.stem = nn.SequentialCell(conv3x3(3, 64), nn.BatchNorm2d(64), nn.ReLU())
        else:
            raise ValueError(f"stem must be 'imagenet' or 'small', got {stem!r}")
        cin, stages = 64, []
        for i, (width, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stride = 1 if i == 0 else 2
            stage = [Bottleneck(cin, width, stride)]
            cin = width * Bottleneck.expansion
            stage += [Bottleneck(cin, width) for _ in range(blocks - 1)]
            stages.append(nn.SequentialCell(stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Dense(cin, num_classes, weight_init="zeros", bias_init="zeros")
        init_weights(self, seed, zero_init_residual=zero_init_residual)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(ops.mean(x, (2, 3)))  # global average pooling


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed) & (2**63 - 1), zlib.crc32(name.encode())])


def init_weights(net: nn.Cell, seed: int, *, zero_init_residual: bool = False) -> None:
    """Set ``net``'s parameters to the initial values of ``model.py``'s scheme,
    drawn with numpy.

    Convolutions: He normal, fan-out (``kaiming_normal_(mode="fan_out")``).
    BatchNorm: gamma 1, beta 0, moving statistics 0 and 1 (gamma 0 on every
    block's ``bn3`` with ``zero_init_residual``). Dense: uniform in
    ``±1/sqrt(fan_in)`` for weight and bias, torch's ``nn.Linear`` default.
    Each parameter's values depend only on ``seed`` and its name in ``net``
    (``layer1.0.conv1.weight``), not on ``Parameter.name``, which a wrapping
    cell may prefix.
    """
    for prefix, cell in net.cells_and_names():
        if isinstance(cell, nn.Conv2d):
            w = cell.weight
            cout, _, kh, kw = w.shape
            std = np.sqrt(2.0 / (cout * kh * kw))
            w.set_data(ms.Tensor((_rng(seed, f"{prefix}.weight").standard_normal(w.shape) * std).astype(np.float32)))
        elif isinstance(cell, nn.BatchNorm2d):
            zero = zero_init_residual and prefix.endswith(".bn3")
            cell.gamma.set_data(ms.Tensor(np.full(cell.gamma.shape, 0.0 if zero else 1.0, np.float32)))
            cell.beta.set_data(ms.Tensor(np.zeros(cell.beta.shape, np.float32)))
            cell.moving_mean.set_data(ms.Tensor(np.zeros(cell.moving_mean.shape, np.float32)))
            cell.moving_variance.set_data(ms.Tensor(np.ones(cell.moving_variance.shape, np.float32)))
        elif isinstance(cell, nn.Dense):
            bound = 1.0 / np.sqrt(cell.in_channels)
            for attr in ("weight", "bias"):
                p = getattr(cell, attr)
                p.set_data(ms.Tensor(_rng(seed, f"{prefix}.{attr}").uniform(-bound, bound, p.shape).astype(np.float32)))


def resnet50(num_classes: int = 1000, *, stem: str = "imagenet", zero_init_residual: bool = False,
             seed: int | None = None) -> ResNet:
    """ResNet-50: [3, 4, 6, 3] bottleneck blocks, expansion 4 (see :class:`ResNet`)."""
    return ResNet((3, 4, 6, 3), num_classes, stem=stem, zero_init_residual=zero_init_residual, seed=seed)
