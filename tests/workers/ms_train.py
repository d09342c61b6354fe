"""A small MindSpore data-parallel job under trainguard's Guard, for the
fault tests (launched by msrun).

    ms_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

Batches are a function of (step, rank); each step also draws from Python's
and NumPy's global random streams (a script's own draws: the report holds
their hash, ``rng_sha256``). Rank 0 writes the Guard's report to
REPORT, every rank to REPORT.<rank>. ``TRAIN_SNAPSHOT_EVERY=N`` snapshots
every N steps, ``TRAIN_SNAPSHOT_SHARED=1`` one per machine for the replicas.
"""

import json
import random
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from mindspore.communication import get_rank, init

from trainguard.adapters.mindspore.state import streams_sha256
from trainguard.mindspore import Guard

steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
init()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
ms.set_seed(0)
rng = np.random.default_rng(0)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(16, 32, weight_init=Tensor(rng.standard_normal((32, 16), np.float32) * 0.2),
                            bias_init="zeros")
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Dense(32, 4, weight_init=Tensor(rng.standard_normal((4, 32), np.float32) * 0.2),
                            bias_init="zeros")

    def construct(self, x):
        return self.fc2(nn.ReLU()(self.bn(self.fc1(x))))


net = Net()
net.set_train(True)  # as Model.train does: BatchNorm moves each rank's own statistics
loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
guard = Guard(net, nn.Momentum(net.trainable_params(), 0.05, 0.9), checkpoint_dir=ckpt, save_every=save_every,
              snapshot_every=int(__import__("os").environ.get("TRAIN_SNAPSHOT_EVERY", "0")),
              snapshot_shared=__import__("os").environ.get("TRAIN_SNAPSHOT_SHARED") == "1")
grad_fn = ms.value_and_grad(nn.WithLossCell(net, loss_fn), None, guard.optimizer.parameters)
rank = get_rank()
bug = tuple(map(int, __import__("os").environ.get("MS_TRAIN_BUG", "-1,-1").split(",")))
for step in guard.steps(steps):
    with guard.protect():
        with guard.loading():
            data = np.random.default_rng(1000 * step + rank)
            x = Tensor(data.standard_normal((8, 16)).astype(np.float32))
            y = Tensor(data.integers(0, 4, 8).astype(np.int32))
            random.random(), np.random.random()  # the script's own draws (an augmentation, say)
        if (rank, step) == bug:  # MS_TRAIN_BUG=RANK,STEP: a bug in the script, on every launch
            raise ValueError(f"a bug in the script at step {step}")
        loss, grads = grad_fn(x, y)
        guard.optimizer(grads)
out = guard.report()
out["rng_sha256"] = streams_sha256()
guard.close()
with open(f"{report}.{rank}", "w") as f:
    json.dump(out, f)
if rank == 0:
    with open(report, "w") as f:
        json.dump(out, f)
print(f"rank {rank} done at step {out['steps_completed']}", flush=True)
if __import__("os").environ.get("MS_TRAIN_DUMP"):
    np.savez(f"{__import__('os').environ['MS_TRAIN_DUMP']}_{rank}.npz", **guard.state.arrays())
__import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
