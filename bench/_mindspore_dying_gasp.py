"""Part 3 of ``bench/mindspore.py`` (``--dying-gasp``, a run of its own): a
lost worker's dying-gasp checkpoint under MindSpore beside torch
(:func:`dying_gasp_once`), and ``tests/workers/ms_collective_probe.py``
trying each way out of a collective with a lost peer (:func:`release_probe`);
:func:`dying_gasp` runs both and writes
``bench/results/mindspore-dying-gasp.json``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from _mindspore_launch import LAUNCH_TIMEOUT_S, NPROC, free_port

WORKERS = Path(__file__).resolve().parent.parent / "tests" / "workers"
DYING_GASP_FAULT = "crash:rank=1,step=3,phase=backward"
#: Lost once the vote passed: the survivor waits in the gradient all-reduce, a jit-compiled graph
#: (DistributedGradReducer), whose failure MindSpore raises only after a fixed 3 s wait.
IN_GRAPH_FAULT = "crash:rank=1,step=3,phase=reduce"


def dying_gasp_once(tmp: Path, framework: str, comm_timeout_s: int | None = None,
                    fault: str = DYING_GASP_FAULT) -> dict:
    """One job whose rank 1 is lost at step 3: fault -> dump finalised, and the command's wall time."""
    name = f"{framework}-{comm_timeout_s or 'default'}-{fault.rsplit('=', 1)[-1]}"
    ckpt, report = tmp / f"{name}-ckpt", tmp / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_"))}
    env.update({"TRAINGUARD_FAULT": fault, "TRAINGUARD_STRATEGIES": "dump,exit",
                "TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "PYTHONUNBUFFERED": "1",
                "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    if framework == "mindspore":
        env.update({"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"})
        if comm_timeout_s is not None:
            env["MS_CPU_COMM_OP_TIMEOUT"] = str(comm_timeout_s)
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--framework", "mindspore", f"--worker_num={NPROC}",
               f"--local_worker_num={NPROC}", f"--master_port={free_port()}", "--join=True",
               f"--log_dir={tmp / (name + '-logs')}", str(WORKERS / "ms_train.py"), "6", str(report), str(ckpt)]
        tracker = ckpt / "latest_tft_step.txt"
    else:
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(NPROC), "--monitor-interval",
               "0.1", str(WORKERS / "tiny_train.py"), "6", str(report), str(ckpt), "0"]
        tracker = ckpt / "latest_step.txt"
    started = time.time()
    done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                          start_new_session=True)
    wall = time.time() - started
    faults = [json.loads(line) for line in (ckpt / ".trainguard" / "faults.jsonl").read_text().splitlines()
              if line.strip()] if (ckpt / ".trainguard" / "faults.jsonl").exists() else []
    if done.returncode != 75 or not faults or not tracker.exists():
        raise RuntimeError(f"{name}: exit {done.returncode}, expected 75 and a dump; log tail:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return {"framework": framework, "comm_timeout_s": comm_timeout_s, "fault": fault, "fault_to_dump_s":
            round(tracker.stat().st_mtime - faults[0]["time"], 3), "command_s": round(wall, 2)}


PROBE_WAYS = ("read", "direct", "finalize", "release", "destroy", "async")


