"""A small DDP job whose checkpoint store fails while it trains, for the
store-failure tests (the test mounts a tiny tmpfs at CKPT's parent, in a
user and mount namespace of its own):

    trainguard run --nproc-per-node 2 store_full_train.py STEPS REPORT CKPT SAVE_EVERY

Snapshots every step (``STORE_SNAPSHOTS=0``: none, saves are synchronous).
``STORE_BREAK_AT=N``: before the body of step N rank 0 waits until the
checkpoint of the last save step up to N is complete, then breaks the store
(``STORE_BREAK``: ``full``, the default, fills CKPT's filesystem with a file
``filler`` beside CKPT; ``readonly`` remounts it read-only); ``STORE_MEND_AT=M``:
rank 0 mends it before step M. ``STORE_HOLD_AT=K,...``: every rank waits
before step K (in a section, so no hang check counts it) until
``REPORT.seen<K>`` exists, so the test can look at ``trainguard status``
then (see below). ``STORE_CRASH_AT=K``: rank 1 kills itself (SIGKILL) in step K (the
fault injector would log its strike into the broken store first).
Rank 0 writes the job token (``TRAINGUARD_TOKEN``) to ``REPORT.token``; each
rank writes its report to ``REPORT.<rank>`` (rank 0 to REPORT too).

A rank learns how a background save went when its ring next looks at the
persist worker's replies (the next snapshot); a held rank first waits for
the saves asked so far, as the steps it does not take would have noticed.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.core.checkpoint import CheckpointStore
from trainguard.torch import Guard


def fill(disk: Path) -> None:
    """Write ``disk/filler`` until the filesystem has no byte left."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise


def break_store(disk: Path, how: str) -> None:
    if how == "full":
        fill(disk)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def mend_store(disk: Path, how: str) -> None:
    if how == "full":
        (disk / "filler").unlink()
    else:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)


def wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.05)


def main() -> None:
    steps, report, ckpt, save_every = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    break_at, mend_at, crash_at = (int(os.environ.get(f"STORE_{k}_AT", "-1")) for k in ("BREAK", "MEND", "CRASH"))
    hold_at = {int(k) for k in os.environ.get("STORE_HOLD_AT", "").split(",") if k}
    how = os.environ.get("STORE_BREAK", "full")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        Path(f"{report}.token").write_text(os.environ.get("TRAINGUARD_TOKEN", ""))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    guard = Guard(model, opt, scheduler=sched, checkpoint_dir=str(ckpt), save_every=save_every,
                  snapshot_every=int(os.environ.get("STORE_SNAPSHOTS", "1")))
    store = CheckpointStore(ckpt)
    for step in guard.steps(steps):
        if rank == 0 and step == break_at:
            last = step - step % save_every
            with guard.section("breaking the store"):
                wait_for(lambda: (store.tracked_step() or 0) >= last, f"the checkpoint of step {last}")
                break_store(ckpt.parent, how)
        if rank == 0 and step == mend_at:
            mend_store(ckpt.parent, how)
        if step in hold_at:
            with guard.section("the test looks at the job"):
                if guard.snapshots is not None:  # what the next snapshots would notice of the persists asked
                    guard.snapshots.wait(60)
                wait_for(lambda: Path(f"{report}.seen{step}").exists(), "the test")
        with guard.protect():
            if rank == 1 and step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            gen = torch.Generator().manual_seed(step * 100 + rank)
            x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 8, (16,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
            sched.step()
    guard.close()
    out = guard.report()
    Path(f"{report}.{rank}").write_text(json.dumps(out))
    if rank == 0:
        Path(report).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
