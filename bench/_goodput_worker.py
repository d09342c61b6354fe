"""The training loop bench/goodput.py times: a small GPT with dropout on
two data-parallel ranks (gloo), under three fault-tolerance layers.

* ``plain``: what torchrun users run -- DDP, a ``torch.save`` of model,
  optimizer and scheduler every ``--save-every`` steps by rank 0, resumed
  from the newest one at start; faults from ``--faults`` strike in the
  worker (once each: ``--fault-log`` records the strikes) and torchrun's
  ``--max-restarts`` (or the bench, as a scheduler) relaunches everyone;
* ``guard``: the same loop under trainguard's Guard (faults come from
  ``TRAINGUARD_FAULT``, set by the bench from the same schedule);
* ``torchft``: one replica group per process (``BENCH_REPLICA``), torchft's
  Manager, DistributedDataParallel and OptimizerWrapper, the model and
  optimizer state healed from a live peer; faults as in ``plain``.

Batches are a function of (step, rank), so the data position is the step;
dropout draws from every rank's own torch stream. Rank 0 appends a JSON line
per event to ``--timeline`` (``start``, ``ready``, ``step``) and, at the
end, writes ``--result``: the steps done and the SHA-256 of the model's
parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, CONTEXT = 256, 64


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, width: int, layers: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(CONTEXT, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(width, dropout) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        return self.head(self.ln(self.blocks(x)))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def note(path: Path | None, **event) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **event}) + "\n")


def state_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Faults:
    """The schedule's faults, struck in the worker (plain and torchft modes):
    each once per job, recorded in the fault log before it strikes."""

    def __init__(self, spec: str, log: Path | None, rank: int) -> None:
        self.mine = {}
        for item in filter(None, spec.split(";")):
            kind, rest = item.split(":")
            fields = dict(kv.split("=") for kv in rest.split(","))
            if int(fields["rank"]) == rank:
                self.mine[int(fields["step"])] = kind
        self.log = log
        self.struck = set()
        if log is not None and log.exists():
            self.struck = {json.loads(line)["step"] for line in log.read_text().splitlines()
                           if json.loads(line)["rank"] == rank}
        self.rank = rank

    def at(self, step: int, phase: str) -> None:
        kind = self.mine.get(step)
        if kind is None or step in self.struck or (phase == "forward") != (kind in ("hang", "stop")):
            return
        self.struck.add(step)
        with open(self.log, "a") as f:
            f.write(json.dumps({"t": time.time(), "step": step, "rank": self.rank, "kind": kind}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if kind == "hang":
            while True:  # stuck in Python, as a deadlocked data loader is
                time.sleep(1)
        if kind == "uce":
            raise RuntimeError("UCE ERROR: injected device memory error")
        raise RuntimeError("Connection closed by peer: injected communication error")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "guard", "torchft"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--timeline", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--faults", default="")
    p.add_argument("--fault-log", type=Path, default=None)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--pg-timeout-s", type=float, default=30.0)
    args = p.parse_args()
    if args.mode == "torchft":
        return _torchft(args)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    rank = dist.get_rank()
    timeline = args.timeline if rank == 0 else None
    note(timeline, event="start", at=T_START)
    torch.manual_seed(0)
    net = GPT(args.width, args.layers)
    torch.manual_seed(1000 + rank)  # every rank's own dropout stream
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    faults = Faults(args.faults, args.fault_log, rank)
    if args.mode == "guard":
        from trainguard.torch import Guard

        guard = Guard(model, opt, scheduler=sched, checkpoint_dir=args.ckpt, save_every=args.save_every,
                      snapshot_every=int(os.environ.get("BENCH_SNAPSHOT_EVERY", "0")))
        steps, optimizer, start, protect = guard.steps(args.steps), guard.optimizer, guard.step, guard.protect
    else:
        start = _plain_resume(args.ckpt, model, opt, sched)
        steps, optimizer, protect = iter(range(start, args.steps)), opt, _NoProtect
    note(timeline, event="ready", step=start)
    for step in steps:
        with protect():
            t0 = time.perf_counter()
            faults.at(step, "forward")
            x, y = batch(step, rank, args.batch_size)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            faults.at(step, "backward")
            optimizer.step()
            sched.step()
        done = step + 1
        if args.mode == "guard" and guard.step != done:
            continue  # the step failed and was recovered: it runs again
        if args.mode == "plain" and args.save_every and done % args.save_every == 0:
            _plain_save(args.ckpt, done, model, opt, sched)
        note(timeline, event="step", step=done, seconds=time.perf_counter() - t0)
    if args.mode == "guard":
        guard.close()
    if rank == 0:
        args.result.write_text(json.dumps({"steps": args.steps, "sha256": state_sha256(net)}))
    dist.destroy_process_group()


class _NoProtect:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _plain_save(ckpt: Path, step: int, model, opt, sched) -> None:
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
        tmp = ckpt / f"ckpt_{step:08d}.pt.tmp"
        torch.save({"step": step, "model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict()}, tmp)
        tmp.rename(ckpt / f"ckpt_{step:08d}.pt")
    dist.barrier()


def _plain_resume(ckpt: Path, model, opt, sched) -> int:
    files = sorted(ckpt.glob("ckpt_*.pt")) if ckpt.is_dir() else []
    if not files:
        return 0
    state = torch.load(files[-1], weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return state["step"]


def _torchft(args) -> None:
    """One replica group of one process: torchft's own training loop shape
    (its README and train_ddp.py), the quorum every step, healing from a
    live peer when this replica (re)joins."""
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft import Optimizer as OptimizerWrapper

    replica = int(os.environ["BENCH_REPLICA"])
    timeline = args.timeline if replica == 0 else None
    note(timeline, event="start", at=T_START)
    torch.manual_seed(0)
    net = GPT(args.width, args.layers)
    torch.manual_seed(1000 + replica)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    def load_state_dict(state):
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])

    def state_dict():
        return {"model": net.state_dict(), "optim": inner.state_dict(), "sched": sched.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica_{replica}",
                      timeout=timedelta(seconds=args.pg_timeout_s), rank=0, world_size=1)
    model = DistributedDataParallel(manager, net)
    optimizer = OptimizerWrapper(manager, inner)
    faults = Faults(args.faults, args.fault_log, replica)
    note(timeline, event="ready", step=manager.current_step())
    while manager.current_step() < args.steps:
        step = manager.current_step()
        t0 = time.perf_counter()
        optimizer.zero_grad()  # starts the quorum
        faults.at(step, "forward")
        x, y = batch(step, replica, args.batch_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        faults.at(step, "backward")
        optimizer.step()  # updates only when the quorum commits the step (should_commit)
        if manager.current_step() > step:
            sched.step()
            note(timeline, event="step", step=manager.current_step(), seconds=time.perf_counter() - t0,
                 participants=manager.num_participants())
    if replica == 0:
        args.result.write_text(json.dumps({"steps": manager.current_step(), "sha256": state_sha256(net)}))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
