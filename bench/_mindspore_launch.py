"""Launching ``bench/mindspore.py``'s jobs: one launch of the MindSpore
ResNet-50 example on 2 msrun workers, under ``trainguard run --framework
mindspore`` (the Guard) or plain msrun, in a directory of its own that
relaunching reuses (:func:`launch`); what the launch left there (rank 0's
timeline, the fault log); and a launch tried again when it failed to start
(:func:`attempts`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "resnet50" / "train_mindspore.py"
NPROC = 2
LAUNCH_TIMEOUT_S = 300  # a launch takes 1-2 min; one whose worker died at start waits forever


@dataclass(frozen=True)
class Settings:
    """The size of a run (``bench/mindspore.py``: FULL and QUICK)."""
    steps: int  # per launch (every launch, so each has a fault-free reference)
    warmup: int  # steps dropped from step-time statistics
    k: int  # periodic checkpoint interval
    pairs: int  # overhead launch pairs
    positions: tuple[int, ...]  # fault after this many completed steps
    batch: int = 4
    image: int = 16


class LaunchFailed(RuntimeError):
    pass


@dataclass
class Launch:
    rc: int
    started: float
    ended: float
    report: dict | None
    log: Path

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, *, guard: bool, s: Settings, fault: str | None = None, attempt: str = "") -> Launch:
    """One launch of the example in ``run_dir`` (its checkpoints, timeline
    and report live there; relaunching with the same ``run_dir`` is the same
    command)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # msrun runs `python SCRIPT`
    env["PYTHONUNBUFFERED"] = "1"
    if guard:
        env["TRAINGUARD_STRATEGIES"] = "retry,dump,exit"
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    launcher = ["-m", "trainguard.cli", "run", "--framework", "mindspore"] if guard else \
        ["-m", "mindspore.parallel.cluster.run"]
    cmd = [sys.executable, *launcher, f"--worker_num={NPROC}", f"--local_worker_num={NPROC}",
           f"--master_port={free_port()}", "--join=True", f"--log_dir={run_dir / 'logs'}", str(SCRIPT),
           f"steps={s.steps}", "seed=0", f"batch_size={s.batch}", f"image_size={s.image}", "log_every=0",
           f"guard={str(guard).lower()}", f"save_every={s.k}", f"checkpoint_dir={run_dir / 'ckpt'}",
           f"timeline={run_dir / 'timeline.jsonl'}", f"report={run_dir / 'report.json'}"]
    report = run_dir / "report.json"
    report.unlink(missing_ok=True)
    log = run_dir / f"launch{attempt}.log"
    started = time.time()
    with open(log, "w") as out:  # msrun tails every worker log: a file, not a pipe
        try:
            rc = subprocess.run(cmd, env=env, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT,
                                timeout=LAUNCH_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = -1
            _kill_processes_under(run_dir)  # msrun's workers run in sessions of their own
    ended = time.time()
    return Launch(rc, started, ended, json.loads(report.read_text()) if report.exists() else None, log)


def _kill_processes_under(run_dir: Path) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(run_dir) in cmdline and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def events(run_dir: Path, kind: str, after: float = 0.0) -> list[dict]:
    path = run_dir / "timeline.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == kind and e["t"] > after]


def fault_time(run_dir: Path) -> float:
    (struck,) = [json.loads(line) for line in (run_dir / "ckpt" / ".trainguard" / "faults.jsonl").read_text()
                 .splitlines() if line.strip()]
    return struck["time"]


def attempts(what: str, failures: dict, key: str, fn, tries: int = 3):
    """``fn(attempt)``, again after a failed launch (counted in ``failures``)."""
    for attempt in range(tries):
        try:
            return fn(attempt)
        except LaunchFailed as e:
            failures[key] += 1
            print(f"{what} failed, retrying: {str(e)[-2000:]}", file=sys.stderr)
    raise RuntimeError(f"{what} failed {tries} times")
