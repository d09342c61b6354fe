"""Per-step cost of trainguard on the ResNet-50 example.

Two measurements, side by side in one run:

* **A/B**: the same DDP loop (2 CPU ranks, gloo) launched with plain
  ``torchrun`` and without trainguard, then with ``trainguard run`` and the
  Guard (optimizer wrapper, processor heartbeating to a live controller,
  abortable process group and comm hook, per-step commit snapshot, buffer
  sync). Runs alternate; each run's median step time is taken after warm-up.
  On a shared 2-core machine the run-to-run noise is a few percent, larger
  than the goal, so the spread is reported with the result.
* **bookkeeping**: the Python work trainguard adds to every step, timed in
  one process without noise from the other rank: the update-window reports
  and the commit snapshot of the ResNet-50 state (buffers, scheduler, RNG).

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


def ab_run(mode: str, steps: int, warmup: int, size: dict, tmp: Path) -> float:
    timeline = tmp / f"{mode}-{time.monotonic_ns()}.timeline"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    launcher = ["-m", "torch.distributed.run"] if mode == "plain" else ["-m", "trainguard.cli", "run"]
    cmd = [sys.executable, *launcher, "--nproc-per-node", str(NPROC), "--monitor-interval", "0.1", str(WORKER),
           "--mode", mode, "--steps", str(steps), "--timeline", str(timeline), "--ckpt", str(tmp / "ckpt"),
           "--batch-size", str(size["batch"]), "--image-size", str(size["image"])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    return statistics.median(e["seconds"] for e in events if e["event"] == "step" and e["step"] > warmup)


def bookkeeping_us(size: dict, iterations: int) -> float:
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
    steps, warmup, reps = (6, 2, 1) if args.quick else (25, 5, 3)
    size = {"batch": 4, "image": 16} if args.quick else {"batch": 8, "image": 32}
    medians: dict[str, list[float]] = {"plain": [], "guard": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for mode in ("plain", "guard") if rep % 2 == 0 else ("guard", "plain"):
                medians[mode].append(ab_run(mode, steps, warmup, size, Path(tmp)))
                print(mode, medians[mode][-1], file=sys.stderr)
    plain, guard = statistics.median(medians["plain"]), statistics.median(medians["guard"])
    book_us = bookkeeping_us(size, 20 if args.quick else 200)
    rows = [
        {"measure": "step time without trainguard (torchrun)", "value": plain, "unit": "s",
         "runs": [round(m, 4) for m in medians["plain"]]},
        {"measure": "step time with trainguard (trainguard run + Guard)", "value": guard, "unit": "s",
         "runs": [round(m, 4) for m in medians["guard"]]},
        {"measure": "A/B overhead", "value": 100 * (guard - plain) / plain, "unit": "%"},
        {"measure": "A/B run-to-run spread (plain runs)", "unit": "%",
         "value": 100 * (max(medians["plain"]) - min(medians["plain"])) / plain},
        {"measure": "trainguard bookkeeping per step", "value": book_us, "unit": "us"},
        {"measure": "bookkeeping as share of a step", "value": 100 * book_us * 1e-6 / plain, "unit": "%"},
    ]
    goals = [
        common.Goal("optimizer wrapper + processor overhead per step (A/B, ResNet-50, 2 CPU ranks)",
                    round(100 * (guard - plain) / plain, 3), 1.0, "%"),
        common.Goal("trainguard bookkeeping per step as share of the step", round(100 * book_us * 1e-6 / plain, 4),
                    1.0, "%"),
    ]
    common.report("overhead", rows, ["measure", "value", "unit", "runs"], goals, quick=args.quick, out=args.out,
                  extra={"nproc": NPROC, "steps": steps, "warmup_steps": warmup, "repetitions": reps, **size})


if __name__ == "__main__":
    main()
