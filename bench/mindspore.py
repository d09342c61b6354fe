"""MindSpore: trainguard's per-step overhead, and its retry vs relaunching msrun.

Side by side in one run, on the MindSpore ResNet-50 example
(``examples/resnet50/train_mindspore.py``: 2 CPU ranks under msrun, PyNative,
synthetic data, a checkpoint every K steps):

1. **overhead**: launches of the same script with ``guard=true`` (``trainguard
   run --framework mindspore``: the optimizer wrapper and its collective
   health vote, the processor heartbeating to a live controller, the per-step
   commit) and ``guard=false`` (plain ``msrun`` and plain MindSpore:
   ``nn.DistributedGradReducer`` + optimizer, periodic
   ``mindspore.save_checkpoint``; trainguard is not imported), in adjacent
   pairs whose order alternates. The overhead is the ratio of the median
   steady-state step time (rank 0's, warm-up steps dropped) over all launches
   of each side, with a 95% interval from a two-level bootstrap (pairs of
   launches, then steps within each launch), so drift between launches widens
   the interval as it should. CPU seconds per step (rank 0's process, every
   thread) alongside. These launches are also the fault-free references of
   part 2, and every launch must end in the same ``final_state_sha256`` (the
   two sides do the same arithmetic).
2. **recovery** from one device memory error (``uce``, rank 1, backward pass)
   after F completed steps, for fault positions inside a K-step checkpoint
   interval:

   * **trainguard**: ``trainguard run`` with ``retry,dump,exit``: the failed
     rank releases its peers, takes the state from a replica, and the step
     runs again in the same processes;
   * **baseline**: plain msrun; the error kills rank 1, msrun tears the job
     down, and the benchmark relaunches the same command at once (what a
     supervisor does), which loads the newest periodic checkpoint.

   Measured on the jobs' own timeline (rank 0 writes a line per completed
   step; the fault's time comes from the fault log): fault until training
   runs again (trainguard: also the report's ``recover_s``; baseline: the
   relaunch has loaded its checkpoint), until the next completed step, and
   until the job is back where it was -- the failed step F+1 completed: the
   goal's measure. For the baseline that is the brief's "crash until the
   relaunched job completed its first step after loading, plus the steps lost
   since the last checkpoint times the step time" (also measured directly
   from the relaunch). Time lost: the failed step's extra time over a normal
   step, on the timeline, and the whole command's wall time over the median
   fault-free launch of part 1.

The machine is shared and has 2 cores for 2 ranks: step times drift by
several percent between launches, which is why part 1 alternates and reports
an interval, and why time lost is read from the timeline rather than from
whole-launch wall clocks alone.

3. **dying gasp** (``--dying-gasp``, a separate run): how long a lost worker
   takes to end in a dying-gasp checkpoint, MindSpore beside torch, the same
   fault on the same small worker shape (2 ranks, ``crash:rank=1,step=3,
   phase=backward``, strategies ``dump,exit``; ``tests/workers/ms_train.py``
   under ``trainguard run --framework mindspore``, ``tests/workers/tiny_train.py``
   under ``trainguard run --nproc-per-node 2``). Measured: the fault's time
   (the fault log) to the checkpoint's tracker file written (the dump is
   finalised), and the whole command. MindSpore's survivor is inside a
   collective with the lost rank and leaves it only at
   ``MS_CPU_COMM_OP_TIMEOUT`` (trainguard's msrun sets 15 s); the run is
   repeated with 5 s to show that the timeout, not the save, is the time,
   and once more with the rank lost in the gradient all-reduce
   (``phase=reduce``): that all-reduce is a compiled graph
   (``DistributedGradReducer``), and MindSpore raises a failed graph only
   after a fixed 3 s wait (``GraphScheduler::Run``'s ``kTimeToWait``).
   Then ``tests/workers/ms_collective_probe.py`` tries, once each, every way
   out of such a wait MindSpore 2.10 offers on CPU (finalize, release,
   destroy the group, an async all-reduce, reading the parameters) and
   records when the wait and the call ended.
   Writes ``bench/results/mindspore-dying-gasp.json``.

usage: python bench/mindspore.py [--quick]   (about 15 minutes on 2 cores; --quick: about 4)
       python bench/mindspore.py --dying-gasp   (about 4 minutes)
"""

from __future__ import annotations

