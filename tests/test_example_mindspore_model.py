"""The MindSpore ResNet-50 of the example (``examples/resnet50/model_mindspore.py``
and ``data_mindspore.py``): seeded builds are bit-identical, a training step
runs, and repeating the same steps reaches bit-identical parameters."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
nn = ms.nn

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet50"

pytestmark = pytest.mark.timeout(120)


def _load(name: str):
    # By path, under a private name: examples/resnet50 stays off sys.path.
    spec = importlib.util.spec_from_file_location(f"_resnet50_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model_ms = _load("model_mindspore")
data_ms = _load("data_mindspore")


@pytest.fixture(scope="module", autouse=True)
def pynative_cpu():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def params(net) -> dict[str, np.ndarray]:
    return {name: p.asnumpy() for name, p in net.parameters_and_names()}


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    differ = [name for name in a if a[name].tobytes() != b[name].tobytes()]
    assert not differ, f"{len(differ)} parameters differ, e.g. {differ[:3]}"


def test_same_seed_builds_identical_parameters_with_unique_names():
    ms.set_seed(3)
    a = model_ms.resnet50(10, stem="small")
    b = model_ms.resnet50(10, stem="small")
    assert_bit_identical(params(a), params(b))
    assert_bit_identical(params(a), params(model_ms.resnet50(10, stem="small", seed=3)))

    names = [p.name for p in a.get_parameters()]
    assert len(names) == len(set(names)) == 267  # 53 convs, 53 BatchNorms x 4, fc weight and bias
    assert {"stem.0.weight", "layer1.0.downsample.1.gamma", "layer4.2.bn3.moving_variance", "fc.bias"} <= set(names)
    assert sum(p.size for p in a.trainable_params()) == 23_520_842  # as model.py's resnet50(10, stem="small")

    other = params(model_ms.resnet50(10, stem="small", seed=4))
    assert not np.array_equal(other["layer1.0.conv1.weight"], params(a)["layer1.0.conv1.weight"])


def test_options_zero_init_and_imagenet_stem():
    net = model_ms.resnet50(7, stem="imagenet", zero_init_residual=True, seed=0)
    p = params(net)
    assert not p["layer2.1.bn3.gamma"].any() and (p["layer2.1.bn2.gamma"] == 1).all()
    assert p["stem.0.weight"].shape == (64, 3, 7, 7)
    net.set_train(False)
    x, _ = data_ms.synthetic_batch(0, 0, 0, batch_size=2, image_size=32, num_classes=7)
    assert net(ms.Tensor(x)).shape == (2, 7)
    with pytest.raises(ValueError, match="stem"):
        model_ms.resnet50(10, stem="tiny", seed=0)


def test_synthetic_batch_is_a_function_of_its_arguments():
    x, y = data_ms.synthetic_batch(5, 2, 1, batch_size=4, image_size=8, num_classes=3)
    assert x.dtype == np.float32 and x.shape == (4, 3, 8, 8)
    assert y.dtype == np.int32 and y.shape == (4,) and ((0 <= y) & (y < 3)).all()
    x2, y2 = data_ms.SyntheticImages(5, num_classes=3, batch_size=4, image_size=8).batch(2, 1)
    assert x.tobytes() == x2.tobytes() and y.tobytes() == y2.tobytes()
    for step, rank in ((3, 1), (2, 0)):
        assert not np.array_equal(data_ms.synthetic_batch(5, step, rank, 4, 8, 3)[0], x)


def test_example_modules_import_no_torch():
    code = ("import sys; sys.modules['torch'] = None; "  # `import torch` now raises ImportError
            f"sys.path.insert(0, {str(EXAMPLE)!r}); import model_mindspore, data_mindspore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]


def train(steps: int, *, seed: int = 0, batch_size: int = 2, image_size: int = 16) -> tuple[list[float], dict]:
    """``steps`` steps of the example's loop (value_and_grad + Momentum) from a fresh seeded model."""
    ms.set_seed(seed)
    net = model_ms.resnet50(10, stem="small")
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = ms.value_and_grad(nn.WithLossCell(net, loss_fn), None, optimizer.parameters)
    net.set_train(True)
    losses = []
    for step in range(steps):
        x, y = data_ms.synthetic_batch(seed, step, 0, batch_size, image_size, 10)
        loss, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return losses, params(net)


def test_repeated_training_steps_are_bit_identical():
    ms.set_seed(0)
    initial = params(model_ms.resnet50(10, stem="small"))
    losses_a, a = train(2)
    losses_b, b = train(2)
    assert np.isfinite(losses_a).all() and losses_a == losses_b
    assert_bit_identical(a, b)
    for name in ("stem.0.weight", "fc.bias", "layer3.0.bn2.gamma", "layer3.0.bn2.moving_mean"):
        assert not np.array_equal(a[name], initial[name]), f"{name} did not change"
