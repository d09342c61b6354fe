"""The ResNet-50 training loop the benchmarks time, in two modes.

* ``plain``: what users run today -- DDP, a ``torch.save`` checkpoint every
  ``--save-every`` steps by rank 0, resume from the newest one at start. A
  fault (``--fault-step``) raises a device memory error on rank 1 in its
  backward pass in the first launch only (``BENCH_FAULT_KIND=crash``: the
  process SIGKILLs itself there instead); the process dies and
  ``torchrun --max-restarts`` relaunches everyone.
* ``guard``: the same loop protected by trainguard's Guard (faults come from
  ``TRAINGUARD_FAULT``, set by the benchmark).
* ``markers``: the guarded loop with profiling markers, everything on
  (Communication included) and everything off in turn, 4 steps each,
  switched in process (the switch file is not polled), so neighbouring
  blocks compare the two; each ``step`` event says which it was.
* ``ab``: both at once, interleaved step by step in the same processes: a
  plain DDP copy of the model on the default group and a guarded copy (same
  seed, same batches), alternating which goes first. Adjacent steps see the
  same machine, so the pair ratio is far less noisy than comparing launches.
  After the loop the process idles for ``--idle-s`` seconds with the guard
  alive, then as long again after closing it: the difference is what
  trainguard's background threads cost per second.

Rank 0 appends one JSON line per event to ``--timeline``: ``start`` (process
start), ``ready`` (model built, checkpoint loaded), ``step`` (a step
completed, with its wall and CPU duration; CPU counts every thread of the
process) and, in plain mode, ``fault``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "resnet50" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def note(path: Path, **event) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **event}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "guard", "ab", "markers"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--timeline", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--fault-step", type=int, default=-1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--profiling-dir", type=Path, default=None)
    args = p.parse_args()
    if args.mode == "ab":
        return _ab(args)

    model_mod, data_mod = _load("model"), _load("data")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    timeline = args.timeline if rank == 0 else None
    if timeline:
        note(timeline, event="start", at=T_START, mode=args.mode)
    torch.manual_seed(0)
    model = DDP(model_mod.resnet50(num_classes=10, stem="small"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.steps, 1))
    data = data_mod.SyntheticImages(0, 10, args.batch_size, args.image_size)

    marked = args.mode == "markers"
    if args.mode in ("guard", "markers"):
        from trainguard.core.profiling import Switch
        from trainguard.torch import Guard

        guard = Guard(model, opt, scheduler=sched, checkpoint_dir=args.ckpt, save_every=args.save_every,
                      profiling_dir=args.profiling_dir if marked else None,
                      snapshot_every=int(os.environ.get("BENCH_SNAPSHOT_EVERY", "0")))
        if marked:
            wanted = [Switch(True, True)]
            guard.recorder.switch.poll = lambda: wanted[0]  # switched here, step by step
            guard.recorder.apply(wanted[0])
        steps, optimizer, start = guard.steps(args.steps), guard.optimizer, guard.step
        protect = guard.protect
    else:
        start = _plain_resume(args.ckpt, model, opt, sched)
        steps, optimizer, protect = iter(range(start, args.steps)), opt, _NoProtect
        if args.fault_step >= 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and rank == 1:
            _arm_plain_fault(model, args.fault_step)
    if timeline:
        note(timeline, event="ready", step=start)

    for step in steps:
        with protect():
            t0, c0 = time.perf_counter(), time.process_time()
            _CURRENT[0] = step
            _one_step(model, optimizer, sched, data, step, rank)
        done = step + 1
        if args.mode in ("guard", "markers") and guard.step != done:
            continue  # the step failed and was recovered: it runs again
        if args.mode == "plain" and args.save_every and done % args.save_every == 0:
            _plain_save(args.ckpt, done, model, opt, sched)
        if timeline:
            note(timeline, event="step", step=done, seconds=time.perf_counter() - t0,
                 cpu_seconds=time.process_time() - c0, **({"markers": guard.recorder.markers} if marked else {}))
        if marked:  # blocks of 4 steps on, 4 off, on every rank alike
            wanted[0] = Switch((done // 4) % 2 == 0, (done // 4) % 2 == 0)
            guard.recorder.apply(wanted[0])
    if args.mode in ("guard", "markers"):
        guard.close()
    dist.destroy_process_group()


_CURRENT = [0]


def _one_step(model, optimizer, sched, data, step: int, rank: int) -> None:
    x, y = data.batch(step, rank)
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()
    sched.step()


def _ab(args) -> None:
    from trainguard.torch import Guard

    model_mod, data_mod = _load("model"), _load("data")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    timeline = args.timeline if rank == 0 else None
    data = data_mod.SyntheticImages(0, 10, args.batch_size, args.image_size)
    sides = {}
    for side in ("plain", "guard"):
        torch.manual_seed(0)
        model = DDP(model_mod.resnet50(num_classes=10, stem="small"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        sides[side] = [model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.steps, 1))]
    guard = Guard(sides["guard"][0], sides["guard"][1], scheduler=sides["guard"][2], checkpoint_dir=args.ckpt)
    sides["guard"][1] = guard.optimizer
    for step in guard.steps(args.steps):
        got = {}
        for side in (("plain", "guard") if step % 2 == 0 else ("guard", "plain")):
            t0, c0 = time.perf_counter(), time.process_time()
            if side == "guard":
                with guard.protect():
                    _one_step(*sides[side], data, step, rank)
            else:
                _one_step(*sides[side], data, step, rank)
            got[side] = (time.perf_counter() - t0, time.process_time() - c0)
        if timeline:
            note(timeline, event="ab", step=step + 1, plain_s=got["plain"][0], guard_s=got["guard"][0],
                 plain_cpu_s=got["plain"][1], guard_cpu_s=got["guard"][1])
    dist.barrier()
    idle = {}
    for with_guard in (True, False):
        if not with_guard:
            guard.close()
        time.sleep(1.0)  # let compute threads stop spinning
        t0, c0 = time.perf_counter(), time.process_time()
        if with_guard:
            with guard.section("idle"):  # a declared pause: the hang watchdog leaves it alone
                time.sleep(args.idle_s)
        else:
            time.sleep(args.idle_s)
        idle[with_guard] = (time.process_time() - c0) / (time.perf_counter() - t0)
    if timeline:
        note(timeline, event="idle", guard_cpu_per_s=idle[True], plain_cpu_per_s=idle[False])
    dist.destroy_process_group()


class _NoProtect:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _arm_plain_fault(model: DDP, fault_step: int) -> None:
    params = [p for p in model.module.parameters() if p.requires_grad]

    def hook(grad):
        if _CURRENT[0] == fault_step:
            note(Path(os.environ["BENCH_FAULT_LOG"]), event="fault", step=fault_step)
            if os.environ.get("BENCH_FAULT_KIND") == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("UCE ERROR: injected device memory error (baseline)")
        return grad

    params[len(params) // 2].register_hook(hook)


def _plain_save(ckpt: Path, step: int, model: DDP, opt, sched) -> None:
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
        tmp = ckpt / f"ckpt_{step:08d}.pt.tmp"
        torch.save({"step": step, "model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict()}, tmp)
        tmp.rename(ckpt / f"ckpt_{step:08d}.pt")
    dist.barrier()


def _plain_resume(ckpt: Path, model: DDP, opt, sched) -> int:
    files = sorted(ckpt.glob("ckpt_*.pt")) if ckpt.is_dir() else []
    if not files:
        return 0
    state = torch.load(files[-1], weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return state["step"]


if __name__ == "__main__":
    sys.exit(main())
