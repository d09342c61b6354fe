"""A DDP job with profiling markers for the slow-node tests and bench.

usage: profiled_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

Batches come through ``guard.loader`` (DataLoader markers); every step also
runs a plain ``dist.all_reduce`` of the loss on the default group (a
collective outside trainguard's group). PROF_WIDTH sets the hidden width
(step time), PROF_SLEEP adds seconds to every step, PROF_PROGRESS names a
file where rank 0 writes the completed steps; TRAINGUARD_FAULT='slow:...'
slows one rank. Rank 0 writes the Guard's report.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.torch import Guard


def batches(rank: int, width: int):
    step = 0
    while True:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(64, width, generator=g)
        yield x, (x.sum(dim=1, keepdim=True) > 0).float()
        step += 1


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    width = int(os.environ.get("PROF_WIDTH", "256"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 1))
    model = DDP(net, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(model, opt, checkpoint_dir=ckpt, save_every=int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    rank = dist.get_rank()
    data = guard.loader(batches(rank, width))
    pause = float(os.environ.get("PROF_SLEEP", "0"))
    progress = os.environ.get("PROF_PROGRESS") if rank == 0 else None
    for step in guard.steps(steps):
        if progress:
            with open(progress, "w") as f:
                f.write(str(step))
        with guard.protect():
            time.sleep(pause)
            x, y = next(data)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
            dist.all_reduce(loss.detach())
    out = guard.report()
    guard.close()
    if rank == 0:
        with open(report, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
