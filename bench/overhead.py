"""Per-step cost of trainguard on the ResNet-50 example.

Side by side in one run, on the same DDP loop (2 CPU ranks, gloo):

* **plain**: launched with ``torchrun``, no trainguard at all;
* **trainguard**: launched with ``trainguard run``, protected by the Guard
  (optimizer wrapper, processor heartbeating to a live controller, abortable
  process group and comm hook, per-step commit snapshot, buffer sync).

Runs come in adjacent pairs (plain then trainguard, or the reverse) and the
overhead is the median over pairs of each pair's ratio, so slow drifts of the
shared machine's load hit both sides of a pair. Each step is timed in wall
time and in CPU time of the rank-0 process (all its threads: compute, gloo,
processor); CPU time is what trainguard's added work costs and is not
inflated by other tenants, so the goal is judged on it, with the wall-time
ratio and the run-to-run spread reported beside it.

A third measure times trainguard's per-step bookkeeping alone, in one
process: the update-window reports and the commit snapshot of the ResNet-50
state.

usage: python bench/overhead.py [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_resnet_worker.py"
NPROC = 2


def run(mode: str, steps: int, warmup: int, size: dict, tmp: Path) -> tuple[float, float]:
    """Median wall and CPU seconds per step of one launch."""
    timeline = tmp / f"{mode}-{time.monotonic_ns()}.timeline"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    launcher = ["-m", "torch.distributed.run"] if mode == "plain" else ["-m", "trainguard.cli", "run"]
    cmd = [sys.executable, *launcher, "--nproc-per-node", str(NPROC), "--monitor-interval", "0.1", str(WORKER),
           "--mode", mode, "--steps", str(steps), "--timeline", str(timeline), "--ckpt", str(tmp / "ckpt"),
           "--batch-size", str(size["batch"]), "--image-size", str(size["image"])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    steps_ = [e for e in map(json.loads, timeline.read_text().splitlines())
              if e["event"] == "step" and e["step"] > warmup]
    return statistics.median(e["seconds"] for e in steps_), statistics.median(e["cpu_seconds"] for e in steps_)


def bookkeeping_us(iterations: int) -> float:
    """Microseconds of trainguard work per step, outside the collectives."""
    import importlib.util

    import torch

    from trainguard.adapters.torch.trainstate import TrainState
    from trainguard.core import Processor

    spec = importlib.util.spec_from_file_location("model", WORKER.parent.parent / "examples/resnet50/model.py")
    model_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_mod)
    model = model_mod.resnet50(num_classes=10, stem="small")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    state, processor = TrainState(model, opt, scheduler=sched), Processor(None)
    start = time.perf_counter()
    for i in range(iterations):
        processor.start_update()
        processor.end_update(i + 1)
        state.commit(i + 1)
    return (time.perf_counter() - start) / iterations * 1e6


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    steps, warmup, pairs = (6, 2, 1) if args.quick else (12, 3, 6)
    size = {"batch": 4, "image": 16} if args.quick else {"batch": 8, "image": 32}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            order = ("plain", "guard") if pair % 2 == 0 else ("guard", "plain")
            got = {mode: run(mode, steps, warmup, size, Path(tmp)) for mode in order}
            rows.append({"pair": pair, "order": "/".join(order),
                         "plain_wall_s": got["plain"][0], "guard_wall_s": got["guard"][0],
                         "plain_cpu_s": got["plain"][1], "guard_cpu_s": got["guard"][1],
                         "wall_overhead_pct": 100 * (got["guard"][0] / got["plain"][0] - 1),
                         "cpu_overhead_pct": 100 * (got["guard"][1] / got["plain"][1] - 1)})
            print(rows[-1], file=sys.stderr)
    cpu = statistics.median(r["cpu_overhead_pct"] for r in rows)
    wall = statistics.median(r["wall_overhead_pct"] for r in rows)
    plain_walls = [r["plain_wall_s"] for r in rows]
    book_us = bookkeeping_us(20 if args.quick else 200)
    step_s = statistics.median(plain_walls)
    goals = [
        common.Goal("optimizer wrapper + processor overhead per step (CPU time, median of pairs)",
                    round(cpu, 3), 1.0, "%"),
        common.Goal("trainguard bookkeeping per step as share of the step", round(100 * book_us * 1e-6 / step_s, 4),
                    1.0, "%"),
    ]
    common.report("overhead", rows, ["pair", "order", "plain_wall_s", "guard_wall_s", "wall_overhead_pct",
                                     "plain_cpu_s", "guard_cpu_s", "cpu_overhead_pct"], goals,
                  quick=args.quick, out=args.out,
                  extra={"nproc": NPROC, "steps": steps, "warmup_steps": warmup, "pairs": pairs, **size,
                         "median_wall_overhead_pct": round(wall, 3), "median_cpu_overhead_pct": round(cpu, 3),
                         "plain_wall_spread_pct": round(100 * (max(plain_walls) - min(plain_walls)) / step_s, 1),
                         "bookkeeping_us_per_step": round(book_us, 1)})


if __name__ == "__main__":
    main()
