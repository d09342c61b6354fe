"""A dump without a relaunch: while restarts are left, the launcher starts
the node's group again itself, in warm standby processes, and the workers
resume from the node's snapshots in memory -- one launch, bit-identical.
A dump caused by the script's own exception is not restarted (the restart
would meet the same exception: a loop)."""

from __future__ import annotations

import json

import pytest

from conftest import WORKERS, run_job

pytestmark = pytest.mark.timeout(400)

LM = WORKERS / "lm_train.py"
STEPS = 8
SNAPSHOTS = {"LM_SNAPSHOT_EVERY": "1"}


def _ranks(tmp, name: str) -> dict:
    return {0: json.loads((tmp / f"{name}.json").read_text()),
            1: json.loads((tmp / f"{name}.json.rank1").read_text())}


def test_after_a_dump_the_launcher_restarts_the_group_warm_from_memory_bit_identical(tmp_path):
    ref = run_job(tmp_path, "ref", nproc=2, steps=STEPS, script=LM, env=SNAPSHOTS, max_restarts=None)
    assert ref.rc == 0, ref
    # dump is the only strategy: the lost rank cannot be restarted alone, the group is.
    job = run_job(tmp_path, "crash", nproc=2, steps=STEPS, script=LM, env=SNAPSHOTS, strategies="dump,exit",
                  fault="crash:rank=1,step=4,phase=backward", max_restarts=None)
    assert job.rc == 0, job  # one launch: no relaunch from outside
    assert "restarted ranks [0, 1] in warm standby processes" in job.log, job
    assert job.log.count("resumed from memory at step 4") == 2, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["step"], record["lost_steps"]) == (
        "process_lost", 1, "dump", 4, 0), record
    ours, theirs = _ranks(tmp_path, "crash"), _ranks(tmp_path, "ref")
    for rank in (0, 1):  # model, optimizer, random streams and data position as in the fault-free run
        assert ours[rank]["final_state_sha256"] == theirs[rank]["final_state_sha256"]
        assert (ours[rank]["rng_sha256"], ours[rank]["data"]) == (theirs[rank]["rng_sha256"], theirs[rank]["data"])


def test_a_dump_after_the_scripts_own_exception_is_not_restarted_in_a_loop(tmp_path):
    job = run_job(tmp_path, "bug", nproc=2, steps=STEPS, script=LM, env={"LM_RAISE_AT": "1:4"}, max_restarts=None)
    assert job.rc == 75, job
    assert "not restarting the group: the dump followed an exception of the script itself" in job.log, job
    assert "a bug in the script at step 4" in job.log, job
    assert job.log.count("all 2 ranks registered") == 1, job  # one round: the group was not started again
