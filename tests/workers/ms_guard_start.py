"""Build a MindSpore Guard in one process (PyNative, no launcher) and say
whether its start-up checks let it: ``TRAINGUARD_FAULT`` comes from the
environment.

    ms_guard_start.py CHECKPOINT_DIR

Prints ``ConfigError: ...`` and exits 3 when refused, ``started`` otherwise.
"""

import sys

import mindspore as ms
from mindspore import nn

from trainguard.core import ConfigError
from trainguard.mindspore import Guard

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
net = nn.Dense(4, 2)
try:
    guard = Guard(net, nn.Momentum(net.trainable_params(), 0.05, 0.9), checkpoint_dir=sys.argv[1])
except ConfigError as e:
    print(f"ConfigError: {e}", flush=True)
    sys.exit(3)
guard.close()
print("started", flush=True)
