"""Recovery after one device memory error: trainguard vs what users have today.

Side by side, on the ResNet-50 example (2 CPU ranks, gloo), for several
positions of the fault inside a checkpoint interval of K steps:

* **baseline**: ``torchrun --max-restarts 1`` with a ``torch.save``
  checkpoint every K steps; the error kills rank 1, torchrun restarts every
  process and they reload the newest checkpoint (with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which torch 2.13's
  restarted workers hang on the previous attempt's store keys);
* **trainguard**: ``trainguard run`` with the default strategies; the
  error is repaired in place.

A second pair strikes a process kill (SIGKILL) instead and makes
trainguard take its slowest way back, a dying gasp (``--strategies
dump,exit``, snapshots in memory every step): the launcher restarts the
group itself in warm standby processes, which resume from memory.

Measured from the job's own timeline (rank 0 writes a line per completed
step; the fault's time comes from the fault log): the time from the fault
until training runs again (relaunched processes ready, or the failed step
restarted in place), to the next completed step (the goal's measure: it
includes computing the failed step again, which both sides must do), and
until training is back at the step it had reached; and the completed steps
lost (steps that had to be computed again). And the time lost: the
faulted launch's wall time minus a fault-free launch's of the same steps
(measured beside it), against torchrun's: what a fault costs the job,
whatever it spends the time on.

usage: python bench/recovery.py [--quick]
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


class LaunchFailed(RuntimeError):
    pass


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_one(mode: str, fault_step: int, steps: int, save_every: int, size: dict, tmp: Path, *,
            fault: str | None = "uce", strategies: str | None = None, launcher_args: tuple = (),
            env_extra: dict | None = None) -> dict:
    """One launch with one fault on rank 1 at ``fault_step`` (``uce``: a
    device memory error; ``crash``: SIGKILL), timed from the job's timeline."""
    timeline, ckpt, fault_log = tmp / f"{mode}.timeline", tmp / f"{mode}-ckpt", tmp / f"{mode}.faults"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(env_extra or {})
    args = [str(WORKER), "--mode", mode, "--steps", str(steps), "--timeline", str(timeline), "--ckpt", str(ckpt),
            "--save-every", str(save_every), "--batch-size", str(size["batch"]), "--image-size", str(size["image"])]
    if mode == "plain":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1"]
        if fault is not None:
            args += ["--fault-step", str(fault_step)]
            env["BENCH_FAULT_LOG"] = str(fault_log)
            env["BENCH_FAULT_KIND"] = fault
        # torch 2.13's c10d rendezvous shares one store across restart rounds and
        # restarted workers hang on the previous attempt's keys; this documented
        # opt-out is what a torchrun user has to set for --max-restarts to work.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        cmd = [sys.executable, "-m", "trainguard.cli", "run"]
        if fault is not None:
            env["TRAINGUARD_FAULT"] = f"{fault}:rank=1,step={fault_step},phase=backward"
        if strategies:
            env["TRAINGUARD_STRATEGIES"] = strategies
        fault_log = ckpt / ".trainguard" / "faults.jsonl"
    cmd += ["--nproc-per-node", str(NPROC), "--monitor-interval", "0.1", *launcher_args, *args]
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise LaunchFailed(f"{mode} run failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    if fault is None:
        return {"mode": "baseline" if mode == "plain" else "trainguard", "steps": steps, "wall_s": wall}
    (fault,) = [e for e in _events(fault_log) if e.get("event", "fault") == "fault" or "spec" in e]
    t_fault = fault["time"] if "time" in fault else fault["t"]
    events = _events(timeline)
    after = [e for e in events if e["event"] == "step" and e["t"] > t_fault]
    first = after[0]
    # When training was running again: the relaunched processes were ready, or
    # (in place) the redone step started.
    ready = [e["t"] for e in events if e["event"] == "ready" and e["t"] > t_fault]
    resumed = ready[0] if ready else first["t"] - first["seconds"]
    regained = next(e for e in after if e["step"] >= fault_step + 1)
    step_s = statistics.median(e["seconds"] for e in _events(timeline) if e["event"] == "step")
    return {
        "mode": "baseline" if mode == "plain" else "trainguard",
        "fault_step": fault_step,
        "fault_to_resumed_s": resumed - t_fault,
        "fault_to_next_step_s": first["t"] - t_fault,
        "fault_to_regained_s": regained["t"] - t_fault,
        "lost_steps": fault_step - (first["step"] - 1),
        "restarted": len({e["pid"] for e in _events(timeline)}) > 1,
        "step_s": step_s,
        "wall_s": wall,
    }


#: The two fault pairs: a device memory error under the defaults, and a
#: process kill that trainguard must answer with a dump (the group
#: restarted by the launcher from memory).
SCENARIOS = {
    "uce": {"fault": "uce"},
    "crash-dump": {"fault": "crash", "strategies": "dump,exit", "env_extra": {"BENCH_SNAPSHOT_EVERY": "1"}},
}


def _launch(mode: str, fault_step: int, k: int, size: dict, tmp: Path, failures: dict, **fault) -> dict:
    """One launch (``fault=None``: fault-free), retried up to three times
    when it fails outright (counted)."""
    side = "baseline" if mode == "plain" else "trainguard"
    for attempt in range(3):
        run_dir = tmp / f"{mode}-{fault_step}-{fault.get('fault')}-{attempt}"
        run_dir.mkdir()
        try:
            return run_one(mode, fault_step, fault_step + 2, k, size, run_dir, **fault)
        except LaunchFailed as e:
            failures[side] += 1
            print(f"launch failed, retrying: {str(e)[-1500:]}", file=sys.stderr)
    raise RuntimeError(f"{mode} failed three times at fault step {fault_step}")


def run_positions(quick: bool, scenario: str) -> tuple[list[dict], dict, int, dict]:
    """Both modes at each fault position of a K-step checkpoint interval,
    each beside its fault-free launch of the same steps (the time lost is
    the difference). Returns rows, failures, K and size."""
    k = 4 if quick else 10
    positions = [k + k // 2] if quick else [k + 2, k + 5, k + 8]
    size = {"batch": 4, "image": 16} if quick else {"batch": 8, "image": 32}
    rows, failures = [], {"baseline": 0, "trainguard": 0}
    fault = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory() as tmp:
        for fault_step in positions:
            for mode in ("plain", "guard"):
                clean = _launch(mode, fault_step, k, size, Path(tmp), failures, **{**fault, "fault": None})
                row = _launch(mode, fault_step, k, size, Path(tmp), failures, **fault)
                row.update(scenario=scenario, fault_free_wall_s=clean["wall_s"],
                           time_lost_s=row["wall_s"] - clean["wall_s"])
                rows.append(row)
                print(rows[-1], file=sys.stderr)
    return rows, failures, k, size


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--cold", action="store_true", help="trainguard without warm standby processes "
                                                        "(TRAINGUARD_STANDBY=off): the before of the warm restarts")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args()
    if args.cold:
        for fault in SCENARIOS.values():
            fault["env_extra"] = {**fault.get("env_extra", {}), "TRAINGUARD_STANDBY": "off"}
    rows, failures, k, size = [], {}, 0, {}
    for scenario in args.scenarios.split(","):
        got, failed, k, size = run_positions(args.quick, scenario)
        rows += got
        failures[scenario] = failed
    mean = lambda rs, key: statistics.mean(r[key] for r in rs)  # noqa: E731
    pick = lambda side, sc: [r for r in rows if r["mode"] == side and r["scenario"] == sc]  # noqa: E731
    base, ours = pick("baseline", "uce"), pick("trainguard", "uce")
    dbase, dours = pick("baseline", "crash-dump"), pick("trainguard", "crash-dump")
    if not (base and dbase):  # a partial run (--scenarios): the table only
        common.report("recovery", rows, list(rows[0]), [], quick=args.quick, out=args.out,
                      extra={"cold": args.cold, "load_average": os.getloadavg()})
        return
    speedup = mean(base, "fault_to_next_step_s") / mean(ours, "fault_to_next_step_s")
    goals = [
        common.Goal("time lost to one UCE (faulted minus fault-free wall time), trainguard / torchrun restart",
                    round(mean(ours, "time_lost_s") / mean(base, "time_lost_s"), 3), 0.1, "x"),
        common.Goal("recovery after one UCE, speed-up of fault -> next completed step vs torchrun restart "
                    "(the earlier measure: bounded by the redone step)",
                    round(speedup, 2), 10.0, "x", higher_is_better=True),
        common.Goal("crash -> dump -> training back where it was, trainguard (group restarted warm by the "
                    "launcher) / torchrun restart", round(mean(dours, "fault_to_regained_s")
                                                          / mean(dbase, "fault_to_regained_s"), 3), 0.5, "x"),
        common.Goal("steps lost by trainguard (mean)", mean(ours + dours, "lost_steps"), 0, "steps"),
    ]
    common.report("recovery", rows, ["scenario", "mode", "fault_step", "fault_to_resumed_s", "fault_to_next_step_s",
                                     "fault_to_regained_s", "lost_steps", "time_lost_s", "wall_s",
                                     "fault_free_wall_s", "restarted", "step_s"], goals, quick=args.quick,
                  out=args.out,
                  extra={"checkpoint_every_k": k, "nproc": NPROC, "image_size": size["image"],
                         "launches_failed_and_retried": failures,
                         "batch_size": size["batch"],
                         "baseline_mean_lost_steps": mean(base, "lost_steps"),
                         "speedup_fault_to_resumed": round(mean(base, "fault_to_resumed_s")
                                                           / mean(ours, "fault_to_resumed_s"), 2),
                         "speedup_fault_to_regained": round(mean(base, "fault_to_regained_s")
                                                            / mean(ours, "fault_to_regained_s"), 2),
                         "time_lost_ratio_crash_dump": round(mean(dours, "time_lost_s")
                                                             / mean(dbase, "time_lost_s"), 3),
                         "cold": args.cold, "load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
