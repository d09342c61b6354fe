"""A small DDP job for the tests: an MLP with BatchNorm, Adam + StepLR,
batches that are a function of (seed, step, rank). Writes a JSON report.

usage: tiny_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

TINY_DEVICE=cuda runs it on one GPU per local rank with NCCL; TINY_STEP_SLEEP=S
makes every step last at least S seconds more (for the watchdog tests);
TINY_ELASTIC_LR sets the Guard's elastic_lr; TINY_ALL_REPORTS=1 makes every
rank write its report (REPORT.rank<r>); TINY_EVAL_HOLD=STEP,S runs an
"evaluation" section after that step that holds the GIL for S seconds (as a
graph compile does: the heartbeat thread cannot run). TINY_HOLD_UPDATE=RANK,STEP
holds that rank's update of that step until every other rank has committed
the step (each writes a marker file beside REPORT), so a fault in that update
finds the others one step ahead, however loaded the machine. TINY_BUG=RANK,STEP makes
that rank raise ValueError inside that step on every launch (a bug in the script).
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


def batch(step: int, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x.to(device), (x.sum(dim=1, keepdim=True) > 0).float().to(device)


def hold_gil(seconds: float) -> None:
    """Keep the GIL for ``seconds``: no other thread of the process runs."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60)  # no forced switch before the loop ends
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    sys.setswitchinterval(interval)


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    cuda = os.environ.get("TINY_DEVICE") == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 1)).to(device)
    model = DDP(net, bucket_cap_mb=0.01, device_ids=[device.index] if cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    guard = Guard(model, opt, scheduler=sched, checkpoint_dir=ckpt, save_every=save_every,
                  elastic_lr=os.environ.get("TINY_ELASTIC_LR", "keep"))
    rank = dist.get_rank()
    step_sleep = float(os.environ.get("TINY_STEP_SLEEP", "0"))
    hold_step, hold_s = map(float, os.environ.get("TINY_EVAL_HOLD", "-1,0").split(","))
    held_rank, held_step = map(int, os.environ.get("TINY_HOLD_UPDATE", "-1,-1").split(","))
    bug_rank, bug_step = map(int, os.environ.get("TINY_BUG", "-1,-1").split(","))
    marker = lambda r, s: f"{report}.committed-r{r}-{s}"  # noqa: E731
    if rank == held_rank:
        update = opt.step  # inside the Guard's update window: after its collectives (BatchNorm buffers)

        def held_update(*args, **kwargs):
            if guard.step == held_step and not os.path.exists(marker(rank, held_step)):
                open(marker(rank, held_step), "w").close()  # once: a retried step goes on at once
                others = [marker(r, held_step) for r in range(dist.get_world_size()) if r != rank]
                deadline = time.time() + 60
                while not all(map(os.path.exists, others)) and time.time() < deadline:
                    time.sleep(0.01)
            return update(*args, **kwargs)
        opt.step = held_update
    for step in guard.steps(steps):
        with guard.protect():
            time.sleep(step_sleep)
            x, y = batch(step, rank, device)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            if rank == bug_rank and step == bug_step:
                raise ValueError(f"a bug in the script at step {step}")
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
            sched.step()
        if held_rank >= 0 and rank != held_rank and step == held_step:
            open(marker(rank, step), "w").close()  # committed: the held update may go
        if step == hold_step:
            with guard.section("evaluation"):
                hold_gil(hold_s)
    out = guard.report()
    guard.close()
    if rank == 0 or os.environ.get("TINY_ALL_REPORTS") == "1":
        with open(report if rank == 0 else f"{report}.rank{rank}", "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
