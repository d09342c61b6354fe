"""The jobs of ``test_store_failures.py``: ``trainguard run`` of
``workers/store_full_train.py`` on 2 ranks inside a user and mount namespace
of its own (``unshare``), whose checkpoint store is a 4 MiB tmpfs that rank 0
fills up or remounts read-only between two saves. :class:`StoreJob` starts
one, holds it before a step while polling ``trainguard status``
(:meth:`StoreJob.hold`), and once it ended reads what the tiny store then
holds, each rank's report and the job's log lines
(:meth:`StoreJob.finish`, :meth:`StoreJob.said`)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import WORKERS

SCRIPT = WORKERS / "store_full_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Run inside the job's namespace once the launcher exited: what the tiny store then holds.
_INSPECT = """
import json, sys
from trainguard.core.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1])
found = store.latest()
print("STORE " + json.dumps({"steps": store.steps(), "tracked": store.tracked_step(),
                             "latest": found.step if found else None,
                             "tmp": sorted(p.name for p in store.root.iterdir() if p.name.endswith("_tmp"))}))
"""


class StoreJob:
    """``trainguard run`` of store_full_train.py on a tmpfs of its own."""

    def __init__(self, tmp: Path, name: str, *, steps: int = 12, save_every: int = 2, env: dict | None = None):
        self.dir = tmp / name
        disk = self.dir / "disk"
        disk.mkdir(parents=True)
        self.report, self.ckpt, self.port = self.dir / "report.json", disk / "ckpt", _free_port()
        self.token = f"store-test-{os.getpid()}-{name}"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "STORE_"))}
        full_env.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "TRAINGUARD_PRELOCK_TIMEOUT_S": "20",
                         "TRAINGUARD_TOKEN": self.token, "PYTHONUNBUFFERED": "1", **(env or {})})
        run = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
               "--max-restarts", "0", "--controller-port", str(self.port), str(SCRIPT), str(steps), str(self.report), str(self.ckpt),
               str(save_every)]
        inspect = [sys.executable, "-c", _INSPECT, str(self.ckpt)]
        script = (f"mount -t tmpfs -o size=4m tmpfs {disk} || exit 90; {shlex.join(run)}; rc=$?; "
                  f"{shlex.join(inspect)}; exit $rc")
        self.proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                                     env=full_env, cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)

    def status(self) -> dict | None:
        """``trainguard status`` of the running job (None: not reachable yet)."""
        out = subprocess.run([sys.executable, "-m", "trainguard.cli", "status", "--controller",
                              f"127.0.0.1:{self.port}", "--token", self.token], capture_output=True, text=True,
                             timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def hold(self, step: int, until, timeout_s: float = 120.0) -> dict:
        """While every rank waits before ``step``: poll the status until
        ``until(status)``, then let the job go on."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status is not None and until(status):
                Path(f"{self.report}.seen{step}").touch()
                return status
            if time.monotonic() > deadline or self.proc.poll() is not None:
                Path(f"{self.report}.seen{step}").touch()
                self.finish()
                pytest.fail(f"status never showed it before step {step}: {status}\n{self!r}")
            time.sleep(0.3)

    def finish(self, timeout_s: float = 240.0) -> "StoreJob":
        try:
            self.log, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.log, _ = self.proc.communicate()
            pytest.fail(f"the job ran past {timeout_s} s:\n{self.log[-8000:]}")
        self.rc = self.proc.returncode
        (self.dir / "job.log").write_text(self.log)
        lines = [line for line in self.log.splitlines() if line.startswith("STORE ")]
        self.store = json.loads(lines[-1][6:]) if lines else None
        self.ranks = {r: json.loads(Path(f"{self.report}.{r}").read_text())
                      for r in (0, 1) if Path(f"{self.report}.{r}").exists()}
        return self

    def said(self, words: str, rank: int | None = None) -> list[str]:
        return [line for line in self.log.splitlines()
                if words in line and (rank is None or f"rank {rank}:" in line)]

    def __repr__(self) -> str:  # what a failed assertion shows
        return f"rc={self.rc}\n{self.log[-8000:]}"
