"""trainguard.integrations.hf in real processes: a standard Trainer script
(examples/hf/train.py: a tiny GPT-2 from GPT2Config, dropout on, AdamW with
a linear warm-up schedule, the Trainer's shuffled loader that accelerate
prepared) with GuardedTrainer, on 2 gloo ranks under ``trainguard run``,
each fault ending where the fault-free run ends: model, optimizer, every
rank's random streams and data position, and the Trainer's global step."""

from __future__ import annotations

import pytest

from integration_jobs import run_example, same_end

pytestmark = pytest.mark.timeout(900)

STEPS = 14  # 12 batches of 4 per rank and epoch: an epoch boundary crossed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_example(tmp_path_factory.mktemp("hf"), "hf", "ref", steps=STEPS)
    assert job.rc == 0, job
    assert job.report["trainer_global_step"] == STEPS
    return job


# CI's budget: the accelerate integration's retry stands for the three (tests/test_integrations_accelerate.py).
@pytest.mark.parametrize("fault", [
    pytest.param("uce:rank=1,step=5,phase=optimizer", marks=pytest.mark.slow),
    pytest.param("uce:rank=1,step=5,phase=backward", marks=pytest.mark.slow),
    pytest.param("comm:rank=0,step=12,phase=backward", marks=pytest.mark.slow),  # the first step of epoch 2
])
def test_a_fault_in_a_step_is_retried_in_place(tmp_path, reference, fault):
    job = run_example(tmp_path, "hf", "fault", steps=STEPS, fault=fault)
    assert job.rc == 0, job
    same_end(job, reference)
    assert job.report["trainer_global_step"] == STEPS
    (record,) = job.report["recoveries"]
    assert record["strategy"] == "retry", record
    assert all(len(pids) == 1 for pids in job.report["pids"].values()), "a process was restarted"


@pytest.mark.slow  # CI: the retry above; the dump's path is the torch Guard's (test_torch_recovery)
@pytest.mark.parametrize("fault", ["crash:rank=1,step=5,phase=forward", "crash:rank=1,step=11,phase=optimizer"])
def test_a_lost_rank_is_dumped_and_the_relaunch_ends_bit_identical(tmp_path, reference, fault):
    first = run_example(tmp_path, "hf", "crash", steps=STEPS, fault=fault, max_restarts=0)
    assert first.rc == 75, first
    second = run_example(tmp_path, "hf", "crash", steps=STEPS, fault=fault, ckpt=first.ckpt, max_restarts=0)
    assert second.rc == 0, second
    same_end(second, reference)
    assert second.report["trainer_global_step"] == STEPS  # the resumed steps are the Trainer's too
    (record,) = second.report["recoveries"]
    assert (record["fault"], record["strategy"]) == ("process_lost", "dump"), record


@pytest.mark.slow  # CI: the retry above; the restart in place is the torch Guard's (test_defaults)
def test_a_lost_rank_under_the_defaults_is_restarted_in_place_bit_identical(tmp_path, reference):
    """``trainguard run``'s defaults (recover-in-place, a restart budget):
    the lost rank's new process joins the survivors, which keep theirs."""
    job = run_example(tmp_path, "hf", "crash", steps=STEPS, fault="crash:rank=1,step=5,phase=backward")
    assert job.rc == 0, job
    same_end(job, reference)
    assert job.report["trainer_global_step"] == STEPS
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"]) == ("process_lost", 1, "recover-in-place"), record
    assert len(job.report["pids"]["0"]) == 1 and len(job.report["pids"]["1"]) == 2, job.report["pids"]
