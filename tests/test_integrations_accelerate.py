"""trainguard.integrations.accelerate in real processes: the accelerate
example (examples/accelerate/train.py: dropout, AdamW, LambdaLR through
accelerate's AcceleratedScheduler, a shuffled loader that accelerate
prepared and that prefetches) on 2 gloo ranks under ``trainguard run``,
each fault ending where the fault-free run ends: model, optimizer, every
rank's random streams and data position. The quick matrix of ``trainguard
rehearse`` on the same example is in docs/integrations/accelerate.md."""

from __future__ import annotations

import pytest

from integration_jobs import run_example, same_end

pytestmark = pytest.mark.timeout(600)

STEPS = 14  # 6 batches per rank and epoch: two epochs crossed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_example(tmp_path_factory.mktemp("accelerate"), "accelerate", "ref", steps=STEPS)
    assert job.rc == 0, job
    return job


@pytest.mark.parametrize("fault", [
    "uce:rank=1,step=5,phase=optimizer",
    pytest.param("uce:rank=1,step=5,phase=backward", marks=pytest.mark.slow),  # CI: the update's
    pytest.param("comm:rank=0,step=6,phase=backward", marks=pytest.mark.slow),
])
def test_a_fault_in_a_step_is_retried_in_place(tmp_path, reference, fault):
    job = run_example(tmp_path, "accelerate", "fault", steps=STEPS, fault=fault)
    assert job.rc == 0, job
    same_end(job, reference)
    (record,) = job.report["recoveries"]
    assert record["strategy"] == "retry", record
    assert all(len(pids) == 1 for pids in job.report["pids"].values()), "a process was restarted"


@pytest.mark.slow  # CI: the retry above; the dump's path is the torch Guard's (test_torch_recovery)
@pytest.mark.parametrize("fault", ["crash:rank=1,step=5,phase=forward", "crash:rank=1,step=6,phase=optimizer"])
def test_a_lost_rank_is_dumped_and_the_relaunch_ends_bit_identical(tmp_path, reference, fault):
    first = run_example(tmp_path, "accelerate", "crash", steps=STEPS, fault=fault, max_restarts=0)
    assert first.rc == 75, first
    second = run_example(tmp_path, "accelerate", "crash", steps=STEPS, fault=fault, ckpt=first.ckpt, max_restarts=0)
    assert second.rc == 0, second
    same_end(second, reference)
    (record,) = second.report["recoveries"]
    assert (record["fault"], record["strategy"]) == ("process_lost", "dump"), record


@pytest.mark.slow  # CI: the retry above; the restart in place is the torch Guard's (test_defaults)
def test_a_lost_rank_under_the_defaults_is_restarted_in_place_bit_identical(tmp_path, reference):
    """``trainguard run``'s defaults (recover-in-place, a restart budget):
    the lost rank's new process joins the survivors, which keep theirs."""
    job = run_example(tmp_path, "accelerate", "crash", steps=STEPS, fault="crash:rank=1,step=5,phase=backward")
    assert job.rc == 0, job
    same_end(job, reference)
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"]) == ("process_lost", 1, "recover-in-place"), record
    assert len(job.report["pids"]["0"]) == 1 and len(job.report["pids"]["1"]) == 2, job.report["pids"]
