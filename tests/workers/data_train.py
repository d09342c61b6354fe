"""A user's script feeding a model with dropout from a ``DistributedSampler``,
as issue 27 has it: the loader is given to the Guard as ``data=`` and the
script calls ``set_epoch`` at each epoch, nothing else. Every rank appends
each step's sample indices to ``<REPORT>.trace.rank<r>`` (a redone step
appends again: the last line of a step is what it trained on) and writes a
JSON report (rank 0: REPORT, rank r: REPORT.rank<r>).

usage: data_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

DATA_MODE picks the loader:
  stateful      torchdata's StatefulDataLoader, given as ``data=`` as it is
  resumable     a plain DataLoader in trainguard.torch.ResumableLoader
  stateful-raw  a StatefulDataLoader behind an object that only forwards
                state_dict/load_state_dict (what the Guard did with it before
                it understood StatefulDataLoader)
  bare          a plain DataLoader, not given to the Guard (the Guard refused
                one before: it has no state_dict)
  raw           a plain DataLoader given as ``data=`` (refused before step 0)
DATA_WORKERS=N loads in N worker processes (default 0); DATA_SNAPSHOT_EVERY=N
snapshots into memory every N steps; DATA_STEP_SLEEP=S stretches each step.
"""

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from trainguard.torch import Guard, ResumableLoader

SAMPLES, BATCH = 48, 4  # 2 ranks: 24 samples, 6 batches each per epoch


class Forward:
    """Only the loader's own state_dict / load_state_dict."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    mode = os.environ.get("DATA_MODE", "stateful")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # each rank's own dropout stream
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g),
                            torch.arange(SAMPLES))
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    workers = int(os.environ.get("DATA_WORKERS", "0"))
    if mode in ("stateful", "stateful-raw"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        source = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)
        data = source if mode == "stateful" else Forward(source)
    elif mode == "resumable":
        source = data = ResumableLoader(DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers))
    elif mode == "bare":
        source, data = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers), None
    elif mode == "raw":
        source = data = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)
    else:
        raise SystemExit(f"unknown DATA_MODE {mode!r}")
    guard = Guard(model, opt, data=data, checkpoint_dir=ckpt, save_every=save_every,
                  snapshot_every=int(os.environ.get("DATA_SNAPSHOT_EVERY", "0")))
    pause = float(os.environ.get("DATA_STEP_SLEEP", "0"))
    trace = open(f"{report}.trace.rank{rank}", "a", buffering=1)
    batches = iter(source)
    for step in guard.steps(steps):
        with guard.protect():
            time.sleep(pause)
            batch = next(batches, None)
            if batch is None:  # the epoch is over
                sampler.set_epoch(sampler.epoch + 1)
                batches = iter(source)
                batch = next(batches)
            x, y, index = batch
            trace.write(json.dumps([step, sampler.epoch, index.tolist()]) + "\n")
            loss = F.mse_loss(model(x), y)
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
    out = guard.report()
    out["rng_sha256"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    guard.close()
    trace.close()
    with open(report if rank == 0 else f"{report}.rank{rank}", "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
