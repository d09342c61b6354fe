"""trainguard.integrations.lightning in real processes: a LightningModule
fitted by ``L.Trainer`` with GuardedDDPStrategy (examples/lightning/train.py:
dropout, AdamW with a per-step LambdaLR, a shuffled loader that Lightning
gives a DistributedSampler and whose fetcher prefetches), on 2 gloo ranks
under ``trainguard run``. The forward and backward pass run as a closure
inside ``optimizer.step``: a fault there, or in the update, is retried with
the same batch and ``trainer.fit()`` goes on; a lost rank is dumped and the
relaunch resumes Lightning's counters and the loader at the Guard's step.
Each ends where the fault-free run ends: model, optimizer, every rank's
random streams and data position, Lightning's global step."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import ROOT, run_bounded
from integration_jobs import run_example, same_end

pytestmark = pytest.mark.timeout(900)

STEPS = 14  # 6 batches per rank and epoch: two epoch boundaries crossed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_example(tmp_path_factory.mktemp("lightning"), "lightning", "ref", steps=STEPS)
    assert job.rc == 0, job
    assert job.report["lightning_global_step"] == STEPS
    return job


# CI's budget: the accelerate integration's retry stands for the three (tests/test_integrations_accelerate.py).
@pytest.mark.parametrize("fault", [
    pytest.param("uce:rank=1,step=5,phase=backward", marks=pytest.mark.slow),
    # rank 1 takes rank 0's state of step 6 and starts batch 6 with Lightning's SIGTERM broadcast; rank 0, stopped
    # in its own broadcast of batch 6 and retrying that batch, must take part in it again (a second retry before)
    pytest.param("uce:rank=1,step=5,phase=optimizer", marks=pytest.mark.slow),
    pytest.param("comm:rank=0,step=6,phase=backward", marks=pytest.mark.slow),  # the first batch of epoch 2
])
def test_a_fault_in_the_closure_or_the_update_is_retried_and_fit_goes_on(tmp_path, reference, fault):
    job = run_example(tmp_path, "lightning", "fault", steps=STEPS, fault=fault)
    assert job.rc == 0, job
    same_end(job, reference)
    assert job.report["lightning_global_step"] == STEPS
    assert len(job.report["recoveries"]) == 1, job.report["recoveries"]  # one retry: no second one after it
    (record,) = job.report["recoveries"]
    assert record["strategy"] == "retry", record
    assert all(len(pids) == 1 for pids in job.report["pids"].values()), "a process was restarted"


@pytest.mark.slow  # CI: the retry above; the dump's path is the torch Guard's (test_torch_recovery)
@pytest.mark.parametrize("fault", [
    "crash:rank=1,step=4,phase=backward",   # dump at step 4: epoch 0, batch 4
    "crash:rank=1,step=5,phase=optimizer",  # dump at step 6 (rank 0 committed it): epoch 1's first batch
    "crash:rank=1,step=7,phase=optimizer",  # dump at step 8: epoch 1, batch 2
])
def test_a_lost_rank_is_dumped_and_the_relaunch_ends_bit_identical(tmp_path, reference, fault):
    """The relaunch sets Lightning's epoch and batch from the batches per
    epoch on a rank (the loader as Lightning processed it, with its
    DistributedSampler): past the first epoch, the loader given to fit
    (every rank's batches) put it in the wrong epoch and shuffle."""
    first = run_example(tmp_path, "lightning", "crash", steps=STEPS, fault=fault, max_restarts=0)
    assert first.rc == 75, first
    second = run_example(tmp_path, "lightning", "crash", steps=STEPS, fault=fault, ckpt=first.ckpt, max_restarts=0)
    assert second.rc == 0, second
    same_end(second, reference)
    assert second.report["lightning_global_step"] == STEPS
    (record,) = second.report["recoveries"]
    assert (record["fault"], record["strategy"]) == ("process_lost", "dump"), record


@pytest.mark.slow  # CI: the refusal's decision (test_decide's join_refused), the torch Guard's restarts (test_defaults)
def test_a_lost_rank_under_the_defaults_is_dumped_and_the_group_restarted_bit_identical(tmp_path, reference):
    """``trainguard run``'s defaults (recover-in-place, a restart budget):
    no new process can join a running Lightning job (it hung in fit's setup,
    the survivors waiting in the join), so the rank says so at start, the
    lost rank is dumped and the launcher restarts the group from the dump."""
    job = run_example(tmp_path, "lightning", "crash", steps=STEPS, fault="crash:rank=1,step=5,phase=backward")
    assert job.rc == 0, job
    same_end(job, reference)
    assert job.report["lightning_global_step"] == STEPS
    assert "a new process cannot join a running Lightning job" in job.log, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"]) == ("process_lost", 1, "dump"), record
    assert all(len(p) == 2 for p in job.report["pids"].values()), job.report["pids"]  # the group restarted


def test_training_batches_whose_position_the_guard_cannot_keep_are_refused_before_step_0(tmp_path):
    """An iterable of the script's own given to fit (no DataLoader to wrap
    in ResumableLoader): trained before, its position unsaved, so a
    relaunch or a rollback went on with other batches than a fault-free run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MASTER_", "RANK", "WORLD_SIZE",
                                                                         "LOCAL_RANK"))}
    proc = run_bounded([sys.executable, str(ROOT / "tests" / "workers" / "lightning_own_iterable.py"), str(tmp_path)],
                       env=env, cwd=tmp_path, timeout=120, merge=True)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "ConfigError: GuardedDDPStrategy keeps the position of one training loader" in proc.stdout, proc.stdout[-3000:]
    assert "got Batches" in proc.stdout and "trained" not in proc.stdout, proc.stdout[-3000:]
