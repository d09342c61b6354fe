"""Running small MindSpore jobs on 2 msrun workers for the tests (MindSpore
itself is only imported by the jobs)."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conftest import WORKERS, run_bounded

STEPS = 6
#: MindSpore's cluster retries and heartbeats wait a random whole number of
#: seconds between these two (default 3 and 5): a worker's exit joins its
#: heartbeat thread, and a registration that came too early waits for its
#: next try. One second each keeps a small job from idling seconds at both.
FAST_CLUSTER = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}


def free_port() -> int:
    """A port for msrun's scheduler, free now and below the kernel's range of
    automatic ports (32768-60999 by default): a port from that range, once
    released, can be handed to any other socket (a gRPC server, a store, an
    outgoing connection of a test running beside) before msrun binds it, and
    msrun's workers then retry a scheduler that never came up until the test
    times out (seen in CI)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, min(low, 32768)))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the automatic range")


@dataclass
class MsJob:
    rc: int
    log: str
    report: dict | None
    ckpt: Path
    ranks: dict = field(default_factory=dict)  # rank -> its report (workers that write REPORT.<rank>)

    def __str__(self) -> str:
        return f"rc={self.rc}\n{self.log[-6000:]}"

    def loud(self) -> list[str]:
        """trainguard's WARNING and ERROR lines, each once (msrun prints a
        worker's lines as it tails its log, which the job's log holds too)."""
        seen, out = set(), []
        for line in self.log.splitlines():
            match = re.search(r"(\[trainguard [^\]]*? (WARNING|ERROR|CRITICAL) [^\]]*\]) (.*)", line)
            if match and match.group(1) not in seen:  # its source, level and time: the same line twice
                seen.add(match.group(1))
                out.append(match.group(0))
        return out


def run_ms(tmp: Path, name: str, *, fault: str | None = None, strategies: str | None = "retry,dump,exit",
           ckpt: Path | None = None, launcher: str = "trainguard", env: dict | None = None,
           script: Path = WORKERS / "ms_train.py", steps: int = STEPS) -> MsJob:
    """Launch ``script STEPS REPORT CKPT`` on 2 msrun workers (``launcher``:
    ``trainguard run --framework mindspore``, or plain ``msrun``)."""
    ckpt = ckpt or tmp / f"{name}-ckpt"
    report = tmp / f"{name}.json"
    for old in [report, *tmp.glob(f"{report.name}.[0-9]")]:
        old.unlink(missing_ok=True)
    logs = tmp / f"{name}-logs"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_"))}
    # The survivors of a killed worker leave their collective after this long (MindSpore's default is ~30 s).
    full_env.update({**FAST_CLUSTER, "TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "MS_CPU_COMM_OP_TIMEOUT": "10",
                     "PYTHONUNBUFFERED": "1",
                     # as in an activated environment: plain msrun starts `python` from PATH
                     "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    if fault:
        full_env["TRAINGUARD_FAULT"] = fault
    if strategies:
        full_env["TRAINGUARD_STRATEGIES"] = strategies
    full_env.update(env or {})
    msrun_flags = ["--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}", "--join=True",
                   f"--log_dir={logs}"]
    if launcher == "trainguard":
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--framework", "mindspore", *msrun_flags]
    else:
        cmd = [str(Path(sys.executable).parent / "msrun"), *msrun_flags]
    cmd += [str(script), str(steps), str(report), str(ckpt)]
    proc = run_bounded(cmd, env=full_env, cwd=tmp, timeout=200)
    worker_logs = "".join(f"\n--- {p.name}\n" + "\n".join(
        line for line in p.read_text(errors="replace").splitlines() if "trainguard" in line or "Error" in line)
        for p in sorted(logs.glob("worker_*.log")))
    data = json.loads(report.read_text()) if report.exists() else None
    ranks = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp.glob(f"{report.name}.[0-9]")}
    return MsJob(proc.returncode, proc.stdout + proc.stderr + worker_logs, data, ckpt, ranks)
