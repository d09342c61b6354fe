"""A TaskD-style job for ``test_compat_taskd.py``, as TaskD's recipe runs one:
``manager.py`` (:data:`MANAGER_PY`, what a TaskD user writes with only the
import prefix changed) in the background and plain ``torchrun`` launches of
``worker.py`` (:data:`WORKER_PY`: ``init_taskd_worker``/``start_taskd_worker``
and then a Guard), driven by :class:`TaskdJob`; with the job's shared secret
(:data:`TOKEN`) and :func:`free_port`, which the in-process tests use too."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_bounded

TOKEN = secrets.token_hex(32)

# What a TaskD user writes, with only the import prefix changed.
MANAGER_PY = """\
import json, os, sys
from trainguard.compat.taskd.api import init_taskd_manager, start_taskd_manager
from trainguard.compat.taskd.api import taskd_manager_api

job_id = os.getenv("MINDX_TASK_ID")
init_taskd_manager({"job_id": job_id, "node_nums": 1, "proc_per_node": 2})
out = {}
try:
    out["returned"] = start_taskd_manager(max_restarts=int(sys.argv[2]))
except taskd_manager_api.TaskdJobStopped as e:
    out["stopped"] = {"exit_code": e.exit_code, "step": e.step, "message": str(e)}
out["attempts"] = taskd_manager_api.taskd_manager.attempts
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""

WORKER_PY = """\
import json, os, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from trainguard.compat.taskd.api.taskd_worker_api import init_taskd_worker, start_taskd_worker
from trainguard.torch import Guard

steps, out_dir, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
init_taskd_worker(rank, 5000)
start_taskd_worker()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=ckpt)
for step in guard.steps(steps):
    with guard.protect():
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        guard.optimizer.zero_grad()
        loss.backward()
        guard.optimizer.step()
report = dict(guard.report(), pid=os.getpid(), controller=os.environ["TRAINGUARD_CONTROLLER"])
guard.close()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


def free_port() -> int:
    """A port another process binds later: below the automatic range (see ms_jobs.free_port)."""
    from ms_jobs import free_port as below_automatic

    return below_automatic()


class TaskdJob:
    """``manager.py`` in the background and plain torchrun launches of
    ``worker.py``, as in TaskD's recipe; every process is ended by its id."""

    def __init__(self, tmp: Path, *, manager_env: dict | None = None, max_restarts: int = 0) -> None:
        self.tmp = tmp
        (tmp / "manager.py").write_text(MANAGER_PY)
        (tmp / "worker.py").write_text(WORKER_PY)
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        self.env.update(TRAINGUARD_TOKEN=TOKEN, TRAINGUARD_PORT=str(self.port), MINDX_TASK_ID="job-taskd",
                        TRAINGUARD_HEARTBEAT_INTERVAL_S="0.5", PYTHONUNBUFFERED="1")
        self.manager = subprocess.Popen(
            [sys.executable, "manager.py", "manager.json", str(max_restarts)], cwd=tmp,
            env={**self.env, "MASTER_ADDR": "127.0.0.1", **(manager_env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def torchrun(self, steps: int, *, fault: str = "", timeout: float = 45) -> tuple[int, str, dict]:
        env = dict(self.env, TRAINGUARD_DISABLE="1")  # plain torchrun even on a patched install
        if fault:
            env["TRAINGUARD_FAULT"] = fault
        for old in self.tmp.glob("rank*.json"):
            old.unlink()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "worker.py", str(steps), str(self.tmp), str(self.tmp / "ckpt")]
        proc = run_bounded(cmd, env=env, cwd=self.tmp, timeout=timeout, merge=True)
        reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in self.tmp.glob("rank*.json")}
        return proc.returncode, proc.stdout, reports

    def manager_result(self, timeout: float = 40) -> tuple[int, str, dict]:
        try:
            out, _ = self.manager.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            out, _ = self.manager.communicate()
            pytest.fail(f"the manager did not return within {timeout} s:\n{out[-4000:]}")
        path = self.tmp / "manager.json"
        return self.manager.returncode, out, json.loads(path.read_text()) if path.exists() else {}

    def close(self) -> None:
        if self.manager.poll() is None:
            os.killpg(self.manager.pid, signal.SIGKILL)
            self.manager.wait()
