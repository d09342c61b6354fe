"""Jobs of one ``trainguard run`` node agent per test host (``tests/netns.py``)
for the multi-host tests and ``bench/multihost.py``: :func:`start_job` starts
an agent on every host (c10d rendezvous on host 0, gloo on the hosts'
interface), :class:`HostJob` holds their processes and captured logs,
:func:`finish` waits for them and reads rank 0's report, and the rest read
what a job left behind (the recovery records, finalised checkpoints, which
host ran which rank) and :func:`record` writes what a test measured."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import WORKERS

import netns

RDZV_PORT = 29400  # each host is its own network: no other job binds it
STEPS = 30
STEP_SLEEP = "0.2"  # a 6 s job: time for a fault to strike mid-run


@dataclass
class HostJob:
    """A job of one node agent per host, and what happened to it."""
    hosts: netns.Hosts
    tmp: Path
    name: str
    agents: list = field(default_factory=list)  # Popen per host
    logs: list = field(default_factory=list)  # lines per host
    codes: list = field(default_factory=list)
    report: dict | None = None
    events: dict = field(default_factory=dict)  # what the test did, with times

    def log(self, i: int) -> str:
        return "".join(self.logs[i])

    def all_logs(self) -> str:
        return "\n".join(f"===== host {i} (exit {c}) =====\n{self.log(i)[-5000:]}"
                         for i, c in zip(range(self.hosts.n), self.codes or [None] * self.hosts.n))

    def seen(self, text: str) -> bool:
        return any(text in line for log in self.logs for line in list(log))

    def wait_for(self, text: str, timeout: float = 120) -> float:
        deadline = time.time() + timeout
        while not self.seen(text):
            if time.time() > deadline:
                raise AssertionError(f"no {text!r} within {timeout} s\n{self.all_logs()}")
            time.sleep(0.02)
        return time.time()

    def controller_host(self) -> int:
        (i,) = [i for i in range(self.hosts.n) if any("controller listening" in x for x in list(self.logs[i]))]
        return i


def start_job(hosts: netns.Hosts, tmp: Path, name: str, *, nproc: int = 1, steps: int = STEPS,
              strategies: str = "recover,dump", fault: str = "", spare: int = 0, max_restarts: int = 3,
              script: Path | None = None, script_args: list[str] | None = None,
              env_extra: dict | None = None, only: int | None = None, plain: bool = False) -> HostJob:
    """Start one node agent on every host: ``--nnodes N``, c10d rendezvous on
    host 0 (its agent serves the rendezvous store: ``--rdzv-conf is_host=1``,
    as torch cannot tell its own address here: the hostname resolves to
    loopback), each agent's controller address and ``--local-addr`` its own
    host's address (only node 0 starts a controller), gloo on the hosts'
    interface (``GLOO_SOCKET_IFNAME``), one job secret for all. ``only``:
    start just that host's agent (a replacement host). ``plain``: torch's own
    torchrun instead (no trainguard flags)."""
    job = HostJob(hosts, tmp, name)
    report, ckpt = tmp / f"{name}.json", tmp / f"{name}-ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_HEARTBEAT_INTERVAL_S="0.5", TRAINGUARD_PRELOCK_TIMEOUT_S="20", PYTHONUNBUFFERED="1",
               TRAINGUARD_STRATEGIES=strategies, TRAINGUARD_TOKEN=f"multihost-{name}-{hosts.name[0]}",
               GLOO_SOCKET_IFNAME=netns.IFNAME, TINY_STEP_SLEEP=STEP_SLEEP)
    env.update(env_extra or {})
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    args = script_args if script_args is not None else [str(steps), str(report), str(ckpt)]
    for i in range(hosts.n) if only is None else [only]:
        launcher = ["torch.distributed.run"] if plain else [
            "trainguard.cli", "run", "--controller-host", hosts.addr[i], "--spare-slots", str(spare)]
        cmd = [sys.executable, "-m", *launcher, "--nnodes", str(hosts.n), "--nproc-per-node",
               str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr[0]}:{RDZV_PORT}",
               "--rdzv-id", name, "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", hosts.addr[i],
               "--monitor-interval", "0.1", "--max-restarts", str(max_restarts),
               str(script or WORKERS / "tiny_train.py"), *args]
        agent = hosts.popen(i, cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda a=agent, out=lines: out.extend(a.stdout), daemon=True).start()
        job.agents.append(agent)
        job.logs.append(lines)
        if i == 0 and only is None:
            time.sleep(1.0)  # host 0 binds the rendezvous endpoint first
    return job


def finish(job: HostJob, timeout: float = 200, skip: tuple = ()) -> HostJob:
    """Wait for every agent (those in ``skip`` are already dead or are
    killed here); read rank 0's report."""
    deadline = time.time() + timeout
    for i, agent in enumerate(job.agents):
        if i in skip:
            continue
        try:
            agent.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            job.hosts.close()
            time.sleep(0.3)
            pytest.fail(f"{job.name}: host {i}'s agent still running after {timeout} s\n{job.all_logs()}")
    for i in skip:
        job.hosts.kill_host(i)
        job.agents[i].wait(timeout=30)
    time.sleep(0.3)  # the readers' last lines
    job.codes = [a.returncode for a in job.agents]
    path = job.tmp / f"{job.name}.json"
    job.report = json.loads(path.read_text()) if path.exists() else None
    return job


