"""Shared fixtures: running real jobs under ``trainguard run``, leak checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


@dataclass
class Job:
    rc: int
    log: str
    report: dict | None
    ckpt: Path
    report_path: Path | None = None  # rank 0's; a rank r that writes one: <report_path>.rank<r>

    def __str__(self) -> str:  # shown when an assertion about the job fails
        return f"rc={self.rc}\n{self.log[-6000:]}"


def run_job(tmp: Path, name: str, *, nproc: int = 4, steps: int = 10, fault: str | None = None,
            strategies: str | None = None, save_every: int = 0, ckpt: Path | None = None,
            env: dict | None = None, timeout: float = 150, script: Path | None = None,
            extra_args: list[str] | None = None, max_restarts: int | None = 0) -> Job:
    """Launch ``tests/workers/tiny_train.py`` (or ``script``) with ``trainguard run``."""
    cmd, full_env, report, ckpt = job_command(tmp, name, nproc=nproc, steps=steps, fault=fault,
                                              strategies=strategies, save_every=save_every, ckpt=ckpt, env=env,
                                              script=script, extra_args=extra_args, max_restarts=max_restarts)
    proc = run_bounded(cmd, env=full_env, cwd=tmp, timeout=timeout)
    if proc.returncode:  # pytest shows a test's captured output when it fails: the log tail then reaches CI
        print(f"--- {name}: exit {proc.returncode}; log tail ---\n{(proc.stdout + proc.stderr)[-8000:]}")
    data = json.loads(report.read_text()) if report.exists() else None
    return Job(proc.returncode, proc.stdout + proc.stderr, data, ckpt, report)


def job_command(tmp: Path, name: str, *, nproc: int = 4, steps: int = 10, fault: str | None = None,
                strategies: str | None = None, save_every: int = 0, ckpt: Path | None = None,
                env: dict | None = None, script: Path | None = None,
                extra_args: list[str] | None = None, max_restarts: int | None = 0) -> tuple[list[str], dict, Path, Path]:
    """The ``trainguard run`` command line, environment, report and
    checkpoint paths of a job (see :func:`run_job`). ``max_restarts``:
    the ``--max-restarts`` given unless ``extra_args`` has one (0, as the
    tests written before trainguard had a default budget expect: a lost
    process dumps and the test relaunches; ``None``: the launcher's default)."""
    extra_args = list(extra_args or [])
    if max_restarts is not None and "--max-restarts" not in extra_args:
        extra_args += ["--max-restarts", str(max_restarts)]
    ckpt = ckpt or tmp / f"{name}-ckpt"
    report = tmp / f"{name}.json"
    report.unlink(missing_ok=True)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full_env.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "TRAINGUARD_PRELOCK_TIMEOUT_S": "20",
                     "PYTHONUNBUFFERED": "1"})
    if fault:
        full_env["TRAINGUARD_FAULT"] = fault
    if strategies:
        full_env["TRAINGUARD_STRATEGIES"] = strategies
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1",
           *extra_args, str(script or WORKERS / "tiny_train.py"), str(steps), str(report), str(ckpt),
           str(save_every)]
    return cmd, full_env, report, ckpt


def run_bounded(cmd: list[str], *, env: dict, cwd: Path, timeout: float,
                merge: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a launcher and its workers: past ``timeout``
    the whole process group is killed (no orphaned workers) and the test
    fails with the job's log tail, which a bare ``TimeoutExpired`` drops.
    ``merge``: stderr goes into stdout (``stderr`` is then empty)."""
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                          stderr=subprocess.STDOUT if merge else subprocess.PIPE) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(cmd)}\nstill running after {timeout:.0f} s; log tail:\n"
                        f"{(out + (err or ''))[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")


@pytest.fixture
def shm(tmp_path):
    """A snapshot directory owned by the test, under a private root (not /dev/shm)."""
    from trainguard.core.snapshot import SnapshotDir

    root = tmp_path / "shm"
    root.mkdir()
    d = SnapshotDir.create("job", root)
    yield d
    d.remove()


@pytest.fixture
def job_runner(tmp_path):
    def run(name: str, **kwargs) -> Job:
        return run_job(tmp_path, name, **kwargs)

    yield run
    _assert_no_stray_processes(tmp_path)


def _assert_no_stray_processes(tmp: Path) -> None:
    """Every worker of a finished job must be gone."""
    deadline = time.time() + 10
    while True:
        stray = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(tmp) in cmdline and int(pid) != os.getpid():
                stray.append((pid, cmdline))
        if not stray or time.time() > deadline:
            break
        time.sleep(0.2)
    assert not stray, f"processes left behind: {stray}"


#: Test files that must have the machine to themselves: CI runs every other
#: test two at a time (``-n 2``), then these one at a time (``-m serial``).
SERIAL = {
    # They patch the installed torchrun / msrun that every other job launches.
    "test_patch.py", "test_patch_msrun.py",
    # They tell a benign pause or a slow rank from a fault by timing real runs.
    "test_detect.py", "test_slow_nodes.py",
}
#: Tests elsewhere that patch an installed launcher (fixtures of these names) are serial too.
PATCHING = {"patched_msrun"}


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks added here
def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a CUDA device is present; the files in
    :data:`SERIAL`, and tests with a fixture in :data:`PATCHING`, are marked
    ``serial``."""
    for item in items:
        if item.path.name in SERIAL or PATCHING & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serial)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leaked_trainguard_threads():
    """Controllers, relays and processors started by a test must be stopped
    by it (the servers share the process's one loop thread, which stays)."""
    from trainguard.core.loop import live_servers

    before = {t.ident for t in threading.enumerate()}
    servers_before = {id(server) for server in live_servers()}
    yield
    deadline = time.time() + 10
    while True:
        leaked = [t.name for t in threading.enumerate()
                  if t.ident not in before and t.name.startswith("trainguard") and t.is_alive()
                  and t.name not in ("trainguard-pg-retire", "trainguard-loop")]
        leaked += [server.thread_name for server in live_servers() if id(server) not in servers_before]
        if not leaked or time.time() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"threads or servers left running: {leaked}"
