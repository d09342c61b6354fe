"""Process-level rescheduling on real processes: a lost worker is started
again alone (recover-in-place), the survivors keep their PIDs and the final
state equals a fault-free run bit for bit; a second fault during the
recovery falls back to a dump; ``--max-restarts`` counts process restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import WORKERS, run_job
from trainguard.core.faults import read_fault_log

pytestmark = pytest.mark.timeout(420)

STEPS = 8
RIP = "recover-in-place,dump"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("reference"), "ref", nproc=2, steps=STEPS)
    assert job.rc == 0, job
    return job.report


def restarted_alone(report, rank, nproc=2):
    """Only ``rank`` got a new process; every other rank kept its one PID."""
    pids = report["pids"]
    assert len(pids[str(rank)] if str(rank) in pids else pids[rank]) == 2, pids
    others = [p for r, p in pids.items() if int(r) != rank]
    assert len(others) == nproc - 1 and all(len(p) == 1 for p in others), pids


def test_a_killed_worker_is_restarted_alone_and_training_ends_bit_identical(job_runner, reference):
    job = job_runner("rip", nproc=2, steps=STEPS, fault="crash:rank=1,step=4", strategies=RIP,
                     extra_args=["--max-restarts", "3"])
    assert job.rc == 0, job
    report = job.report
    (record,) = report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"]) == ("process_lost", 1, "recover-in-place")
    assert record["lost_steps"] == 0 and report["lost_steps"] == 0
    assert report["steps_completed"] == STEPS
    restarted_alone(report, 1)
    assert report["final_state_sha256"] == reference["final_state_sha256"]


def test_a_frozen_worker_is_killed_and_restarted_alone(job_runner, reference):
    job = job_runner("stopped", nproc=2, steps=STEPS, fault="stop:rank=1,step=3", strategies=RIP,
                     extra_args=["--max-restarts", "3"])
    assert job.rc == 0, job
    (strike,) = read_fault_log(job.ckpt / ".trainguard" / "faults.jsonl")
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"]) == ("hang", 1, "recover-in-place")
    bound = 2.25  # max(3 x step, 2 s) + poll; steps take milliseconds here
    assert 0 <= record["detected_at"] - strike["time"] <= bound
    # The report's own figure, from the last time the agent saw the process running:
    assert record["detect_s"] is not None and 0 <= record["detect_s"] <= bound
    # It counts from before the strike (the last pass that saw it running), one monitor pass or so early.
    assert -0.01 <= record["detect_s"] - (record["detected_at"] - strike["time"]) <= 0.5
    restarted_alone(job.report, 1)
    assert job.report["final_state_sha256"] == reference["final_state_sha256"]


def test_a_device_memory_error_the_device_cannot_repair_restarts_that_process_alone(tmp_path):
    """A device that cannot clean a memory error in the process (CUDA; here
    the CPU standing in for it): the struck process is ended, a new one
    takes its place from the survivors' state, and the job ends
    bit-identical -- dropout and every rank's streams included -- with the
    survivor's PID kept."""
    env = {"SNAP_DROPOUT": "1", "SNAP_UNREPAIRABLE": "1"}
    kw = dict(nproc=2, steps=STEPS, script=WORKERS / "snapshot_train.py", env=env)
    clean = run_job(tmp_path, "clean", **kw)
    assert clean.rc == 0, clean
    job = run_job(tmp_path, "uce", fault="uce:rank=1,step=4,phase=backward",
                  strategies="retry,recover-in-place,dump,exit", extra_args=["--max-restarts", "1"], **kw)
    assert job.rc == 0, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["lost_steps"]) == \
        ("uce", 1, "recover-in-place", 0), record
    assert "cannot be repaired in the process" in job.log
    restarted_alone(job.report, 1)
    assert job.report["final_state_sha256"] == clean.report["final_state_sha256"]
    for rank in (0, 1):  # every rank's own record: streams and the state it ended with
        assert json.loads((tmp_path / f"uce.json.{rank}").read_text())["final_state_sha256"] == \
            json.loads((tmp_path / f"clean.json.{rank}").read_text())["final_state_sha256"]


@pytest.mark.slow  # CI: a second fault during a retry (test_torch_recovery)
def test_a_second_fault_during_the_recovery_falls_back_to_a_dump(job_runner, tmp_path):
    """Rank 1 is killed; while the job recovers, rank 2 dies too. The
    recovery is abandoned for a dump by rank 0, and torch's restart of the
    whole group (--max-restarts has restarts left) resumes from it."""
    ref = run_job(tmp_path, "ref3", nproc=3, steps=STEPS)
    assert ref.rc == 0, ref
    fault = "crash:rank=1,step=4;crash:rank=2,step=4,phase=recovery"
    job = job_runner("second", nproc=3, steps=STEPS, fault=fault, strategies=RIP, extra_args=["--max-restarts", "3"])
    assert job.rc == 0, job
    assert "second fault during recover-in-place" in job.log
    (record,) = job.report["recoveries"]
    assert (record["strategy"], record["step"], record["lost_steps"]) == ("dump", 4, 0)
    assert all(len(p) == 2 for p in job.report["pids"].values())  # the group was started again
    assert job.report["final_state_sha256"] == ref.report["final_state_sha256"]


