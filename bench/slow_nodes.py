"""Slow-node detection on real runs, and what the markers cost.

1. **Detection.** Seeded trials per slowdown (1.3x and 1.1x, the fault
   injector's ``slow`` kind: from the onset on, the rank sleeps 0.3 or 0.1 of
   each step's duration): ``trainguard run`` of ``tests/workers/profiled_train.py``
   on 2 CPU ranks with every marker on, Communication included. The seed picks
   the slow rank and the onset step (30..60); the job runs 110 steps past it.
   ``trainguard slow-nodes`` then gives the verdict: a true positive names the
   slow rank within the limit (10 / 100 steps after the onset), anything else
   named is a false positive. The live check beside the controller
   (``slow_nodes.json``) is scored the same way. Each step sleeps 75 ms
   beside ~25 ms of CPU work, standing for device time (the host waits for
   its accelerator).
2. **False positives**: one run of 10,000 steps with no slow rank, same setup.
3. **CPU only** (reported, no goal): the same without the device-time sleep
   (~26 ms steps, all of it CPU on two shared cores) -- the noise floor of
   this machine: one rank's compute drifts 20% from the other's for seconds
   with nothing slow.
4. **Overhead** on the ResNet-50 example's model and loop (2 ranks; the
   benchmarks' ``_resnet_worker.py``, the example without hydra): one
   ``trainguard run`` whose Guard has everything on (Communication included)
   and everything off in turn, 4 steps each, switched in process at the step
   boundary; rank 0's step times (wall, and CPU of the whole process) in the
   last 2 steps of each block, each on-block against the off-blocks beside
   it (the same machine state), median over blocks. Also the cost per
   record, timed in process.

usage: python bench/slow_nodes.py [--quick] [--keep DIR]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "profiled_train.py"
RESNET_WORKER = ROOT / "bench" / "_resnet_worker.py"
ALL_ON = '{"CommunicationOperator":"on","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'
LIMIT = {1.3: 10, 1.1: 100}
DEVICE_TIME = {"PROF_WIDTH": "1024", "PROF_SLEEP": "0.075"}
CPU_ONLY = {"PROF_WIDTH": "1024", "PROF_SLEEP": "0"}


def launch(tmp: Path, tag: str, steps: int, env: dict, fault: str | None) -> Path:
    """One profiled job; returns its profiling job directory."""
    prof = tmp / tag / "prof"
    prof.mkdir(parents=True)
    (prof / "profilingSwitch").write_text(ALL_ON)
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update(env, TRAINGUARD_PROFILING_DIR=str(prof), TRAINGUARD_JOB_ID=tag)
    if fault:
        full["TRAINGUARD_FAULT"] = fault
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", str(WORKER), str(steps),
           str(tmp / tag / "report.json"), str(tmp / tag / "ckpt")]
    out = subprocess.run(cmd, env=full, cwd=tmp, capture_output=True, text=True, timeout=7200)
    if out.returncode:
        raise RuntimeError(f"{tag} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    return prof / tag


def verdict(job_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "slow-nodes", str(job_dir), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def score(named: dict[int, int], slow: int, onset: int, limit: int) -> tuple[int, int, int | None]:
    """(true positives, false positives, latency) of one trial from {rank: step named}."""
    tp = int(slow in named and onset <= named[slow] <= onset + limit)
    fp = sum(1 for r, s in named.items() if r != slow or s < onset)
    return tp, fp, (named[slow] - onset if slow in named else None)


def trials(tmp: Path, factor: float, count: int, env: dict, label: str) -> dict:
    outcome = {"tp": 0, "fp": 0, "live_tp": 0, "live_fp": 0, "latency": [], "trials": []}
    for seed in range(count):
        rnd = random.Random(f"{factor}-{seed}")
        slow, onset = rnd.randrange(2), rnd.randrange(30, 61)
        job = launch(tmp, f"{label}-{factor}-{seed}", onset + 110, env, f"slow:rank={slow},step={onset},factor={factor}")
        result = verdict(job)
        named = {f["rank"]: f["step"] for f in result["findings"] if f["rank"] is not None}
        tp, fp, latency = score(named, slow, onset, LIMIT[factor])
        live_file = job / "slow_nodes.json"
        live = json.loads(live_file.read_text()) if live_file.exists() else {"findings": []}
        live_named = {f["rank"]: f["step"] for f in live["findings"] if f["rank"] is not None}
        ltp, lfp, _ = score(live_named, slow, onset, LIMIT[factor])
        outcome["tp"] += tp
        outcome["fp"] += fp
        outcome["live_tp"] += ltp
        outcome["live_fp"] += lfp
        if latency is not None:
            outcome["latency"].append(latency)
        outcome["trials"].append({"seed": seed, "slow": slow, "onset": onset, "named": named, "live": live_named,
                                  "how": [f["how"] for f in result["findings"]]})
        print(f"  {label} {factor}x seed {seed}: slow rank {slow} from step {onset}; named {named} "
              f"(live {live_named})", file=sys.stderr)
    n = count
    outcome["precision"] = outcome["tp"] / (outcome["tp"] + outcome["fp"]) if outcome["tp"] + outcome["fp"] else None
    outcome["recall"] = outcome["tp"] / n
    outcome["live_recall"] = outcome["live_tp"] / n
    outcome["live_precision"] = (outcome["live_tp"] / (outcome["live_tp"] + outcome["live_fp"])
                                 if outcome["live_tp"] + outcome["live_fp"] else None)
    return outcome


def quiet(tmp: Path, steps: int, env: dict, label: str) -> dict:
    job = launch(tmp, f"{label}-quiet", steps, env, None)
    result = verdict(job)
    live_file = job / "slow_nodes.json"
    live = json.loads(live_file.read_text())["slow_ranks"] if live_file.exists() else []
    return {"steps": result["steps"], "named": result["slow_ranks"], "live_named": live,
            "findings": result["findings"], "per_rank": result["per_rank"]}


def overhead(tmp: Path, steps: int) -> dict:
    """The ResNet-50 example's model and loop (``bench/_resnet_worker.py --mode markers``) under the Guard,
    markers all on for even steps and off for odd ones; rank 0's step times, each odd step against the
    two beside it."""
    timeline, prof = tmp / "markers.jsonl", tmp / "markers-prof"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_JOB_ID"] = "markers"
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           str(RESNET_WORKER), "--mode", "markers", "--steps", str(steps), "--timeline", str(timeline),
           "--ckpt", str(tmp / "markers-ckpt"), "--profiling-dir", str(prof)]
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=7200)
    if out.returncode:
        raise RuntimeError(f"markers run failed:\n{(out.stdout + out.stderr)[-3000:]}")
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    steps_ = [e for e in events if e.get("event") == "step" and e["step"] > 8]  # warm-up left out
    # Blocks of 4 steps; the first two of each are left out (switching installs or removes hooks).
    blocks: dict[int, dict] = {}
    for e in steps_:
        index = e["step"] - 1
        if index % 4 >= 2:
            b = blocks.setdefault(index // 4, {"on": e["markers"], "wall": [], "cpu": []})
            b["wall"].append(e["seconds"])
            b["cpu"].append(e["cpu_seconds"])
    ratios = {"wall": [], "cpu": []}
    for n, b in sorted(blocks.items()):
        beside = [blocks[m] for m in (n - 1, n + 1) if m in blocks and not blocks[m]["on"]]
        if b["on"] and beside:
            for kind in ratios:
                ratios[kind].append(statistics.fmean(b[kind]) / statistics.fmean(x for o in beside for x in o[kind]))
    recs = [json.loads(line) for p in sorted((prof / "markers" / "0").iterdir()) if p.name.isdigit()
            for line in p.read_text().splitlines()]
    on = [e["seconds"] for e in steps_ if e["markers"]]
    off = [e["seconds"] for e in steps_ if not e["markers"]]
    n_on = max(1, sum(r["name"] == "Step" for r in recs))
    wall, cpu = ratios["wall"], ratios["cpu"]
    return {"pairs": len(wall), "ratio_median": statistics.median(wall) if wall else None,
            "cpu_ratio_median": statistics.median(cpu) if cpu else None,
            "ratio_mean": statistics.fmean(wall) if wall else None,
            "on_median_s": statistics.median(on), "off_median_s": statistics.median(off),
            "records_per_step": round(len(recs) / n_on, 2),
            "communication_per_step": round(sum(r["name"] == "Communication" for r in recs) / n_on, 2),
            "ratios": [round(r, 4) for r in wall], "cpu_ratios": [round(r, 4) for r in cpu]}


def record_cost(n: int = 200_000) -> dict:
    """In-process cost of one marker record: the hot-path add, and the writer's formatting and write."""
    from trainguard.core.profiling import ProfilingConfig, Recorder

    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(ProfilingConfig(directory=Path(d), switch_path=Path(d) / "none", job_id="j", rank=0))
        t = time.perf_counter()
        for i in range(n):
            start = time.time()
            rec.add("Communication", i, start, time.time() - start, {"op": "allreduce", "group": "0", "bytes": 4})
        add = (time.perf_counter() - t) / n
        t = time.perf_counter()
        rec.flush()
        write = (time.perf_counter() - t) / n
    return {"add_us": add * 1e6, "write_us": write * 1e6}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, default=None, help="keep every job's records here (to analyse again)")
    args = p.parse_args()
    quick = args.quick
    n_trials, quiet_steps = (3, 1000) if quick else (20, 10_000)
    rows, goals, extra = [], [], {}
    with tempfile.TemporaryDirectory(prefix="tg-slow-") as d:
        tmp = Path(d)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        for factor in (1.3, 1.1):
            r = trials(tmp, factor, n_trials, DEVICE_TIME, "device")
            extra[f"trials_{factor}"] = r
            lat = r["latency"]
            rows.append({"measure": f"{factor}x slow rank", "setup": "100 ms steps (75 ms device time)",
                         "trials": n_trials, "precision": r["precision"], "recall": r["recall"],
                         "live_recall": r["live_recall"], "latency_steps": max(lat) if lat else None,
                         "note": f"latency median {statistics.median(lat) if lat else '-'}, max shown; "
                                 f"live precision {r['live_precision']}"})
            goals.append(common.Goal(f"{factor}x: slow rank named within {LIMIT[factor]} steps, recall", r["recall"],
                                     1.0, "", True))
            goals.append(common.Goal(f"{factor}x: precision", r["precision"], 1.0, "", True))
        q = quiet(tmp, quiet_steps, DEVICE_TIME, "device")
        extra["quiet"] = q
        rows.append({"measure": "no slow rank", "setup": "100 ms steps (75 ms device time)", "trials": 1,
                     "precision": None, "recall": None, "latency_steps": None,
                     "note": f"{q['steps']} steps; ranks named {q['named']} (live {q['live_named']})"})
        goals.append(common.Goal(f"false positives over {quiet_steps} steps with no slow rank",
                                 len(q["named"]) + len(q["live_named"]), 0, "ranks"))
        if not quick:
            for factor in (1.3, 1.1):
                r = trials(tmp, factor, 10, CPU_ONLY, "cpu")
                extra[f"cpu_only_trials_{factor}"] = r
                rows.append({"measure": f"{factor}x slow rank", "setup": "CPU only, ~26 ms steps", "trials": 10,
                             "precision": r["precision"], "recall": r["recall"], "live_recall": r["live_recall"],
                             "latency_steps": max(r["latency"]) if r["latency"] else None, "note": "no goal"})
            q = quiet(tmp, 2000, CPU_ONLY, "cpu")
            extra["cpu_only_quiet"] = q
            rows.append({"measure": "no slow rank", "setup": "CPU only, ~26 ms steps", "trials": 1,
                         "note": f"{q['steps']} steps; ranks named {q['named']} (live {q['live_named']}); no goal"})
        o = overhead(tmp, 40 if quick else 240)
        extra["overhead"] = o
        cost = record_cost()
        extra["record_cost"] = cost
        pct = None if o["ratio_median"] is None else 100 * (o["ratio_median"] - 1)
        rows.append({"measure": "marker overhead", "setup": "ResNet-50 example, 2 ranks",
                     "trials": o["pairs"], "note": f"on {o['on_median_s']:.3f} s/step vs off {o['off_median_s']:.3f}; "
                     f"CPU ratio {o['cpu_ratio_median']}; "
                     f"{o['records_per_step']} records/step ({o['communication_per_step']} collectives); "
                     f"per record {cost['add_us']:.2f} us add + {cost['write_us']:.2f} us write"})
        goals.append(common.Goal("marker overhead, all on vs off (median over on-steps of step / mean of the "
                                 "off-steps beside it)", pct, 0.5, "%"))
        per_step = o["records_per_step"] * (cost["add_us"] + cost["write_us"]) * 1e-6
        extra["overhead_from_record_cost_pct"] = (100 * per_step / o["on_median_s"]) if o["on_median_s"] else None
    common.report("slow_nodes", rows, ["measure", "setup", "trials", "precision", "recall", "live_recall",
                                       "latency_steps", "note"], goals, quick=quick, out=args.out, extra=extra)


if __name__ == "__main__":
    main()
