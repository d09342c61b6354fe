"""The training process of ``bench/detect.py``: a small DDP MLP on gloo whose
steps are stretched by a sleep, so that the step time is known and the
watchdog's learned limit can be checked against it.

Modes:

* ``guard``: protected by trainguard's Guard (launch with ``trainguard
  run``; faults come from ``TRAINGUARD_FAULT``). Rank 0 writes
  ``OUT/report.json`` (``guard.report()``). With ``--measure-from K`` every
  rank also writes ``OUT/cpu-RANK.json``: the CPU time of each of its
  threads (``/proc/self/task/TID/schedstat``, nanoseconds) from the end of
  step K to the end of the run, labelled with the Python thread's name where
  there is one, else the kernel's thread name.
* ``plain``: no trainguard (launch with plain ``torchrun``). ``--fault kill``
  or ``--fault stop`` makes rank 1 SIGKILL or SIGSTOP itself at the start of
  ``--fault-step`` (the strike's time goes to ``OUT/faults.jsonl`` first);
  ``--pg-timeout-s`` is the process group's collective timeout. Every rank
  records in ``OUT/events-RANK.jsonl`` when torchrun's agent sent it SIGTERM
  and when a collective raised.

Every rank writes ``OUT/timeline-RANK.jsonl``: one line per completed step
(wall time and seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def _append(path: Path, entry: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def thread_cpu() -> dict[int, tuple[str, int]]:
    """{tid: (label, CPU nanoseconds)} for every thread of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        t = int(tid)
        label = "main" if t == main else (f"py:{names[t]}" if t in names else f"native:{comm}")
        out[t] = (label, ns)
    return out


def cpu_delta(before: dict, after: dict) -> list[dict]:
    """Per thread CPU seconds between two :func:`thread_cpu` samples (a
    thread born in between counts from zero)."""
    return [{"tid": tid, "label": label, "cpu_s": (ns - before.get(tid, (label, 0))[1]) / 1e9}
            for tid, (label, ns) in sorted(after.items())]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def model() -> DDP:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return DDP(net)


def run_guard(args: argparse.Namespace, rank: int, out: Path) -> None:
    from trainguard.torch import Guard

    ddp = model()
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    guard = Guard(ddp, opt, checkpoint_dir=str(out / "ckpt"), save_every=0)
    timeline = out / f"timeline-{rank}.jsonl"
    sample = None
    last = time.time()
    for step in guard.steps(args.steps):
        with guard.protect():
            time.sleep(args.step_sleep)
            x, y = batch(step, rank)
            loss = F.binary_cross_entropy_with_logits(ddp(x), y)
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
        now = time.time()
        _append(timeline, {"event": "step", "step": step + 1, "t": now, "seconds": now - last})
        last = now
        if args.measure_from is not None and step + 1 == args.measure_from:
            sample = (time.monotonic(), thread_cpu())
    if sample is not None:
        wall = time.monotonic() - sample[0]
        (out / f"cpu-{rank}.json").write_text(json.dumps(
            {"rank": rank, "wall_s": wall, "threads": cpu_delta(sample[1], thread_cpu()),
             "watchdog": guard.processor.watchdog.config.enabled}))
    report = guard.report()
    guard.close()
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report, indent=1))


def run_plain(args: argparse.Namespace, rank: int, out: Path) -> None:
    events = out / f"events-{rank}.jsonl"

    def on_term(signum, frame):  # torchrun's agent stops the survivors with SIGTERM
        _append(events, {"event": "sigterm", "t": time.time()})
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    ddp = model()
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    timeline = out / f"timeline-{rank}.jsonl"
    last = time.time()
    try:
        for step in range(args.steps):
            if args.fault and rank == 1 and step == args.fault_step:
                _append(out / "faults.jsonl", {"kind": args.fault, "rank": rank, "step": step,
                                              "time": time.time(), "pid": os.getpid()})
                os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
            time.sleep(args.step_sleep)
            x, y = batch(step, rank)
            loss = F.binary_cross_entropy_with_logits(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            now = time.time()
            _append(timeline, {"event": "step", "step": step + 1, "t": now, "seconds": now - last})
            last = now
    except Exception as e:
        _append(events, {"event": "error", "t": time.time(), "error": str(e)[:400]})
        raise


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("guard", "plain"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step-sleep", type=float, default=0.2)
    p.add_argument("--measure-from", type=int, default=None)
    p.add_argument("--fault", choices=("kill", "stop"), default=None)
    p.add_argument("--fault-step", type=int, default=4)
    p.add_argument("--pg-timeout-s", type=float, default=None)
    args = p.parse_args()
    timeout = {"timeout": timedelta(seconds=args.pg_timeout_s)} if args.pg_timeout_s else {}
    dist.init_process_group("gloo", **timeout)
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    (run_guard if args.mode == "guard" else run_plain)(args, rank, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
