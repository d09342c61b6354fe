"""A user's mixed-precision script, as an outside tester wrote it (issue 37):
a small transformer with dropout and stochastic depth (a draw per sample),
``torch.autocast("cpu", bfloat16)`` with ``torch.amp.GradScaler("cpu")``,
gradient accumulation over 4 micro-batches with DDP's ``no_sync()``, AdamW
with two parameter groups, warmup + cosine ``LambdaLR``, ``scaler.unscale_``
then gradient clipping, and torchdata's ``StatefulDataLoader`` over a
``DistributedSampler`` given as ``data=``. Writes a JSON report (rank 0:
REPORT, rank r: REPORT.rank<r>).

usage: amp_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

AMP_WORKERS=N loads in N worker processes (default 0); AMP_START=spawn
starts them with spawn (default: the platform's, fork on Linux);
AMP_SNAPSHOT_EVERY=N snapshots into memory every N steps; AMP_UNSCALE=0
leaves out ``unscale_`` and clipping (the plain AMP recipe); AMP_NO_SCALER=1
and AMP_NO_DATA=1 do not give the scaler / the loader to the Guard (a script
that forgets them); AMP_STEP_SLEEP=S stretches each step. The loss is summed
over tokens and the scaler starts at 2**124 and grows every 3 steps
(``growth_interval``): at 2**126 the scaled gradients overflow, that step's
update is skipped and the scale backs off (steps 7, 11, ... here) -- its
scale, growth tracker and found-inf all matter.
"""

import contextlib
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from trainguard.torch import Guard

VOCAB, CONTEXT, WIDTH, ACCUM = 64, 16, 32, 4


class Block(nn.Module):
    def __init__(self, dropout: float, drop_path: float) -> None:
        super().__init__()
        self.drop_path = drop_path
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                                 nn.Dropout(dropout))

    def skip(self, branch: torch.Tensor) -> torch.Tensor:
        """Stochastic depth as timm's ``DropPath``: each sample's branch is
        dropped with probability ``drop_path`` (every parameter stays used)."""
        if not self.training or not self.drop_path:
            return branch
        keep = 1.0 - self.drop_path
        return branch * branch.new_empty(branch.shape[0], 1, 1).bernoulli_(keep) / keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.skip(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
        return x + self.skip(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(Block(0.1, 0.2), Block(0.1, 0.2))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        return self.head(self.ln(self.blocks(x)))


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    env = os.environ.get
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # every rank's own dropout and stochastic-depth draws
    model = DDP(TinyGPT())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-3)
    warmup = 3
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 124, growth_interval=3)
    tokens = torch.randint(0, VOCAB, (96, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)  # 48 samples per rank: 3 steps an epoch
    workers = int(env("AMP_WORKERS", "0"))
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers,
                                multiprocessing_context=env("AMP_START") if workers else None)
    guard = Guard(model, opt, scheduler=sched, scaler=None if env("AMP_NO_SCALER") == "1" else scaler,
                  data=None if env("AMP_NO_DATA") == "1" else loader, checkpoint_dir=ckpt, save_every=save_every,
                  snapshot_every=int(env("AMP_SNAPSHOT_EVERY", "0")))
    unscale = env("AMP_UNSCALE", "1") == "1"
    pause = float(env("AMP_STEP_SLEEP", "0"))
    batches = iter(loader)
    for step in guard.steps(steps):
        with guard.protect():
            time.sleep(pause)
            guard.optimizer.zero_grad()
            for micro in range(ACCUM):
                batch = next(batches, None)
                if batch is None:  # the epoch is over
                    sampler.set_epoch(sampler.epoch + 1)
                    batches = iter(loader)
                    batch = next(batches)
                x, y = batch
                with model.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = model(x)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / ACCUM
                    scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(guard.optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(guard.optimizer)
            scaler.update()
            sched.step()
    out = guard.report()
    out["scaler"] = scaler.state_dict()
    out["lr"] = sched.get_last_lr()
    out["data"] = hashlib.sha256(json.dumps(loader.state_dict(), sort_keys=True, default=str).encode()).hexdigest()
    out["epoch"] = sampler.epoch
    out["rng_sha256"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    guard.close()
    with open(report if rank == 0 else f"{report}.rank{rank}", "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
