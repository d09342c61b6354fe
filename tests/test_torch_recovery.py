"""End to end on CPU: real processes under ``trainguard run`` (gloo, 4 ranks),
faults injected, outcomes compared bit for bit with a fault-free run."""

from __future__ import annotations

import json

import pytest

from conftest import run_job

pytestmark = pytest.mark.timeout(400)

STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("reference"), "ref", steps=STEPS)
    assert job.rc == 0, job
    assert job.report["steps_completed"] == STEPS and job.report["recoveries"] == []
    return job.report


def assert_same_training(report, reference):
    assert report["final_state_sha256"] == reference["final_state_sha256"]
    assert report["steps_completed"] == STEPS
    assert report["lost_steps"] == 0


# CI: the backward's case at two ranks, for every adapter, is test_rank_contract.py's job tier.
@pytest.mark.parametrize("phase", [pytest.param(phase, marks=pytest.mark.slow) for phase in ("forward", "backward")]
                         + ["optimizer"])
def test_uce_is_retried_in_place(job_runner, reference, phase):
    # Inside its update, rank 2 waits for the others to commit step 5 first: under load, another
    # rank might not have begun its update when the fault's STOP came, and would stay at 4.
    env = {"TINY_HOLD_UPDATE": "2,4"} if phase == "optimizer" else None
    job = job_runner("uce", fault=f"uce:rank=2,step=4,phase={phase}", env=env)
    assert job.rc == 0, job
    assert_same_training(job.report, reference)
    assert all(len(pids) == 1 for pids in job.report["pids"].values()), "a process was restarted"
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"]) == ("uce", 2, "retry")
    # Inside the update the other ranks already finished step 5; before it, all are at 4.
    assert record["step"] == (5 if phase == "optimizer" else 4)
    assert record["detect_s"] is not None and record["recover_s"] is not None


def test_comm_failure_is_retried_without_copying_state(job_runner, reference):
    job = job_runner("comm", fault="comm:rank=1,step=6,phase=backward")
    assert job.rc == 0, job
    assert_same_training(job.report, reference)
    (record,) = job.report["recoveries"]
    assert record["strategy"] == "retry" and "no state copy needed" in record["reason"]


def test_lost_process_is_dumped_and_the_relaunch_resumes(job_runner, reference):
    fault = "crash:rank=1,step=5,phase=backward"
    first = job_runner("crash", fault=fault)
    assert first.rc == 75, first
    assert "saved a dying-gasp checkpoint at step 5" in first.log
    entries = sorted(p.name for p in first.ckpt.iterdir())
    assert entries == [".trainguard", "latest_step.txt", "step_00000005"], "a _tmp directory was left behind"
    manifest = json.loads((first.ckpt / "step_00000005" / "manifest.json").read_text())
    (shard,) = manifest["layout"]["shards"]  # one healthy replica saved the one shard
    assert shard["saved_by"] in (0, 2, 3) and shard["full"]
    assert manifest["meta"]["finalised_by"] == shard["saved_by"]
    # one shard and every rank's own part: the lost rank's carried by a survivor on its node
    assert sorted(manifest["files"]) == ["own_r0.bin", "own_r1.bin", "own_r2.bin", "own_r3.bin", "shard_k0_r0.pt"]
    assert first.log.count("finalised (5 files)") == 1, "the checkpoint must be finalised by exactly one rank"

    second = job_runner("crash", fault=fault, ckpt=first.ckpt)  # the same command again
    assert second.rc == 0, second
    assert "resumed from" in second.log
    assert_same_training(second.report, reference)
    assert all(len(pids) == 2 for pids in second.report["pids"].values())
    (record,) = second.report["recoveries"]
    assert (record["fault"], record["rank"], record["step"], record["strategy"]) == ("process_lost", 1, 5, "dump")


def test_second_fault_during_retry_falls_back_to_dump(job_runner, reference):
    fault = "uce:rank=1,step=4,phase=backward;crash:rank=3,step=4,phase=recovery"
    first = job_runner("second", fault=fault)
    assert first.rc == 75, first
    assert "second fault during retry" in first.log or "falling back" in first.log
    second = job_runner("second", fault=fault, ckpt=first.ckpt)
    assert second.rc == 0, second
    assert_same_training(second.report, reference)
    (record,) = second.report["recoveries"]
    assert record["strategy"] == "dump" and "retry: already failed in this episode" in record["reason"]


@pytest.mark.slow  # CI: the strategy lists in test_decide.py
def test_dump_only_strategy_list_is_respected(job_runner, reference):
    first = job_runner("dumponly", fault="uce:rank=0,step=7,phase=forward", strategies="dump,exit")
    assert first.rc == 75, first
    second = job_runner("dumponly", fault="uce:rank=0,step=7,phase=forward", strategies="dump,exit",
                        ckpt=first.ckpt)
    assert second.rc == 0, second
    assert_same_training(second.report, reference)


@pytest.mark.parametrize("fault, why", [
    ("uce:rank=1,step=0,phase=backward", "the fault came at step 0"),
    ("uce:rank=1,step=3,phase=backward,severity=corrupted", "corrupted data may have reached the replicas"),
])
def test_unrecoverable_faults_exit_with_the_reason(job_runner, fault, why):
    job = job_runner("exit", nproc=2, fault=fault)
    assert job.rc == 1, job
    assert why in job.log
    assert "exits with code 76" in job.log
    assert not (job.ckpt / "latest_step.txt").exists()


@pytest.mark.slow  # CI: the background saves (test_snapshot_guard.py)
def test_periodic_checkpoints_resume_after_a_plain_failure(job_runner, reference):
    # With only `exit` allowed, a crash loses the steps since the last periodic checkpoint.
    first = job_runner("periodic", fault="crash:rank=2,step=7", strategies="exit", save_every=3)
    assert first.rc == 1, first
    assert (first.ckpt / "latest_step.txt").read_text() == "6\n"
    second = job_runner("periodic", fault="crash:rank=2,step=7", strategies="exit", save_every=3, ckpt=first.ckpt)
    assert second.rc == 0, second
    assert second.report["final_state_sha256"] == reference["final_state_sha256"]


@pytest.mark.slow  # CI: --max-restarts after a dump (test_snapshot_guard.py)
def test_max_restarts_relaunches_from_the_dying_gasp_checkpoint(job_runner, reference):
    # One command: the crash is dumped, torch's agent restarts the workers, they resume.
    job = job_runner("restarts", fault="crash:rank=3,step=6", extra_args=["--max-restarts", "1"])
    assert job.rc == 0, job
    assert_same_training(job.report, reference)
    assert all(len(pids) == 2 for pids in job.report["pids"].values())
    assert [r["strategy"] for r in job.report["recoveries"]] == ["dump"]
