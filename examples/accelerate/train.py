"""A small model trained with HF accelerate, protected by trainguard.

    trainguard run --nproc-per-node 2 examples/accelerate/train.py steps=12 checkpoint_dir=ckpt save_every=4
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate/train.py ...   # after `adapters-patch torchrun`

The loop is accelerate's own (``accelerator.prepare``, ``accelerator.backward``,
the prepared optimizer and scheduler); :func:`trainguard.integrations.accelerate.protect`
builds the Guard from the prepared objects and ``ResumableShard`` keeps the
prepared loader's position. Synthetic data, dropout on; settings as
``key=value``: steps, seed, checkpoint_dir, save_every, report (a JSON file
rank 0 writes: steps, recoveries, the state's hash, every rank's random
streams, data position, scheduler and learning rates as fingerprints).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from trainguard.integrations.accelerate import ResumableShard, protect


class Tokens(Dataset):
    """Synthetic sequences: predict the sum of a window's tokens modulo the vocabulary."""

    def __init__(self, n: int = 96, length: int = 16, vocab: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, length), generator=g)
        self.y = self.x.sum(dim=1) % vocab

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


class Model(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(width, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)).mean(dim=1))


def main(argv: list[str]) -> None:
    cfg = {"steps": "12", "seed": "0", "checkpoint_dir": "ckpt", "save_every": "0", "report": ""}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in cfg:
            raise SystemExit(f"unknown setting {key!r} (known: {', '.join(cfg)})")
        cfg[key] = value
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(int(cfg["seed"]))  # Python's, NumPy's and torch's streams
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s))
    loader = DataLoader(Tokens(), batch_size=8, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    loader = ResumableShard(loader)
    guard = protect(accelerator, model, optimizer, scheduler=scheduler, data=loader,
                    checkpoint_dir=cfg["checkpoint_dir"], save_every=int(cfg["save_every"]))
    batches = iter(loader)
    for _ in guard.steps(int(cfg["steps"])):
        with guard.protect():
            batch = next(batches, None)
            if batch is None:  # the epoch is over
                batches = iter(loader)
                batch = next(batches)
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    report = guard.report()
    report["final_own"] = accelerator.gather_for_metrics([report["own_fingerprints"]], use_gather_object=True)
    report["final_pieces"] = accelerator.gather_for_metrics([report["piece_fingerprints"]], use_gather_object=True)
    guard.close()
    if cfg["report"] and accelerator.is_main_process:
        with open(cfg["report"], "w") as f:
            json.dump(report, f, indent=1)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
