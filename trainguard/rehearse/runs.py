"""Running the user's script for a rehearsal: one directory per run, the
launches a user would make (a relaunch after a dying gasp or a stop), and
signals from outside at a random moment.

Every launch is ``trainguard run`` (or ``--framework mindspore``) with the
user's own launcher flags, script and arguments, and
``TRAINGUARD_REHEARSAL_DIR`` naming the run's directory, where the guards
put the checkpoints, the per-step trace and the final report
(:mod:`trainguard.core.rehearsal`).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from trainguard.core.rehearsal import ENV, read_trace

__all__ = ["Launch", "Run", "first_error", "run"]

#: Launches of one run: the first and the relaunches a user would make
#: after a dying gasp (exit 75) or a stop.
MAX_LAUNCHES = 4


@dataclass
class Launch:
    rc: int
    seconds: float
    log: Path
    signalled: dict | None = None  # {"rank", "pid", "signal", "time"} of a signal from outside


@dataclass
class Run:
    directory: Path
    launches: list[Launch] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return bool(self.launches) and self.launches[-1].rc == 0


def run(directory: Path, command: Sequence[str], *, fault: str | None = None, strategies: str | None = None,
        outside: int | None = None, rank: int = 0, steps: int = 0, seed: int = 0, timeout_s: float = 3600) -> Run:
    """Launch ``command`` (``trainguard run ...``) in ``directory`` and
    relaunch it, as a user would, while it stops after a dying gasp (75) or
    for any other reason, up to :data:`MAX_LAUNCHES` launches.

    Args:
        fault: ``TRAINGUARD_FAULT`` for every launch (a fault strikes once
            per job: the run's checkpoint directory logs its strikes).
        outside: a signal for ``rank``'s worker in the first launch, at a
            random moment of its ``steps`` steps of training (seeded).
    """
    directory.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINGUARD_FAULT", ENV)}
    env.update({ENV: str(directory), "PYTHONUNBUFFERED": "1"})
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    if strategies:
        env["TRAINGUARD_STRATEGIES"] = strategies
    out = Run(directory)
    for i in range(MAX_LAUNCHES):
        log = directory / f"launch-{i + 1}.log"
        start = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(list(command), env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            signalled = None
            try:
                if outside is not None and i == 0:
                    signalled = _signal_at_random(proc, directory, outside, rank, steps, seed)
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                f.write(f"\ntrainguard rehearse: ended after {timeout_s:g} s\n")
        out.launches.append(Launch(rc, time.monotonic() - start, log, signalled))
        if rc == 0:
            break
    return out


def _signal_at_random(proc: subprocess.Popen, directory: Path, sig: int, rank: int, steps: int,
                      seed: int) -> dict | None:
    """At a random moment of training (seeded): once ``rank`` committed a
    random step from 1 to ``steps - 2``, a random fraction of a step later,
    send ``sig`` to its worker. Anchored to the run's own steps: a moment
    drawn in seconds could fall after a fast run's training had ended."""
    rng = random.Random(seed)
    target, fraction = rng.randint(1, max(1, steps - 2)), rng.random()
    deadline = time.monotonic() + 600
    trace: dict = {}
    while proc.poll() is None and time.monotonic() < deadline:
        trace = read_trace(directory, rank)
        if any(step >= target for step in trace):
            break
        time.sleep(0.02)
    else:
        return None
    times = [trace.get(s, {}).get("t") for s in (target - 1, target)]
    if all(isinstance(t, (int, float)) for t in times):
        time.sleep(fraction * max(0.0, times[1] - times[0]))
    pid = _worker(directory, rank)
    if pid is None or proc.poll() is not None:
        return None
    os.kill(pid, sig)
    return {"rank": rank, "pid": pid, "signal": signal.Signals(sig).name, "time": time.time(), "step": target}


def _worker(directory: Path, rank: int) -> int | None:
    """The worker process of ``rank`` in the run of ``directory``."""
    mark, ranks = f"{ENV}={directory}".encode(), (f"RANK={rank}".encode(), f"RANK_ID={rank}".encode())
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if mark in env and any(r in env for r in ranks) and b"trainguard.cli" not in cmdline:
            return int(pid)
    return None


def saved_steps(directory: Path, rank: int = 0) -> list[int]:
    """The steps a run saved a periodic checkpoint of."""
    return sorted(s for s, e in read_trace(directory, rank).items() if e.get("saved"))


def launcher(argv: Sequence[str], framework: str) -> list[str]:
    """The ``trainguard run`` command for the user's launcher arguments."""
    return [sys.executable, "-m", "trainguard.cli", "run", *(["--framework", framework] if framework != "torch"
                                                            else []), *argv]


def first_error(log: Path, width: int = 240) -> str:
    """The first thing a launch's log says went wrong, in one line: a rank
    that left its step on an error the guard did not recover, else the
    launcher's line of a fault and how it ended, else the first ERROR, else
    the decision the controller took ("" when none)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    error = re.compile(r"^\[trainguard [^\]]* ERROR \d{4}-")  # the log level, not "UCE ERROR" in a message
    for pick in (lambda ln: error.match(ln) and " left step " in ln,
                 lambda ln: "] fault: " in ln and " -> " in ln,  # the launcher's summary: the fault and its end
                 lambda ln: error.match(ln), lambda ln: "] decision: " in ln):
        line = next((ln for ln in lines if pick(ln)), None)
        if line is not None:
            text = line.split("] ", 1)[-1].strip()
            return text if len(text) <= width else text[:width - 3] + "..."
    return ""


def strikes(directory: Path) -> list[dict]:
    """The faults the run's injector logged (strike times included)."""
    path = directory / "checkpoints" / ".trainguard" / "faults.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
