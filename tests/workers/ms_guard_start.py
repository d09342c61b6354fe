"""Build a MindSpore Guard in one process (PyNative, no launcher) and say
whether its start-up checks let it: ``TRAINGUARD_FAULT`` comes from the
environment.

    ms_guard_start.py CHECKPOINT_DIR [dropout]

``dropout`` puts an ``nn.Dropout`` after the layer. Prints ``ConfigError:
...`` and exits 3 when refused, else ``started`` and the report's
``kernel_random_ops``.
"""

import sys

import mindspore as ms
from mindspore import nn

from trainguard.core import ConfigError
from trainguard.mindspore import Guard

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
net = nn.SequentialCell([nn.Dense(4, 2), nn.Dropout(p=0.2)]) if sys.argv[2:] == ["dropout"] else nn.Dense(4, 2)
try:
    guard = Guard(net, nn.Momentum(net.trainable_params(), 0.05, 0.9), checkpoint_dir=sys.argv[1])
except ConfigError as e:
    print(f"ConfigError: {e}", flush=True)
    sys.exit(3)
kernel_random_ops = guard.report()["kernel_random_ops"]
guard.close()
print("started", kernel_random_ops, flush=True)
