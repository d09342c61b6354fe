"""One run of the rank-runtime contract against one framework's Guard, in
one process (world size 1, no controller); prints each scenario's outcome
as one JSON object. The scenarios are written once; a framework supplies
only how to build its Guard and one step's body (``FRAMEWORKS``).

    rank_contract.py torch|mindspore DIR
"""

import json
import os
import sys
import time

framework, root = sys.argv[1], sys.argv[2]
for name in [n for n in os.environ if n.startswith("TRAINGUARD_")]:
    del os.environ[name]


def torch_side():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.torch import Guard

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)

    def make(**kw):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)))
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kw)
        guard.body_model = model
        return guard

    def body(guard, step):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = guard.body_model(x).square().mean()
        guard.optimizer.zero_grad()
        loss.backward()
        guard.optimizer.step()

    return make, body


def mindspore_side():
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    from trainguard.mindspore import Guard

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")

    def make(**kw):
        ms.set_seed(0)
        net = nn.Dense(8, 1, weight_init="ones", bias_init="zeros")
        guard = Guard(net, nn.Momentum(net.trainable_params(), 0.1, 0.9), **kw)
        loss = nn.WithLossCell(net, nn.MSELoss())
        guard.body_grad = ms.value_and_grad(loss, None, guard.optimizer.parameters)
        return guard

    def body(guard, step):
        data = np.random.default_rng(step)
        x = Tensor(data.standard_normal((4, 8)).astype(np.float32))
        y = Tensor(data.standard_normal((4, 1)).astype(np.float32))
        _, grads = guard.body_grad(x, y)
        guard.optimizer(grads)

    return make, body


FRAMEWORKS = {"torch": torch_side, "mindspore": mindspore_side}
make, body = FRAMEWORKS[framework]()

from trainguard.core.rank import Guard as GuardContract  # noqa: E402
from trainguard.core.rank import RankRuntime  # noqa: E402


def train(guard, total):
    seen = []
    for step in guard.steps(total):
        seen.append(step)
        with guard.protect():
            body(guard, step)
    return seen


def failure(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the outcome is what the contract compares
        return {"type": type(e).__name__, "message": str(e)}
    return None


out = {}

guard = make()
with guard.section("evaluation"):
    time.sleep(0.01)
seen = train(guard, 3)
report = guard.report()
guard.close()
out["loop"] = {"seen": seen, "step": guard.step, "report": sorted(report), "lost_steps": report["lost_steps"],
               "recoveries": report["recoveries"], "pids": {str(k): v for k, v in report["pids"].items()},
               "pid": os.getpid(), "contract": isinstance(guard, GuardContract),
               "runtime": isinstance(guard, RankRuntime)}

guard = make()


def unprotected():
    for step in guard.steps(2):
        body(guard, step)


out["unprotected"] = failure(unprotected)
guard.close(finished=False)

guard = make()


def faulty():
    for step in guard.steps(3):
        with guard.protect():
            if step == 1:
                raise RuntimeError("a fault in the body of step 1")
            body(guard, step)


out["fault"] = {"raised": failure(faulty), "step": guard.step}
guard.close(finished=False)

ckpt = os.path.join(root, "ckpt")
guard = make(checkpoint_dir=ckpt, save_every=2)
train(guard, 4)
saved = guard.report()["final_state_sha256"]
guard.close()
guard = make(checkpoint_dir=ckpt)
resumed = {"step": guard.step, "same_state": guard.report()["final_state_sha256"] == saved}
resumed["seen"] = train(guard, 6)
guard.close()
out["resume"] = resumed

print(json.dumps(out), flush=True)
