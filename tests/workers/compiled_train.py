"""A small DDP job whose model is compiled with ``torch.compile``, for the
compile cache tests: an MLP, Adam, batches that are a function of (step, rank).

usage: compiled_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

COMPILED_WIDTH sets the hidden width (another width is another model). Every
rank writes its report (REPORT for rank 0, REPORT.rank<r> for the others).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.torch import Guard


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    width = int(os.environ.get("COMPILED_WIDTH", "64"))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, 1))
    model = DDP(torch.compile(net))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    guard = Guard(model, opt, checkpoint_dir=ckpt, save_every=save_every,
                  compile_cache_key={"batch": [16, 32]})
    rank = dist.get_rank()
    for step in guard.steps(steps):
        with guard.protect():
            x, y = batch(step, rank)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
    out = guard.report()
    guard.close()
    with open(report if rank == 0 else f"{report}.rank{rank}", "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
