"""The watchdog on real processes: a frozen worker and a hung loop are found
within max(3 x median step, 2 s) plus the poll, and handled; benign pauses of
5 x the step time raise no alarm. Steps are stretched to ~0.6 s so that a
5-step pause is longer than the hang limit (the tests would fail if GC time
or a checkpoint section counted against the step)."""

from __future__ import annotations

import json

import pytest

from conftest import run_job
from trainguard.core.faults import read_fault_log

pytestmark = pytest.mark.timeout(400)

STEPS = 8
STEP_SLEEP = 0.6
#: max(3 x median step, 2 s) + poll: the steps here take ~0.6-0.7 s.
POLL_S = 0.25
#: Time for a report to travel agent/processor -> controller on a loaded 2-core box.
TRANSIT_S = 0.5
ENV = {"TINY_STEP_SLEEP": str(STEP_SLEEP)}


def bound(step_s: float) -> float:
    return max(3 * step_s, 2.0) + POLL_S


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("reference"), "ref", nproc=2, steps=STEPS, env=ENV)
    assert job.rc == 0, job
    return job.report


def dump_then_resume(job_runner, fault: str):
    first = job_runner("first", nproc=2, steps=STEPS, fault=fault, env=ENV)
    assert first.rc == 75, first
    (strike,) = read_fault_log(first.ckpt / ".trainguard" / "faults.jsonl")
    second = job_runner("second", nproc=2, steps=STEPS, fault=fault, env=ENV, ckpt=first.ckpt)
    assert second.rc == 0, second
    (record,) = second.report["recoveries"]
    return strike, record, second.report


def test_a_stopped_worker_is_found_by_its_agent_and_the_job_saves(job_runner, reference):
    strike, record, report = dump_then_resume(job_runner, "stop:rank=1,step=4")
    assert (record["fault"], record["rank"], record["strategy"]) == ("hang", 1, "dump")
    assert "found stopped" in record["message"]
    detect = record["detected_at"] - strike["time"]
    assert 0 <= detect <= bound(STEP_SLEEP), f"found after {detect:.2f} s"
    assert report["final_state_sha256"] == reference["final_state_sha256"]
    assert report["lost_steps"] == 0 and report["steps_completed"] == STEPS


def test_a_loop_hung_in_python_names_itself_and_the_job_saves(job_runner, reference):
    strike, record, report = dump_then_resume(job_runner, "hang:rank=1,step=4,phase=forward")
    assert (record["fault"], record["rank"], record["strategy"]) == ("hang", 1, "dump")
    assert "training loop hung" in record["message"] and "not in a collective" in record["message"]
    detect = record["detected_at"] - strike["time"]
    # The limit is measured from the last completed step, a little before the strike.
    assert 0 <= detect <= bound(STEP_SLEEP + 0.1) + TRANSIT_S, f"found after {detect:.2f} s"
    assert report["final_state_sha256"] == reference["final_state_sha256"]
    assert report["lost_steps"] == 0


def test_long_gc_pause_and_long_save_raise_no_alarm(job_runner, reference):
    fault = "pause:rank=1,step=3,phase=gc,factor=5;pause:rank=0,step=4,phase=save,factor=5"
    job = job_runner("benign", nproc=2, steps=STEPS, fault=fault, env=ENV, save_every=4)
    assert job.rc == 0, job
    assert job.report["recoveries"] == [], "a benign pause was taken for a fault"
    pauses = read_fault_log(job.ckpt / ".trainguard" / "faults.jsonl")
    assert sorted(p["phase"] for p in pauses) == ["gc", "save"]
    for p in pauses:  # each pause is longer than the hang limit would be for a step
        assert p["seconds"] > bound(STEP_SLEEP), p
    assert job.report["final_state_sha256"] == reference["final_state_sha256"]
    assert json.loads((job.ckpt / "latest_step.txt").read_text()) == 8


def test_an_evaluation_that_holds_the_gil_past_the_heartbeat_limit_raises_no_alarm(job_runner, reference):
    """Every rank evaluates in a section that holds the GIL for 6 s (an
    evaluation graph compiling): no heartbeat leaves for longer than the
    controller's silence limit (5 x 0.6 s step + 2 heartbeats = 4 s), but the
    section, announced as it opened, stretches it."""
    job = job_runner("evaluation", nproc=2, steps=STEPS, env={**ENV, "TINY_EVAL_HOLD": "4,6"})
    assert job.rc == 0, job
    assert job.report["recoveries"] == [], "an evaluation was taken for a hung rank"
    assert "no heartbeat" not in job.log, job
    assert job.report["final_state_sha256"] == reference["final_state_sha256"]


def test_a_collective_that_does_not_complete_is_retried_in_place(job_runner, reference):
    # Rank 1's all-reduce is never sent (a black-holed link): both ranks wait
    # in it, alive and heartbeating. The watchdog reports the collective,
    # every rank is stopped, communication is rebuilt, and training goes on.
    job = job_runner("stuck", nproc=2, steps=STEPS, env=ENV, fault="stall:rank=1,step=3,phase=backward")
    assert job.rc == 0, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["strategy"]) == ("comm", "retry")
    assert "collective did not complete" in record["message"]
    assert all(len(pids) == 1 for pids in job.report["pids"].values()), "a process was restarted"
    assert job.report["final_state_sha256"] == reference["final_state_sha256"]
    assert job.report["lost_steps"] == 0