def test_max_restarts_counts_process_restarts_and_ends_the_job_cleanly(job_runner, reference):
    fault = "crash:rank=1,step=2;crash:rank=1,step=5"
    job = job_runner("limit", nproc=2, steps=STEPS, fault=fault, strategies=RIP, extra_args=["--max-restarts", "1"])
    assert job.rc == 75, job
    assert "--max-restarts 1, 1 used" in job.log
    assert "relaunch the same command to resume" in job.log
    again = job_runner("resume", nproc=2, steps=STEPS, fault=fault, strategies=RIP, ckpt=job.ckpt,
                       extra_args=["--max-restarts", "1"])
    assert again.rc == 0, again
    strategies = [r["strategy"] for r in again.report["recoveries"]]
    assert strategies == ["recover-in-place", "dump"], again.report["recoveries"]
    assert again.report["final_state_sha256"] == reference["final_state_sha256"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(tmp: Path, name: str, *, fault: str, strategies: str, steps: int = STEPS,
                  lose_node_after_s: float = 0.0, env_extra: dict | None = None) -> tuple[list, dict]:
    """Two ``--nnodes 2`` agents on loopback, one rank each, one spare slot
    each; ``lose_node_after_s``: SIGKILL the second agent and its worker then
    (the node is lost)."""
    ckpt, report = tmp / f"{name}-ckpt", tmp / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_HEARTBEAT_INTERVAL_S="0.5", TRAINGUARD_PRELOCK_TIMEOUT_S="20", PYTHONUNBUFFERED="1",
               TRAINGUARD_FAULT=fault, TRAINGUARD_STRATEGIES=strategies, **(env_extra or {}),
               TRAINGUARD_TOKEN=f"two-nodes-{uuid.uuid4().hex}")  # several nodes: one shared secret
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    rendezvous = None
    if lose_node_after_s:
        # torch's c10d rendezvous store lives in whichever agent bound the
        # endpoint first, and dies with it; served from here, both agents
        # are its clients and either node may be lost (on a cluster: an
        # endpoint outside the workers' nodes, or etcd).
        import torch.distributed as dist

        rendezvous = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", name, "--monitor-interval", "0.1",
           "--max-restarts", "3", "--spare-slots", "1",
           str(WORKERS / "tiny_train.py"), str(steps), str(report), str(ckpt)]
    nodes = [subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs: list[list[str]] = [[], []]
    readers = [threading.Thread(target=lambda n=n, out=out: out.extend(n.stdout), daemon=True)
               for n, out in zip(nodes, logs)]
    for reader in readers:
        reader.start()
    if lose_node_after_s:
        # Counted from the moment training runs (every rank registered); the
        # node lost is the one without the controller (node 0 hosts it).
        deadline = time.time() + 120
        while time.time() < deadline and not any(
                "ranks registered" in line for log in logs for line in list(log)):
            time.sleep(0.05)
        time.sleep(lose_node_after_s)
        victim = next(n for n, log in zip(nodes, logs) if not any("controller listening" in x for x in list(log)))
        workers = subprocess.run(["pgrep", "-P", str(victim.pid)], capture_output=True, text=True).stdout.split()
        for pid in [victim.pid, *map(int, workers)]:
            os.kill(pid, signal.SIGKILL)
    outs = []
    for node, reader, log in zip(nodes, readers, logs):
        try:
            code = node.wait(timeout=240)
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            raise
        reader.join(timeout=10)
        outs.append((code, "".join(log)))
    del rendezvous
    return outs, (json.loads(report.read_text()) if report.exists() else None)


@pytest.mark.slow  # CI: the lost node, whose ranks move too
def test_recover_starts_the_lost_rank_under_the_other_node_agent(tmp_path):
    # The reference has the same topology: torchrun sets OMP_NUM_THREADS=1
    # only with several processes per node, so one rank per node computes
    # with other thread counts (and roundings) than two ranks on one node.
    outs, reference = run_two_nodes(tmp_path, "plain", fault="", strategies="recover,dump")
    assert [rc for rc, _ in outs] == [0, 0], "\n".join(log[-4000:] for _, log in outs)
    outs, report = run_two_nodes(tmp_path, "recover", fault="crash:rank=1,step=4", strategies="recover,dump")
    assert [rc for rc, _ in outs] == [0, 0], "\n".join(log[-4000:] for _, log in outs)
    (record,) = report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["lost_steps"]) == (
        "process_lost", 1, "recover", 0)
    restarted_alone(report, 1)
    assert report["final_state_sha256"] == reference["final_state_sha256"]
    # Which agent started it: the one that did not run rank 1 before.
    logs = "\n".join(log for _, log in outs)
    started = [line for line in logs.splitlines() if "started pid" in line and "for rank 1" in line]
    assert len(started) == 1


