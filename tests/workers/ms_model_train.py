"""A small MindSpore data-parallel job trained with ``Model.train`` and
trainguard's ``TrainFaultTolerance`` callback, for the fault tests.

    ms_model_train.py EPOCHS REPORT CHECKPOINT_DIR [CHECK]

Each rank's data is its own (seeded by rank), shuffled with a fixed seed,
two batches an epoch, so a resumed run must skip to the right epoch, the
right batch and that epoch's shuffle order. Rank 0 writes the Guard's report.
``TEST_MS_MODE=graph`` in the environment trains in graph mode (default
PyNative, with an ``ops.dropout`` drawing from the op seeds). ``TEST_SAVE_FN``
saves the dying gasp with a ``ckpt_save_fn`` (``TEST_SAVE_PATH``: with
``ckpt_save_path`` too), and a relaunch resumes from it with ``ckpt_load_fn``
(``TEST_LOAD_FN``) or ``TEST_RESUME`` and ``TEST_INITIAL_STEP``.
CHECK (``sink``, ``unwrapped``, ``graph-backward``: a backward fault to inject
in graph mode) runs one refused configuration in a single process and prints
the error.
"""

import json
import os
import sys
from pathlib import Path

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.train import Model

from trainguard.core import ConfigError
from trainguard.mindspore import OptTFTWrapper, TrainFaultTolerance

epochs, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
check = sys.argv[4] if len(sys.argv) > 4 else ""
graph = os.environ.get("TEST_MS_MODE") == "graph" or check == "graph-backward"
if check == "graph-backward":
    os.environ["TRAINGUARD_FAULT"] = "uce:rank=0,step=1,phase=backward"
ms.set_context(mode=ms.GRAPH_MODE if graph else ms.PYNATIVE_MODE)
ms.set_device("CPU")
rank = 0
if not check:
    from mindspore.communication import get_rank, init

    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    rank = get_rank()
ms.set_seed(0)
ds.config.set_seed(0)
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
        hidden = nn.ReLU()(self.bn(self.fc1(x)))
        if not graph:  # draws from MindSpore's op seeds, which a retry and a dump carry (graph mode fixes them)
            hidden = ops.dropout(hidden, p=0.2, training=self.training)
        return self.fc2(hidden)


data = np.random.default_rng(100 + rank)
x = data.standard_normal((16, 16)).astype(np.float32)
y = data.integers(0, 4, 16).astype(np.int32)
dataset = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=True).batch(8)  # 2 batches an epoch

net = Net()
momentum = nn.Momentum(net.trainable_params(), 0.05, 0.9)
model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
              optimizer=momentum if check == "unwrapped" else OptTFTWrapper(momentum))
initial_step = 0
if os.environ.get("TEST_SAVE_FN"):
    # MindSpore's custom dying-gasp writer (its step_num appended, as MindSpore's own dying gasp does), and a
    # user's own resume from its file: by ckpt_load_fn (TEST_LOAD_FN), or loaded here with initial_step.
    def save(cb_params, append_dict):
        name = f"{ckpt}/user/rank_{rank}-step_{cb_params.cur_step_num}"
        os.makedirs(os.path.dirname(name), exist_ok=True)
        ms.save_checkpoint(cb_params.train_network, name + ".ckpt",
                           append_dict={**append_dict, "step_num": cb_params.cur_step_num})
        with open(name + ".json", "w") as f:
            json.dump({"cur_step_num": cb_params.cur_step_num, "cur_epoch_num": cb_params.cur_epoch_num,
                       "append_dict": append_dict}, f)

    def load():
        saved = sorted(Path(ckpt, "user").glob("rank_*.ckpt"))
        return (ms.load_checkpoint(str(saved[-1])) if saved else {}), False

    resume = os.environ.get("TEST_RESUME")
    if resume:
        saved = ms.load_checkpoint(resume)
        ms.load_param_into_net(net, saved)
        ms.load_param_into_net(momentum, saved)
        initial_step = int(os.environ["TEST_INITIAL_STEP"])
    callback = TrainFaultTolerance(ckpt if os.environ.get("TEST_SAVE_PATH") else None, ckpt_save_fn=save,
                                   **({"ckpt_load_fn": load} if os.environ.get("TEST_LOAD_FN") else
                                      {"initial_step": initial_step}))
else:
    callback = TrainFaultTolerance(ckpt)
try:
    model.train(epochs, dataset, callbacks=[callback], dataset_sink_mode=check == "sink",
                sink_size=2 if check == "sink" else -1, initial_epoch=initial_step // 2)
except ConfigError as e:
    print(f"ConfigError: {e}", flush=True)
    sys.exit(3)
out = callback.guard.report()
if rank == 0:
    with open(report, "w") as f:
        json.dump(out, f)
print(f"rank {rank} done at step {out['steps_completed']}", flush=True)
__import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
