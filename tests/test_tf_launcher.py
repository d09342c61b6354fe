"""``trainguard run --framework tensorflow``'s launcher, with stand-in
workers (``tests/workers/tf_fake_worker.py``: the progress pipe and the
fault injector, no TensorFlow): TF_CONFIG per worker, a killed, hung or
stopped worker restarts the whole job once with the reason logged once,
a refusal is not restarted, the budget ends the job, bad settings exit 2."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from conftest import WORKERS, run_bounded

FAKE = WORKERS / "tf_fake_worker.py"


def launch(tmp: Path, *flags: str, steps: int = 6, mode: str = "", env: dict | None = None,
           timeout: float = 60):
    out = tmp / "workers.jsonl"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_") and k != "TF_CONFIG"}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--framework", "tensorflow", "--workers-per-node", "2",
           "--monitor-interval", "0.05", *flags, str(FAKE), str(steps), str(out), *([mode] if mode else [])]
    proc = run_bounded(cmd, env=full_env, cwd=tmp, timeout=timeout, merge=True)
    runs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc.returncode, proc.stdout, runs


def restarts(log: str) -> list[str]:
    return [line for line in log.splitlines() if "restarting the job" in line]


def test_tf_config_per_worker_and_a_clean_finish(tmp_path):
    rc, log, runs = launch(tmp_path)
    assert rc == 0, log
    assert sorted(r["index"] for r in runs) == [0, 1] and {r["restart"] for r in runs} == {0}
    clusters = {json.dumps(r["tf_config"]["cluster"]) for r in runs}
    assert len(clusters) == 1, runs  # one cluster, each worker its own task index
    workers = runs[0]["tf_config"]["cluster"]["worker"]
    assert len(set(workers)) == 2 and all(w.startswith("localhost:") for w in workers)
    assert all(r["tf_config"]["task"] == {"type": "worker", "index": r["index"]} for r in runs)
    assert not restarts(log) and "finished (0 restarts)" in log


def test_killed_worker_restarts_the_whole_job_once(tmp_path):
    rc, log, runs = launch(tmp_path, env={"TRAINGUARD_FAULT": "crash:rank=1,step=2"})
    assert rc == 0, log
    lines = restarts(log)
    assert len(lines) == 1 and "worker 1" in lines[0] and "killed by signal 9 after step 2" in lines[0], log
    first = {r["index"]: r["pid"] for r in runs if r["restart"] == 0}
    second = {r["index"]: r["pid"] for r in runs if r["restart"] == 1}
    assert sorted(first) == sorted(second) == [0, 1], runs
    assert not set(first.values()) & set(second.values())  # every worker started again, the healthy one too


def test_hung_worker_found_by_its_heartbeats(tmp_path):
    rc, log, runs = launch(tmp_path, env={"TRAINGUARD_FAULT": "hang:rank=0,step=3", "TRAINGUARD_HANG_MIN_S": "1"})
    assert rc == 0, log
    lines = restarts(log)
    assert len(lines) == 1 and "worker 0" in lines[0] and "hung after step 3: no progress for" in lines[0], log
    assert {r["restart"] for r in runs} == {0, 1}


def test_stopped_worker_found_at_once(tmp_path):
    rc, log, runs = launch(tmp_path, env={"TRAINGUARD_FAULT": "stop:rank=1,step=2"})
    assert rc == 0, log
    lines = restarts(log)
    assert len(lines) == 1 and "worker 1" in lines[0] and "found stopped (state T)" in lines[0], log


def test_refusal_stops_the_job_without_restarting(tmp_path):
    rc, log, runs = launch(tmp_path, mode="refuse")
    assert rc == 1, log
    assert not restarts(log) and "refused to go on (exit 76)" in log and "not restarting" in log
    assert {r["restart"] for r in runs} == {0}


def test_budget_spent_ends_the_job(tmp_path):
    rc, log, runs = launch(tmp_path, "--max-restarts", "1", mode="fail")
    assert rc == 1, log
    assert len(restarts(log)) == 1 and "restart budget (--max-restarts 1) is spent" in log
    assert {r["restart"] for r in runs} == {0, 1}


def test_same_failure_before_any_step_is_not_restarted_again(tmp_path):
    rc, log, runs = launch(tmp_path, "--max-restarts", "3", mode="early")
    assert rc == 1, log
    assert len(restarts(log)) == 1 and "as in the attempt before, both before any step" in log
    assert {r["restart"] for r in runs} == {0, 1}


def test_bad_settings_exit_2_before_any_worker(tmp_path):
    for env in ({"TRAINGUARD_FAULT": "crash:rank=2,step=1"}, {"TRAINGUARD_FAULTS": "x"},
                {"TF_CONFIG": '{"cluster": {}}'}):
        rc, log, runs = launch(tmp_path, env=env)
        assert rc == 2 and not runs, (env, log)
    rc, log, runs = launch(tmp_path, "--workers-per-node", "0")
    assert rc == 2 and not runs, log