import importlib.metadata
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from _mindspore_dying_gasp import dying_gasp  # noqa: E402
from _mindspore_launch import NPROC, LaunchFailed, Settings, attempts, events, fault_time, launch  # noqa: E402

FULL = Settings(steps=14, warmup=3, k=6, pairs=3, positions=(8, 11))
QUICK = Settings(steps=5, warmup=2, k=2, pairs=1, positions=(3,))


# ---------------------------------------------------------------- 1. overhead
def fault_free(tmp: Path, s: Settings, failures: dict) -> list[dict]:
    """Alternating fault-free launches of both sides; one record per launch."""
    runs = []
    for pair in range(s.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for guard in order:
            side = "trainguard" if guard else "plain"

            def once(attempt: int) -> dict:
                run_dir = tmp / f"ff-{pair}-{side}-{attempt}"  # a fresh directory per attempt
                got = launch(run_dir, guard=guard, s=s)
                if got.rc != 0 or got.report is None:
                    raise LaunchFailed(f"{side} launch ended with {got.rc}:\n{got.tail()}")
                steady = [e for e in events(run_dir, "step") if e["step"] > s.warmup]
                return {"pair": pair, "side": side, "wall_s": got.wall_s, "rc": got.rc,
                        "step_s": [e["seconds"] for e in steady], "cpu_s": [e["cpu_seconds"] for e in steady],
                        "sha256": got.report["final_state_sha256"], "script_wall_s": got.report["wall_s"]}

            runs.append(attempts(f"fault-free {side} launch", failures, side, once))
            r = runs[-1]
            print(f"pair {pair} {side}: median {statistics.median(r['step_s']):.3f} s/step, "
                  f"wall {r['wall_s']:.1f} s", file=sys.stderr)
    return runs


def overhead(runs: list[dict], key: str, rng: random.Random, rounds: int = 2000) -> dict:
    """Overhead in % of the trainguard side's median ``key`` over the plain
    side's, with a two-level bootstrap 95% interval."""
    pairs = sorted({r["pair"] for r in runs})
    by = {(r["pair"], r["side"]): r[key] for r in runs}

    def pct(chosen, resample: bool) -> float:
        pick = (lambda xs: rng.choices(xs, k=len(xs))) if resample else (lambda xs: xs)
        guard = [x for p in chosen for x in pick(by[p, "trainguard"])]
        plain = [x for p in chosen for x in pick(by[p, "plain"])]
        return 100 * (statistics.median(guard) / statistics.median(plain) - 1)

    boot = sorted(pct(rng.choices(pairs, k=len(pairs)), True) for _ in range(rounds))
    return {"pct": pct(pairs, False), "ci95": (boot[int(0.025 * rounds)], boot[int(0.975 * rounds) - 1]),
            "plain": statistics.median(x for p in pairs for x in by[p, "plain"]),
            "trainguard": statistics.median(x for p in pairs for x in by[p, "trainguard"]),
            "per_pair_pct": [100 * (statistics.median(by[p, "trainguard"]) / statistics.median(by[p, "plain"]) - 1)
                             for p in pairs]}


# ---------------------------------------------------------------- 2. recovery
def guard_recovery(run_dir: Path, s: Settings, f: int, reference_wall_s: float) -> dict:
    spec = f"uce:rank=1,step={f},phase=backward"
    got = launch(run_dir, guard=True, s=s, fault=spec)
    if got.rc != 0 or got.report is None:
        raise LaunchFailed(f"trainguard launch with {spec} ended with {got.rc}:\n{got.tail()}")
    (record,) = got.report["recoveries"]
    t_fault = fault_time(run_dir)
    steps = {e["step"]: e for e in events(run_dir, "step")}
    redone, before = steps[f + 1], steps[f]
    step_s = statistics.median(e["seconds"] for n, e in steps.items() if n > s.warmup and n != f + 1)
    return {
        "mode": "trainguard", "fault_step": f, "strategy": record["strategy"],
        "lost_steps": got.report["lost_steps"],
        "recover_s": record["recover_s"],
        "fault_to_resumed_s": redone["t"] - redone["seconds"] - t_fault,  # the failed step starts again
        "fault_to_next_step_s": redone["t"] - t_fault,
        "fault_to_regained_s": redone["t"] - t_fault,
        "fault_to_regained_measured_s": redone["t"] - t_fault,
        "time_lost_s": redone["t"] - before["t"] - step_s,
        "wall_lost_s": got.wall_s - reference_wall_s,
        "restarted": any(len(p) > 1 for p in got.report["pids"].values()),
        "step_s": step_s, "sha256": got.report["final_state_sha256"],
    }


def baseline_recovery(run_dir: Path, s: Settings, f: int, reference_wall_s: float) -> dict:
    spec = f"uce:rank=1,step={f},phase=backward"
    first = launch(run_dir, guard=False, s=s, fault=spec, attempt="1")
    if first.rc == 0:
        raise LaunchFailed(f"the plain job survived {spec}:\n{first.tail()}")
    second = launch(run_dir, guard=False, s=s, fault=spec, attempt="2")  # the same command, at once
    if second.rc != 0 or second.report is None:
        raise LaunchFailed(f"the plain relaunch ended with {second.rc}:\n{second.tail()}")
    t_fault = fault_time(run_dir)
    (ready,) = events(run_dir, "ready", after=first.ended)
    resumed = {e["step"]: e for e in events(run_dir, "step", after=first.ended)}
    before = {e["step"]: e for e in events(run_dir, "step") if e["t"] < t_fault}
    step_s = statistics.median(e["seconds"] for n, e in before.items() if n > s.warmup)
    lost = f - ready["step"]
    next_step = resumed[ready["step"] + 1]["t"] - t_fault
    return {
        "mode": "baseline", "fault_step": f, "strategy": "msrun relaunch + newest save_checkpoint",
        "lost_steps": lost,
        "recover_s": None,
        "teardown_s": first.ended - t_fault,  # until msrun exited
        "relaunch_to_ready_s": ready["t"] - first.ended,
        "fault_to_resumed_s": ready["t"] - t_fault,  # checkpoint loaded
        "fault_to_next_step_s": next_step,
        # The brief's measure: the relaunch's first step, then the lost steps again.
        "fault_to_regained_s": next_step + lost * step_s,
        "fault_to_regained_measured_s": resumed[f + 1]["t"] - t_fault,
        "time_lost_s": resumed[f + 1]["t"] - before[f]["t"] - step_s,
        "wall_lost_s": first.wall_s + second.wall_s - reference_wall_s,
        "restarted": True,
        "step_s": step_s, "sha256": second.report["final_state_sha256"],
    }


def recovery(tmp: Path, s: Settings, references: dict, failures: dict) -> list[dict]:
    rows = []
    for f in s.positions:
        for mode, fn in (("baseline", baseline_recovery), ("trainguard", guard_recovery)):
            rows.append(attempts(f"{mode} recovery at step {f}", failures,
                                 "plain" if mode == "baseline" else "trainguard",
                                 lambda attempt: fn(tmp / f"uce-{f}-{mode}-{attempt}", s, f, references[mode])))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, file=sys.stderr)
    return rows


