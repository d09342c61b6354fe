"""Collectives a framework runs on the default process group are released
when a fault stops the step (real processes under ``trainguard run``, gloo).

HF Trainer gathers a token count, Lightning broadcasts its SIGTERM flag and
accelerate synchronises RNG states on the default group every step. A device
memory error inside one rank's optimizer update finds the others already in
such a collective of the next step, waiting for a peer that is alive but
will not come. Before, they waited there until the hang check ended the job
with nothing saved (exit 76); now the STOP releases them and the step is
retried in place, bit-identical to the fault-free run."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(400)


def test_a_collective_on_the_default_group_is_released_and_the_step_retried(job_runner):
    env = {"TINY_DEFAULT_GROUP": "1"}
    reference = job_runner("ref", nproc=2, steps=8, env=env)
    assert reference.rc == 0, reference
    # Rank 1's update of step 4 waits until rank 0 committed it: rank 0 is then in step 5's collective.
    job = job_runner("uce", nproc=2, steps=8, env={**env, "TINY_HOLD_UPDATE": "1,4"},
                     fault="uce:rank=1,step=4,phase=optimizer")
    assert job.rc == 0, job
    assert job.report["final_state_sha256"] == reference.report["final_state_sha256"]
    assert job.report["lost_steps"] == 0 and job.report["steps_completed"] == 8
    assert all(len(pids) == 1 for pids in job.report["pids"].values()), "a process was restarted"
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"]) == ("uce", 1, "retry"), record
