"""A small model trained with Lightning, protected by trainguard.

    trainguard run --nproc-per-node 2 examples/lightning/train.py steps=12 checkpoint_dir=ckpt save_every=4

A plain LightningModule and ``L.Trainer`` with ``GuardedDDPStrategy``
(trainguard.integrations.lightning) as the strategy. Synthetic data, dropout
on, AdamW with a per-step LambdaLR, a shuffled loader (Lightning gives it a
DistributedSampler). Settings as ``key=value``: steps, seed, checkpoint_dir,
save_every, report (a JSON file rank 0 writes: steps, recoveries, the
state's hash, every rank's random streams and data position and the rest
of its state (scheduler, learning rates) as fingerprints, Lightning's global step).
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainguard.integrations.lightning import GuardedDDPStrategy


class Model(L.LightningModule):
    def __init__(self, vocab: int = 64, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, width))
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(width, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(dim=1)
        return self.head(h + self.block(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str]) -> None:
    cfg = {"steps": "12", "seed": "0", "checkpoint_dir": "ckpt", "save_every": "0", "report": ""}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in cfg:
            raise SystemExit(f"unknown setting {key!r} (known: {', '.join(cfg)})")
        cfg[key] = value
    L.seed_everything(int(cfg["seed"]), verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (96, 16), generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1) % 64), batch_size=8, shuffle=True)
    strategy = GuardedDDPStrategy(guard_options={"checkpoint_dir": cfg["checkpoint_dir"],
                                                 "save_every": int(cfg["save_every"])})
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=strategy, max_steps=int(cfg["steps"]),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=cfg["checkpoint_dir"])
    trainer.fit(Model(), train_dataloaders=loader)
    report = strategy.guard_report
    owns, pieces = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(owns, report["own_fingerprints"])
    dist.all_gather_object(pieces, report["piece_fingerprints"])  # the scheduler's state, the learning rates...
    report["final_own"], report["final_pieces"], report["lightning_global_step"] = owns, pieces, trainer.global_step
    if cfg["report"] and dist.get_rank() == 0:
        with open(cfg["report"], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