def test_elastic_training_goes_on_without_the_lost_replica(job_runner, tmp_path):
    job = job_runner("elastic", nproc=3, steps=STEPS, fault="crash:rank=2,step=4", strategies="elastic-training,dump",
                     env={"TINY_ALL_REPORTS": "1", "TINY_ELASTIC_LR": "linear"})
    assert job.rc == 0, job
    report = job.report
    (record,) = report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["lost_steps"]) == (
        "process_lost", 2, "elastic-training", 0)
    assert report["steps_completed"] == STEPS
    assert report["replicas"] == [{"step": 0, "replicas": 3}, {"step": 4, "replicas": 2}]
    other = json.loads((tmp_path / "elastic.json.rank1").read_text())
    assert other["final_state_sha256"] == report["final_state_sha256"]  # the two replicas stayed identical
    assert len(report["pids"]["0"]) == 1 and len(report["pids"]["1"]) == 1


def test_elastic_training_scales_back_up_when_a_new_process_runs(job_runner, tmp_path):
    steps = 40  # 11 s of training after the crash: time for the new process to start on a busy machine
    job = job_runner("grow", nproc=3, steps=steps, fault="crash:rank=2,step=3", strategies="elastic-training,dump",
                     env={"TINY_ALL_REPORTS": "1", "TINY_STEP_SLEEP": "0.3"}, extra_args=["--max-restarts", "1"])
    assert job.rc == 0, job
    report = job.report
    assert report["steps_completed"] == steps and report["lost_steps"] == 0
    shrunk, grown = report["replicas"][1:]
    assert shrunk == {"step": 3, "replicas": 2}
    assert grown["replicas"] == 3 and 3 < grown["step"] < steps, report["replicas"]
    hashes = {json.loads((tmp_path / f"grow.json.rank{r}").read_text())["final_state_sha256"] for r in (1, 2)}
    assert hashes == {report["final_state_sha256"]}  # all three replicas identical again
    assert len(report["pids"]["0"]) == 1 and len(report["pids"]["1"]) == 1 and len(report["pids"]["2"]) == 2


def test_a_job_that_finishes_before_its_new_process_runs_ends_it_and_exits_cleanly(job_runner, tmp_path):
    """The survivors finish before the process started to scale back up
    runs (here: 13 fast steps against its start): it is ended instead of
    left waiting to join (which hung the launcher), and the job ends well."""
    steps = 16
    job = job_runner("late", nproc=3, steps=steps, fault="crash:rank=2,step=3", strategies="elastic-training,dump",
                     env={"TINY_ALL_REPORTS": "1", "TINY_STEP_SLEEP": "0.01"}, extra_args=["--max-restarts", "1"],
                     timeout=90)
    assert job.rc == 0, job
    report = job.report
    assert report["steps_completed"] == steps and report["lost_steps"] == 0
    assert report["replicas"] == [{"step": 0, "replicas": 3}, {"step": 3, "replicas": 2}]
    assert "scaling back up abandoned: the job finished before the new processes ran" in job.log, job
    assert "it is no longer wanted" in job.log, job


def test_recover_takes_the_ranks_of_a_lost_node_elsewhere(tmp_path):
    """The whole second node goes away (agent and worker killed): the first
    node's agent starts rank 1 in its spare slot, and still ends cleanly
    (it does not wait 5 minutes at torch's exit barrier for the lost one, and says so in one line)."""
    env = {"TINY_STEP_SLEEP": "0.3"}
    outs, reference = run_two_nodes(tmp_path, "whole", fault="", strategies="recover,dump", steps=20, env_extra=env)
    assert [rc for rc, _ in outs] == [0, 0], "\n".join(log[-4000:] for _, log in outs)
    outs, report = run_two_nodes(tmp_path, "lost", fault="", strategies="recover,dump", steps=20, env_extra=env,
                                 lose_node_after_s=2)
    (survivor,) = [out for out in outs if "controller listening" in out[1]]
    assert survivor[0] == 0, survivor[1][-4000:]
    (record,) = report["recoveries"]
    assert (record["rank"], record["strategy"], record["lost_steps"]) == (1, "recover", 0)
    assert len(report["pids"]["0"]) == 1 and len(report["pids"]["1"]) == 2
    assert report["steps_completed"] == 20
    assert report["final_state_sha256"] == reference["final_state_sha256"]
    assert "are gone: the end-of-job barrier gave up on them" in survivor[1]
    assert "Error waiting on exit barrier" not in survivor[1]  # torch's traceback of it: not shown
