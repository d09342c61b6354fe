"""Build a MindSpore Guard in one process (PyNative, no launcher) and say
whether its start-up checks let it: ``TRAINGUARD_FAULT`` comes from the
environment.

    ms_guard_start.py CHECKPOINT_DIR [random]

``random`` puts every kind of dropout after the layer, held by a cell or
called in ``construct``. Prints ``ConfigError:
...`` and exits 3 when refused, else ``started`` and the report's
``kernel_random_ops``.
"""

import sys

import mindspore as ms
from mindspore import nn, ops

from trainguard.core import ConfigError
from trainguard.mindspore import Guard

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")


class Functional(nn.Cell):
    def construct(self, x):
        return ops.dropout(ops.dropout2d(x, 0.2), p=0.2)  # draws from the op seeds (kept), and from a kernel


if sys.argv[2:] == ["random"]:  # every kind of dropout, held and functional
    net = nn.SequentialCell([nn.Dense(4, 2), nn.Dropout(p=0.2), nn.Dropout1d(0.2), nn.Dropout2d(0.2), nn.Dropout3d(0.2),
                             Functional()])
else:
    net = nn.Dense(4, 2)
try:
    guard = Guard(net, nn.Momentum(net.trainable_params(), 0.05, 0.9), checkpoint_dir=sys.argv[1])
except ConfigError as e:
    print(f"ConfigError: {e}", flush=True)
    sys.exit(3)
kernel_random_ops = guard.report()["kernel_random_ops"]
guard.close()
print("started", kernel_random_ops, flush=True)
