"""A user's script, as outside testers write them: a small GPT-style LM with
dropout, AdamW with two parameter groups, warmup + cosine ``LambdaLR``, a
``DataLoader`` over a ``DistributedSampler`` (its position resumed through
``data=``), gradient clipping. Writes a JSON report.

usage: lm_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

LM_SNAPSHOT_EVERY=N snapshots into memory every N steps; LM_BAD_LOAD=RANK
makes that rank's data position raise in ``load_state_dict`` (a resume that
fails; LM_BAD_LOAD_HOW=crash kills the process there, =hang hangs); LM_NO_DATA=1
does not give the data position to the Guard (a script that loses it on a
restart); LM_DROPOUT sets the dropout (default 0.1); LM_STEP_SLEEP=S
stretches each step (for faults from outside); LM_KILL_AFTER_BACKWARD=RANK:STEP
makes that rank SIGKILL itself once (a marker in the checkpoint directory),
at that step, after its backward pass (its gradients all-reduced with every
peer) and before its optimizer step, once rank 0 committed the step.
LM_RAISE_AT=RANK:STEP makes the script itself raise ValueError there, in
every launch (a bug in the script).
"""

import hashlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from trainguard.torch import Guard

VOCAB, CONTEXT, WIDTH = 64, 16, 32


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(Block(dropout), Block(dropout))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        return self.head(self.ln(self.blocks(x)))


class Position:
    """The data position: epoch and batches taken in it, so a resumed or
    rolled-back step reads the batch it read the first time."""

    def __init__(self, sampler: DistributedSampler, loader: DataLoader) -> None:
        self.sampler, self.loader = sampler, loader
        self.epoch, self.taken, self._it = 0, 0, None
        self.bad = os.environ.get("LM_BAD_LOAD") == str(dist.get_rank())

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None:
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            for _ in range(self.taken):
                next(self._it)
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.taken = self.epoch + 1, 0
            self._it = None
            return self.next()
        self.taken += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        if self.bad:
            how = os.environ.get("LM_BAD_LOAD_HOW", "raise")
            if how == "crash":
                os.kill(os.getpid(), 9)
            if how == "hang":
                time.sleep(3600)
            raise RuntimeError("this rank's data position cannot be restored (LM_BAD_LOAD)")
        self.epoch, self.taken, self._it = state["epoch"], state["taken"], None


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # every rank's own dropout stream; DDP gives every rank rank 0's weights
    model = DDP(TinyGPT(float(os.environ.get("LM_DROPOUT", "0.1"))))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-3)
    warmup = 3
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (96, CONTEXT + 1), generator=g)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=torch.Generator().manual_seed(3))
    data = Position(sampler, loader)
    given = data if os.environ.get("LM_NO_DATA") != "1" else None  # 1: the position is (wrongly) left out
    guard = Guard(model, opt, scheduler=sched, data=given, checkpoint_dir=ckpt, save_every=save_every,
                  snapshot_every=int(os.environ.get("LM_SNAPSHOT_EVERY", "0")))
    pause = float(os.environ.get("LM_STEP_SLEEP", "0"))
    kill_rank, kill_step = map(int, os.environ.get("LM_KILL_AFTER_BACKWARD", "-1:-1").split(":"))
    killed = Path(ckpt) / f"killed-after-backward-r{kill_rank}"
    raise_rank, raise_step = map(int, os.environ.get("LM_RAISE_AT", "-1:-1").split(":"))
    for step in guard.steps(steps):
        with guard.protect():
            time.sleep(pause)
            x, y = data.next()
            if rank == raise_rank and step == raise_step:
                raise ValueError(f"a bug in the script at step {step}")
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            guard.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if rank == kill_rank and step == kill_step and not killed.exists():
                killed.touch()
                deadline = time.time() + 60
                while not (Path(ckpt) / f"committed-r0-{step}").exists() and time.time() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            guard.optimizer.step()
            sched.step()
        if kill_step >= 0 and rank == 0 and kill_rank != 0:
            (Path(ckpt) / f"committed-r0-{step}").touch()  # the step is committed: the rank to kill may go
    out = guard.report()
    out["data"] = data.state_dict()  # this rank's data position and random streams at the end
    out["rng_sha256"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    guard.close()
    with open(report if rank == 0 else f"{report}.rank{rank}", "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    __import__("gc").freeze()
