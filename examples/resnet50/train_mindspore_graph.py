"""The ResNet-50 example's MindSpore model and data in graph mode:
``Model.train`` under trainguard's ``TrainFaultTolerance`` (the Guard's
graph-mode path), 2 msrun workers. ``bench/compile_cache.py`` measures its
warm relaunch (MindSpore's compile cache, set up by the Guard)::

    trainguard run --framework mindspore --worker_num=2 --local_worker_num=2 --master_port=8118 \
        --join=True --log_dir=logs examples/resnet50/train_mindspore_graph.py STEPS REPORT CHECKPOINT_DIR

Rank 0 writes REPORT: the Guard's report plus ``first_step_s``, the time
from this script's start to the first step completed in this launch. A
relaunch resumes from the newest checkpoint in CHECKPOINT_DIR.
"""

import time

STARTED = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")  # as the example: oneDNN's fast 3x3 convolutions here

import mindspore as ms  # noqa: E402
import mindspore.dataset as ds  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.communication import get_rank, init  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

from trainguard.mindspore import OptTFTWrapper, TrainFaultTolerance  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_mindspore.py, data_mindspore.py
from data_mindspore import synthetic_batch  # noqa: E402
from model_mindspore import resnet50  # noqa: E402

BATCH, IMAGE, CLASSES, SEED = 4, 16, 10, 0


PHASES: dict = {}  # seconds from the script's start to the end of each phase of the start-up


def mark(phase: str) -> None:
    PHASES.setdefault(phase, round(time.perf_counter() - STARTED, 3))


class FirstStep(Callback):
    def __init__(self) -> None:
        self.first_step_s = None

    def on_train_step_begin(self, run_context) -> None:
        mark("first_step_begins")

    def on_train_step_end(self, run_context) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - STARTED


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    mark("imports")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    rank = get_rank()
    mark("communication_init")
    ms.set_seed(SEED)
    batches = [synthetic_batch(SEED, s, rank, BATCH, IMAGE, CLASSES) for s in range(steps)]
    dataset = ds.NumpySlicesDataset({"x": [b[0] for b in batches], "y": [b[1] for b in batches]},
                                    shuffle=False).batch(1, drop_remainder=True)
    dataset = dataset.map(lambda x, y: (x[0], y[0]), input_columns=["x", "y"])
    net = resnet50(CLASSES, stem="small", seed=SEED)
    optimizer = OptTFTWrapper(nn.Momentum(net.trainable_params(), 0.05, 0.9))
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), optimizer=optimizer)
    mark("model_built")
    first, guard_cb = FirstStep(), TrainFaultTolerance(ckpt)
    model.train(1, dataset, callbacks=[guard_cb, first], dataset_sink_mode=False)
    out = {**guard_cb.guard.report(), "first_step_s": round(first.first_step_s, 3) if first.first_step_s else None,
           "wall_s": round(time.perf_counter() - STARTED, 3), "phases_s": PHASES}
    if rank == 0:
        with open(report, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