# ---------------------------------------------------------------- the table
def side_by_side(step: dict, cpu: dict, rec: list[dict], s: Settings) -> list[dict]:
    lo, hi = step["ci95"]
    rows = [
        {"measure": f"step time, steady state ({s.pairs}+{s.pairs} launches, median)", "baseline": step["plain"],
         "trainguard": step["trainguard"], "unit": "s/step",
         "result": f"{step['pct']:+.2f}% (95% CI {lo:+.2f}..{hi:+.2f})"},
        {"measure": "  CPU time per step, rank 0", "baseline": cpu["plain"], "trainguard": cpu["trainguard"],
         "unit": "CPU s/step", "result": f"{cpu['pct']:+.2f}% (95% CI {cpu['ci95'][0]:+.2f}..{cpu['ci95'][1]:+.2f})"},
    ]
    measures = [("fault -> training resumed", "fault_to_resumed_s"),
                ("  trainguard's recover_s (report)", "recover_s"),
                ("  baseline: of which msrun's teardown", "teardown_s"),
                ("fault -> next completed step", "fault_to_next_step_s"),
                ("fault -> failed step done (goal)", "fault_to_regained_s"),
                ("  same, measured on the relaunch", "fault_to_regained_measured_s"),
                ("steps lost", "lost_steps"),
                ("time lost (failed step - normal step)", "time_lost_s"),
                ("job wall time lost vs fault-free launch", "wall_lost_s")]
    for group, label in [((f,), f"UCE after step {f}") for f in s.positions] + [(s.positions, "mean")]:
        base = [r for r in rec if r["mode"] == "baseline" and r["fault_step"] in group]
        ours = [r for r in rec if r["mode"] == "trainguard" and r["fault_step"] in group]
        for name, key in measures:
            b = [r[key] for r in base if r.get(key) is not None]
            o = [r[key] for r in ours if r.get(key) is not None]
            b_mean, o_mean = (statistics.mean(b) if b else None), (statistics.mean(o) if o else None)
            positive = b_mean is not None and o_mean is not None and b_mean > 0 and o_mean > 0
            ratio = f"{b_mean / o_mean:.1f}x faster" if positive and key != "lost_steps" else None
            rows.append({"measure": f"{label}: {name}", "baseline": b_mean, "trainguard": o_mean,
                         "unit": "steps" if key == "lost_steps" else "s", "result": ratio})
    return rows


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--dying-gasp", action="store_true", help="only part 3: the dying gasp, beside torch")
    args = parser.parse_args()
    if args.dying_gasp:
        dying_gasp(args)
        return
    s = QUICK if args.quick else FULL
    failures = {"plain": 0, "trainguard": 0}
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-mindspore-") as tmp:
        runs = fault_free(Path(tmp), s, failures)
        references = {"baseline": statistics.median(r["wall_s"] for r in runs if r["side"] == "plain"),
                      "trainguard": statistics.median(r["wall_s"] for r in runs if r["side"] == "trainguard")}
        rec = recovery(Path(tmp), s, references, failures)
    rng = random.Random(0)
    step, cpu = overhead(runs, "step_s", rng), overhead(runs, "cpu_s", rng)
    mean = lambda mode, key: statistics.mean(r[key] for r in rec if r["mode"] == mode)  # noqa: E731
    speedup = lambda key: mean("baseline", key) / mean("trainguard", key)  # noqa: E731
    hashes = {r["sha256"] for r in runs} | {r["sha256"] for r in rec}
    goals = [
        common.Goal("per-step overhead of the wrapper + Guard vs plain MindSpore (median steady-state step time)",
                    round(step["pct"], 3), 1.0, "%"),
        common.Goal("upper end of the 95% interval of that overhead", round(step["ci95"][1], 3), 1.0, "%"),
        common.Goal("retry after one UCE vs msrun relaunch + newest save_checkpoint: speed-up of fault -> "
                    "failed step done", round(speedup("fault_to_regained_s"), 2), 10.0, "x", higher_is_better=True),
        common.Goal("steps lost by trainguard (mean)", mean("trainguard", "lost_steps"), 0, "steps"),
    ]
    common.report("mindspore", side_by_side(step, cpu, rec, s), ["measure", "baseline", "trainguard", "unit", "result"],
                  goals, quick=args.quick, out=args.out, extra={
                      "mindspore": importlib.metadata.version("mindspore"),
                      "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "AVX2 (the example's default)"),
                      "nproc": NPROC, "batch_size": s.batch, "image_size": s.image, "steps_per_launch": s.steps,
                      "warmup_steps": s.warmup, "checkpoint_every_k": s.k, "launch_pairs": s.pairs,
                      "fault_positions": list(s.positions),
                      "bench_minutes": round((time.time() - began) / 60, 1),
                      "launches_failed_and_retried": failures,
                      "same_final_state_everywhere": len(hashes) == 1,
                      "overhead_step_time": step, "overhead_cpu_time": cpu,
                      "speedup_fault_to_resumed": round(speedup("fault_to_resumed_s"), 2),
                      "speedup_fault_to_next_step": round(speedup("fault_to_next_step_s"), 2),
                      "speedup_time_lost": round(speedup("time_lost_s"), 2),
                      "speedup_regained_if_msrun_teardown_were_free": round(
                          (mean("baseline", "fault_to_regained_s") - mean("baseline", "teardown_s"))
                          / mean("trainguard", "fault_to_regained_s"), 2),
                      "fault_free_launches": [{k: v for k, v in r.items() if k not in ("step_s", "cpu_s")}
                                              | {"median_step_s": statistics.median(r["step_s"]),
                                                 "median_cpu_s": statistics.median(r["cpu_s"])} for r in runs],
                      "recovery_runs": rec,
                  })


if __name__ == "__main__":
    main()
