"""A small GPT trained the torchtitan way -- ``fully_shard`` on every block
and at the root, over a 1-D device mesh (FSDP2) or a replicate x shard one
(HSDP) -- protected by trainguard's Guard.

::

    trainguard run --nproc-per-node 4 examples/fsdp/train.py mesh=hsdp steps=24 save_every=8 \\
        checkpoint_dir=ck report=report.json

Settings (``key=value``): ``mesh`` fsdp2|hsdp (hsdp: 2 replica groups),
``steps``, ``save_every``, ``snapshot_every``, ``checkpoint_dir``,
``report`` (JSON: the Guard's report and the hash of the whole gathered
state), ``dropout``, ``seed``. The data is synthetic token sequences read
through a ``DataLoader`` over a ``DistributedSampler`` (each rank its own
batches), resumed through ``data=``; checkpoints are DCP's, readable with
``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from trainguard.torch import Guard, ResumableLoader

VOCAB, CONTEXT, WIDTH = 96, 16, 48
DEFAULTS = {"mesh": "fsdp2", "steps": "24", "save_every": "8", "snapshot_every": "0", "checkpoint_dir": "ckpt",
            "report": "", "dropout": "0.1", "seed": "0"}


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, dropout: float, layers: int = 3) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(Block(dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


def main(argv: list[str]) -> None:
    cfg = dict(DEFAULTS)
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in cfg:
            raise SystemExit(f"unknown setting {key!r}; known: {', '.join(cfg)}")
        cfg[key] = value
    steps, seed = int(cfg["steps"]), int(cfg["seed"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hsdp = cfg["mesh"] == "hsdp"
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,),
                           mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))

    torch.manual_seed(seed)  # the same initial weights on every rank
    model = GPT(float(cfg["dropout"]))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    tokens = torch.randint(0, VOCAB, (256, CONTEXT + 1), generator=torch.Generator().manual_seed(seed + 1))
    sampler = DistributedSampler(TensorDataset(tokens[:, :-1], tokens[:, 1:]), seed=seed)
    data = ResumableLoader(DataLoader(sampler.dataset, batch_size=8, sampler=sampler))
    torch.manual_seed(seed + 1000 + rank)  # each rank's own dropout masks

    guard = Guard(model, opt, scheduler=sched, data=data, checkpoint_dir=cfg["checkpoint_dir"],
                  save_every=int(cfg["save_every"]), snapshot_every=int(cfg["snapshot_every"]))
    batches = iter(data)
    for step in guard.steps(steps):
        with guard.protect():
            batch = next(batches, None)
            if batch is None:  # the epoch is over
                sampler.set_epoch(sampler.epoch + 1)
                batches = iter(data)
                batch = next(batches)
            x, y = batch
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            guard.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            guard.optimizer.step()
            sched.step()
    report = guard.report()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for name, t in sorted(msd.items()):
        h.update(name.encode() + t.numpy().tobytes())
    for name, state in sorted(osd["state"].items()):
        for key, t in sorted(state.items()):
            h.update(f"{name}.{key}".encode() + t.numpy().tobytes())
    report["full_state_sha256"] = h.hexdigest()  # the whole model and optimizer, the same on every rank
    guard.close()
    if rank == 0:
        print(f"rank 0: {report['steps_completed']} steps, whole state {report['full_state_sha256'][:16]}")
        if cfg["report"]:
            with open(cfg["report"], "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