def run_clean(hosts: netns.Hosts, tmp: Path, name: str, **kwargs) -> HostJob:
    kwargs.setdefault("spare", 1)  # recover (the default strategies) without a spare slot is refused at the start
    job = finish(start_job(hosts, tmp, name, **kwargs))
    assert job.codes == [0] * hosts.n, job.all_logs()
    return job


def record(job: HostJob, **extra) -> dict:
    """What the test measured: written beside the job and printed (pytest shows it with -s or on failure)."""
    recs = (job.report or {}).get("recoveries") or dump_records(job)
    strike = job.events.get("strike")
    out = {
        "job": job.name, "exit_codes": job.codes, "events": job.events,
        "recoveries": [{k: r.get(k) for k in ("fault", "rank", "step", "strategy", "detect_s", "recover_s",
                                               "lost_steps", "detected_at", "reason")} for r in recs],
        "detected_after_strike_s": (round(recs[0]["detected_at"] - strike, 3)
                                    if recs and strike and recs[0].get("detected_at") else None),
        "steps_completed": (job.report or {}).get("steps_completed"),
        "lost_steps": (job.report or {}).get("lost_steps"),
        "pids": (job.report or {}).get("pids"),
        **extra,
    }
    (job.tmp / f"multihost-{job.name}.json").write_text(json.dumps(out, indent=1, default=str))
    (job.tmp / f"multihost-{job.name}.log").write_text(
        "".join(f"===== host {i} =====\n{job.log(i)}" for i in range(job.hosts.n)))
    print(f"multihost {job.name}: {json.dumps(out, default=str)}")
    return out


def checkpoints(job: HostJob) -> list[int]:
    """The steps of the job's finalised checkpoints."""
    return sorted(int(p.name.split("_")[1]) for p in (job.tmp / f"{job.name}-ckpt").glob("step_*")
                  if (p / "manifest.json").exists())


def dump_records(job: HostJob) -> list[dict]:
    """The recovery records of a job that stopped after a dump (no report
    is written then): the newest checkpoint's manifest carries them."""
    steps = checkpoints(job)
    if not steps:
        return []
    manifest = json.loads((job.tmp / f"{job.name}-ckpt" / f"step_{steps[-1]:08d}" / "manifest.json").read_text())
    return manifest["meta"]["history"]["records"]


def verify(job: HostJob) -> str:
    """``trainguard ckpt verify`` of the job's checkpoints (raises when one is broken)."""
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "ckpt", "verify", str(job.tmp / f"{job.name}-ckpt")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def victim_rank(job: HostJob, host: int) -> int:
    """The (single) global rank host ``host``'s agent ran first."""
    for line in "".join(job.log(i) for i in range(job.hosts.n)).splitlines():
        if f"node agent {socket.gethostname()}:{job.agents[host].pid} runs ranks [" in line:
            return int(line.split("runs ranks [")[1].split("]")[0].split(",")[0])
    raise AssertionError(f"no rank found for host {host}\n{job.all_logs()}")


def victim_of(job: HostJob) -> int:
    """A host that is neither host 0 (the rendezvous store) nor the controller's."""
    ctl = job.controller_host()
    return next(i for i in range(job.hosts.n - 1, -1, -1) if i not in (0, ctl))


def strike_after_start(job: HostJob, after_s: float = 2.0) -> int:
    """Wait until every rank registered and ``after_s`` more; returns the victim host."""
    job.wait_for("ranks registered")
    time.sleep(after_s)
    return victim_of(job)
