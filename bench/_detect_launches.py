"""One launch of each kind that ``bench/detect.py`` measures, and how its
number is read: :func:`guard_case` runs ``trainguard run`` with a case's fault
and reads the detection latency from the recovery record and the fault log,
:func:`torchrun_case` runs plain ``torchrun`` with rank 1 killed or stopped
and reads when the survivor noticed, and :func:`cost_run` runs with the
watchdog on or off and reads each rank's CPU per thread group. The cases,
their bounds (:func:`bound_s`) and the settings every launch shares live
here too; ``bench/detect.py`` plans the runs and writes the table."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainguard.core import CheckpointStore
from trainguard.core.faults import read_fault_log

WORKER = Path(__file__).resolve().parent / "_detect_worker.py"
NPROC = 2
STEP_SLEEP = 0.2
FAULT_STEP = 4
STEPS = 7
POLL_S = 0.25  # the watchdog's poll (WatchdogConfig.poll_s)
KILL_TARGET_S = 1.0

#: case -> (fault spec, what detects it, median steps a rank may go without progress before the alarm)
CASES = {
    "kill": (f"crash:rank=1,step={FAULT_STEP}", "its control session breaks or its agent sees the exit", 0),
    "stop": (f"stop:rank=1,step={FAULT_STEP}", "its agent finds it in state T twice, 0.3 s apart", 3),
    "hang": (f"hang:rank=1,step={FAULT_STEP},phase=forward", "its watchdog: no step within the limit", 3),
    "stall": (f"stall:rank=1,step={FAULT_STEP},phase=backward",
              "a watchdog: in a collective past 6 median steps", 6),
}


class LaunchFailed(RuntimeError):
    pass


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _step_s(out: Path, before: int) -> float:
    """Median step time of rank 0 before step ``before`` (the first step,
    which includes setup, left out)."""
    steps = [e["seconds"] for e in _lines(out / "timeline-0.jsonl") if 1 < e["step"] <= before]
    return statistics.median(steps)


def bound_s(case: str, step_s: float) -> float:
    """The detection bound of a case for a median step of ``step_s``.

    The watchdog checks every poll, so a loop hung outside a collective is
    reported within ``max(3 x median step, 2 s)`` plus a poll. Inside a
    collective the limit is ``max(6 x median step, 2 s)`` plus a poll (which
    gives a culprit that can still speak a poll's head start to name itself),
    and the check adds up to one more poll.
    """
    if case == "kill":
        return KILL_TARGET_S
    polls = 2 if case == "stall" else 1
    return max(CASES[case][2] * step_s, 2.0) + polls * POLL_S


def guard_case(case: str, step_sleep: float, out: Path) -> dict:
    """One ``trainguard run`` launch with the case's fault; its detection latency."""
    spec, _, _ = CASES[case]
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(NPROC), "--monitor-interval",
           "0.1", str(WORKER), "--mode", "guard", "--steps", str(STEPS), "--out", str(out),
           "--step-sleep", str(step_sleep)]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=_env(TRAINGUARD_FAULT=spec), capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, 75):  # 75: stopped after a dying-gasp checkpoint
        raise LaunchFailed(f"{case}: rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    (strike,) = read_fault_log(out / "ckpt" / ".trainguard" / "faults.jsonl")
    if (out / "report.json").exists():  # finished (an in-place retry)
        records = json.loads((out / "report.json").read_text())["recoveries"]
    else:  # stopped after a dump: the records are in the checkpoint's manifest
        found = CheckpointStore(out / "ckpt").latest()
        records = found.manifest["meta"]["history"]["records"] if found else []
    if not records:
        raise LaunchFailed(f"{case}: rc={proc.returncode} but no recovery record\n{proc.stderr[-3000:]}")
    first = records[0]
    step_s = _step_s(out, FAULT_STEP)
    return {"side": "trainguard", "case": case, "step_sleep": step_sleep, "rc": proc.returncode,
            "detect_s": first["detected_at"] - strike["time"], "step_s": step_s, "bound_s": bound_s(case, step_s),
            "fault": first["fault"], "rank": first["rank"], "strategy": first["strategy"],
            "message": first["message"][:200], "records": len(records), "launch_s": time.monotonic() - start}


def torchrun_case(case: str, out: Path, timeout_s: float | None) -> dict:
    """One plain ``torchrun`` launch whose rank 1 is killed or stopped."""
    step_sleep, fault_step = (1.0, 3) if case == "kill" else (STEP_SLEEP, FAULT_STEP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--monitor-interval",
           "0.1", str(WORKER), "--mode", "plain", "--steps", str(fault_step + 3), "--out", str(out),
           "--step-sleep", str(step_sleep), "--fault", case, "--fault-step", str(fault_step)]
    if timeout_s is not None:
        cmd += ["--pg-timeout-s", str(timeout_s)]
    start = time.monotonic()
    deadline = start + 120 + (timeout_s or 0)
    released = False
    with (out.parent / f"{out.name}.log").open("w+") as log:
        proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise LaunchFailed(f"torchrun {case}: no end within {deadline - start:.0f} s")
            if case == "stop" and not released and any(e["event"] == "error"
                                                       for e in _lines(out / "events-0.jsonl")):
                # Detected; torchrun would now wait 30 s for the stopped rank to take its SIGTERM.
                (strike,) = _lines(out / "faults.jsonl")
                try:
                    os.kill(strike["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                released = True
            time.sleep(0.2)
        log.seek(0)
        text = log.read()
    (strike,) = _lines(out / "faults.jsonl")
    events = _lines(out / "events-0.jsonl")
    want = "sigterm" if case == "kill" else "error"
    seen = [e for e in events if e["event"] == want]
    if not seen:
        raise LaunchFailed(f"torchrun {case}: rank 0 recorded no {want} (events {events})\n{text[-3000:]}")
    row = {"side": "torchrun", "case": case, "step_sleep": step_sleep, "rc": proc.returncode,
           "detect_s": seen[0]["t"] - strike["time"], "step_s": _step_s(out, fault_step), "timeout_s": timeout_s,
           "launch_s": time.monotonic() - start}
    if case == "stop":
        row["error"] = seen[0]["error"][:200]
    return row


def cost_run(watchdog: bool, window_s: float, out: Path) -> list[dict]:
    """One launch with the watchdog on or off: per rank CPU of its threads
    over ``window_s`` of steady training."""
    warmup = 5
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(NPROC), "--monitor-interval",
           "0.1", str(WORKER), "--mode", "guard", "--steps", str(warmup + round(window_s / STEP_SLEEP)),
           "--out", str(out), "--step-sleep", str(STEP_SLEEP), "--measure-from", str(warmup)]
    env = _env(**({} if watchdog else {"TRAINGUARD_WATCHDOG": "off"}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300 + window_s)
    if proc.returncode != 0:
        raise LaunchFailed(f"cost run rc={proc.returncode}\n{proc.stderr[-3000:]}")
    rows = []
    for rank in range(NPROC):
        got = json.loads((out / f"cpu-{rank}.json").read_text())
        if got["watchdog"] is not watchdog:
            raise RuntimeError(f"asked for watchdog={watchdog}, rank {rank} ran with {got['watchdog']}")
        groups = {"main": 0.0, "processor": 0.0, "grpc": 0.0, "other": 0.0}
        for t in got["threads"]:
            label = t["label"]
            if label == "main":
                group = "main"
            elif label.startswith("py:"):  # trainguard's processor thread and its gRPC session's threads
                group = "processor"
            elif any(k in label for k in ("grpc", "event_engine", "lifeguard", "executor", "resolver")):
                group = "grpc"
            else:  # gloo, torch
                group = "other"
            groups[group] += t["cpu_s"]
        pct = {g: 100 * s / got["wall_s"] for g, s in groups.items()}
        rows.append({"watchdog": watchdog, "rank": rank, "wall_s": got["wall_s"],
                     **{f"{g}_pct": v for g, v in pct.items()},
                     "trainguard_pct": pct["processor"] + pct["grpc"], "threads": got["threads"]})
    return rows
