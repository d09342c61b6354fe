"""A small DDP job with in-memory snapshots, for the restart tests.

    trainguard run --nproc-per-node 2 snapshot_train.py STEPS REPORT CKPT SAVE_EVERY

Snapshots every step, saves every SAVE_EVERY. With ``CORRUPT_ON_RESTART=R`` set, rank
R flips a byte in each of its snapshots in memory when it is a restarted
process, before the Guard looks at them. ``SNAP_DEVICE=cuda`` trains on
GPU ``LOCAL_RANK % device_count`` (gloo: ranks may share one GPU);
``SNAP_STEP_SLEEP=S`` makes each step last S seconds more. ``SNAP_DROPOUT=1`` adds a
dropout layer drawing from the global RNG, seeded differently on each rank. Each rank writes
its report to ``REPORT.<rank>`` (rank 0 to REPORT too). ``SNAPSHOT_PEER=1`` and
``SNAPSHOT_SHARED=1`` turn on the Guard's options of those names. ``SNAP_UNREPAIRABLE=1`` makes the CPU
stand in for CUDA in a recovery: its device memory errors cannot be repaired in the process.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.torch import Guard


def corrupt_own_snapshots(rank: int) -> None:
    for slot in Path(os.environ["TRAINGUARD_SNAPSHOT_DIR"]).glob(f"r{rank}.s*"):
        with open(slot, "r+b") as f:
            f.seek(slot.stat().st_size - 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x55]))


def main() -> None:
    steps, report, ckpt, save_every = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    if os.environ.get("SNAP_DEVICE") == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if os.environ.get("CORRUPT_ON_RESTART") == str(rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
        corrupt_own_snapshots(rank)
    if os.environ.get("SNAP_UNREPAIRABLE") == "1":
        from trainguard.adapters.torch import device as devices

        devices.Device.repairable = property(lambda self: False)
    torch.manual_seed(0)
    dropout = [torch.nn.Dropout(0.2)] if os.environ.get("SNAP_DROPOUT") == "1" else []
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), *dropout, torch.nn.Linear(256, 8)).to(device)
    if dropout:
        torch.manual_seed(1000 + rank)  # each rank its own masks
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    guard = Guard(model, opt, scheduler=sched, checkpoint_dir=ckpt, save_every=save_every, snapshot_every=1, keep=0,
                  snapshot_peer=os.environ.get("SNAPSHOT_PEER") == "1",
                  snapshot_shared=os.environ.get("SNAPSHOT_SHARED") == "1")
    step_sleep = float(os.environ.get("SNAP_STEP_SLEEP", "0"))
    for step in guard.steps(steps):
        with guard.protect():
            time.sleep(step_sleep)
            gen = torch.Generator().manual_seed(step * 100 + rank)
            x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 8, (16,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
            sched.step()
    guard.close()
    Path(f"{report}.{rank}").write_text(json.dumps(guard.report()))
    if rank == 0:
        Path(report).write_text(json.dumps(guard.report()))


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
