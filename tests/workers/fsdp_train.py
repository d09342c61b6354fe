"""A torchtitan-style user's script: a model sharded with ``fully_shard``
(FSDP2 over a 1-D device mesh, or HSDP over a 2x2 one), AdamW, dropout (each
rank draws its own masks), warmup ``LambdaLR``, gradient clipping (a DTensor
all-reduce), per-rank batches whose position is given as ``data=``. Layers
split unevenly over the shards (30 and 5 rows over 4 ranks: one rank holds
no row of the last). Writes a JSON report with the full gathered state's
hash (``get_state_dict(full_state_dict=True)``).

usage: fsdp_train.py STEPS REPORT CHECKPOINT_DIR [SAVE_EVERY]

FSDP_MESH=fsdp2|hsdp (default fsdp2); FSDP_STEP_SLEEP=S stretches each step
(for faults from outside); FSDP_SNAPSHOT_EVERY=N snapshots into memory;
FSDP_DCP_OUT=DIR:STEP saves a checkpoint of the user's own with ``dcp.save``
after that step (model, optimizer, scheduler, and each rank's random stream
and data position under a key of its own, as torchtitan keeps them);
FSDP_DCP_IN=DIR:STEP loads one before the Guard and gives the Guard its step.
"""

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainguard.torch import Guard


class Batches:
    """This rank's batches: a generator of its own, whose state is the data position."""

    def __init__(self, rank: int) -> None:
        self.g = torch.Generator().manual_seed(100 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 16, generator=self.g)
        return x, x[:, :5].sin() + 0.1 * torch.randn(8, 5, generator=self.g)

    def state_dict(self) -> dict:
        return {"g": self.g.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.g.set_state(state["g"])


def plain_model() -> nn.Module:
    """Three blocks (each a unit of its own) and, in the root unit, a norm
    and the head, whose gradients wait for the end of the backward pass."""
    return nn.Sequential(nn.Sequential(nn.Linear(16, 30), nn.LayerNorm(30), nn.GELU(), nn.Dropout(0.2)),
                         nn.Sequential(nn.Linear(30, 30), nn.GELU(), nn.Dropout(0.2)),
                         nn.Sequential(nn.Linear(30, 30), nn.GELU()),
                         nn.LayerNorm(30), nn.Linear(30, 5))


def build(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank, as torchtitan's seeded init
    model = plain_model()
    for block in model[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    return model, opt


def state_sha256(msd: dict, osd: dict) -> str:
    """A hash of a whole model and optimizer state (keyed by parameter name)."""
    h = hashlib.sha256()
    for name, t in sorted(msd.items()):
        h.update(name.encode() + t.numpy().tobytes())
    for name, st in sorted(osd["state"].items()):
        for key, t in sorted(st.items()):
            h.update(f"{name}.{key}".encode() + t.numpy().tobytes())
    h.update(json.dumps(osd["param_groups"], sort_keys=True, default=str).encode())
    return h.hexdigest()


def user_state(model, opt, sched, data, rank: int) -> dict:
    """What the script keeps in a DCP checkpoint of its own."""
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
            "scheduler": sched.state_dict(), f"rank{rank}": {"rng": torch.get_rng_state(), **data.state_dict()}}


def main() -> None:
    steps, report, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hsdp = os.environ.get("FSDP_MESH", "fsdp2") == "hsdp"
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,),
                           mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))
    model, opt = build(mesh)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    torch.manual_seed(1234 + rank)  # every rank's own dropout stream
    data = Batches(rank)
    start = 0
    if os.environ.get("FSDP_DCP_IN"):  # the user's own checkpoint, loaded as torchtitan does
        path, start = os.environ["FSDP_DCP_IN"].rsplit(":", 1)
        sd = user_state(model, opt, sched, data, rank)
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        sched.load_state_dict(sd["scheduler"])
        data.load_state_dict(sd[f"rank{rank}"])
        torch.set_rng_state(sd[f"rank{rank}"]["rng"])
        start = int(start)
    out_path, out_step = os.environ.get("FSDP_DCP_OUT", ":-1").rsplit(":", 1)
    guard = Guard(model, opt, scheduler=sched, data=data, checkpoint_dir=ckpt, save_every=save_every,
                  snapshot_every=int(os.environ.get("FSDP_SNAPSHOT_EVERY", "0")), start_step=start)
    pause = float(os.environ.get("FSDP_STEP_SLEEP", "0"))
    for step in guard.steps(steps):
        with guard.protect():
            time.sleep(pause)
            x, y = data.next()
            loss = nn.functional.mse_loss(model(x), y)
            guard.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            guard.optimizer.step()
            sched.step()
        if step + 1 == int(out_step):
            dcp.save(user_state(model, opt, sched, data, rank), checkpoint_id=out_path)
    out = guard.report()
    out["full_sha256"] = state_sha256(*get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)))
    out["data"] = hashlib.sha256(data.g.get_state().numpy().tobytes()).hexdigest()
    out["rng_sha256"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    out["lr"] = sched.get_last_lr()
    guard.close()
    with open(report if rank == 0 else f"{report}.rank{rank}", "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    __import__("gc").freeze()