def release_probe(tmp: Path, how: str, comm_timeout_s: int = 10) -> list[dict]:
    """``tests/workers/ms_collective_probe.py`` with ``HOW=how``: a scheduler
    and two workers as msrun starts them; rank 0's ``PROBE`` lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_"))}
    env.update({"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(free_port()), "MS_WORKER_NUM": "2",
                "MS_CPU_COMM_OP_TIMEOUT": str(comm_timeout_s), "MS_RETRY_INTERVAL_LOWER": "1",
                "MS_RETRY_INTERVAL_UPPER": "1", "GLOG_v": "3", "HOW": how})
    script = str(WORKERS / "ms_collective_probe.py")
    logs = {name: open(tmp / f"probe-{how}-{name}.log", "w") for name in ("sched", "r0", "r1")}
    procs = [subprocess.Popen([sys.executable, script], env=dict(env, MS_ROLE=role, **extra), stdout=logs[name],
                              stderr=subprocess.STDOUT, cwd=tmp)
             for name, role, extra in (("sched", "MS_SCHED", {}), ("r0", "MS_WORKER", {"MS_NODE_ID": "0"}),
                                       ("r1", "MS_WORKER", {"MS_NODE_ID": "1"}))]
    try:
        procs[1].wait(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for f in logs.values():
            f.close()
    text = (tmp / f"probe-{how}-r0.log").read_text(errors="replace")
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("PROBE ")]


def dying_gasp(args) -> None:
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-ms-gasp-") as tmp:
        runs = [dying_gasp_once(Path(tmp), "torch"), dying_gasp_once(Path(tmp), "mindspore"),
                dying_gasp_once(Path(tmp), "mindspore", 5), dying_gasp_once(Path(tmp), "mindspore", 5, IN_GRAPH_FAULT)]
        probes = {how: release_probe(Path(tmp), how) for how in PROBE_WAYS}
    torch_run, ms_run, ms_short, ms_graph = runs
    rows = [
        {"measure": "fault -> dying-gasp checkpoint finalised", "torch": torch_run["fault_to_dump_s"],
         "mindspore": ms_run["fault_to_dump_s"], "mindspore, MS_CPU_COMM_OP_TIMEOUT=5": ms_short["fault_to_dump_s"],
         "unit": "s"},
        {"measure": "whole command (start to exit 75)", "torch": torch_run["command_s"],
         "mindspore": ms_run["command_s"], "mindspore, MS_CPU_COMM_OP_TIMEOUT=5": ms_short["command_s"],
         "unit": "s"},
        {"measure": "  lost in the gradient all-reduce (phase=reduce, a compiled graph): fault -> finalised",
         "mindspore, MS_CPU_COMM_OP_TIMEOUT=5": ms_graph["fault_to_dump_s"], "unit": "s",
         "note": "MindSpore's GraphScheduler::Run waits a fixed 3 s (kTimeToWait) after a failed graph"},
    ]
    for how, events in probes.items():  # when the collective and the releasing call returned, 10 s timeout
        ended = next((e for e in events if e["event"].startswith("collective")), {})
        call = [e for e in events if e["event"] in ("returned", "raised", "parameter read")]
        rows.append({"measure": f"release probe '{how}': collective left after (timeout 10 s)",
                     "mindspore": ended.get("t"), "unit": "s",
                     "note": "; ".join(f"{e['event']} at {e['t']} s" + (f" ({e['error']})" if "error" in e else "")
                                        for e in call) or None})
    goals = [common.Goal("MindSpore: fault -> dying-gasp checkpoint (default collective timeout)",
                         ms_run["fault_to_dump_s"], 2.0, "s"),
             common.Goal("torch: fault -> dying-gasp checkpoint", torch_run["fault_to_dump_s"], 2.0, "s")]
    common.report("mindspore-dying-gasp", rows, ["measure", "torch", "mindspore",
                                                 "mindspore, MS_CPU_COMM_OP_TIMEOUT=5", "unit", "note"],
                  goals, quick=False, out=args.out, extra={
                      "mindspore": importlib.metadata.version("mindspore"), "nproc": NPROC,
                      "fault": DYING_GASP_FAULT, "in_graph_fault": IN_GRAPH_FAULT, "strategies": "dump,exit",
                      "mindspore_default_comm_timeout_s":
                          "15 (trainguard's msrun, when MS_CPU_COMM_OP_TIMEOUT is unset)",
                      "what_bounds_it": "the survivor waits in a MindSpore CPU collective with the lost rank until "
                                        "MS_CPU_COMM_OP_TIMEOUT; nothing in MindSpore 2.10 releases it sooner "
                                        "(docs/mindspore.md, 'Why a dying gasp takes the collective timeout')",
                      "release_probe": {"script": "tests/workers/ms_collective_probe.py",
                                        "comm_timeout_s": 10, "events": probes},
                      "runs": runs, "bench_minutes": round((time.time() - began) / 60, 1)})
