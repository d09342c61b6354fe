"""The torch Guard with in-memory snapshots, in real jobs under ``trainguard run``:
a restarted job resumes from memory (or, when its snapshots are corrupt,
from storage) and ends bit-identical to a fault-free run; the dying-gasp
save reuses the snapshot; nothing is left in shared memory. The same with
``snapshot_shared``, where rank 1 keeps only its random streams and resumes
with rank 0's snapshot of the state."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from conftest import WORKERS, run_job
from trainguard.adapters.torch.checkpoints import read_stored_snapshot

SCRIPT = WORKERS / "snapshot_train.py"
pytestmark = pytest.mark.timeout(240)


def _job(job_runner, name, **kw):
    """A job of SCRIPT. Its lost rank is dumped and the group restarted from the snapshots (with
    --max-restarts, torch's agent): the strategies before issue 43's defaults, which restart a lost
    rank alone instead (tests/test_defaults.py)."""
    job_id = f"snaptest-{uuid.uuid4().hex[:8]}"
    kw.setdefault("strategies", "retry,dump,exit")
    job = job_runner(name, nproc=2, steps=12, save_every=4, script=SCRIPT,
                     extra_args=["--job-id", job_id, *kw.pop("extra_args", [])], **kw)
    assert not list(Path("/dev/shm").glob(f"trainguard-{job_id}-*")), "the node agent must remove its snapshots"
    return job


def _said(job) -> str:
    """What the job logged about snapshots and resuming (pytest cuts a whole job's repr short)."""
    return "\n".join(line for line in job.log.splitlines()
                     if any(w in line for w in ("snapshot", "resumed", "slot", "sealed", "checksum")))


def _rank_reports(job) -> dict[int, dict]:
    name = job.ckpt.name.removesuffix("-ckpt")
    return {int(p.suffix[1:]): json.loads(p.read_text()) for p in job.ckpt.parent.glob(f"{name}.json.[0-9]")}


# A crash at step N strikes in the forward right after update N, while the copy of step N's snapshot
# runs beside it: whether that copy landed first is a race (lost, the rank rightly resumes from storage).
# Each step sleeps first, so the tests that expect a restart from memory at step N see it land.
LANDED = {"SNAP_STEP_SLEEP": "0.3"}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    job = _job(lambda name, **kw: run_job(tmp, name, **kw), "clean")
    assert job.rc == 0, job
    assert job.report["snapshots"]["errors"] == [] and job.report["snapshots"]["resumed_from"] is None
    return job.report["final_state_sha256"]


def test_crash_dump_reuses_the_snapshot_and_the_restart_loads_from_memory(job_runner, fault_free):
    job = _job(job_runner, "crash", fault="crash:rank=1,step=6", extra_args=["--max-restarts", "1"], env=LANDED)
    assert job.rc == 0, job
    r = job.report
    assert r["final_state_sha256"] == fault_free, job
    # The dying gasp at step 6 was the snapshot already in memory, written out as is.
    dump = job.ckpt / "step_00000006"
    assert sorted(p.name for p in dump.iterdir()) == ["manifest.json", "own_r0.bin", "own_r1.bin",
                                                      "shard_k0_r0.safetensors"], job  # rank 1's own part carried
    assert [rec["strategy"] for rec in r["recoveries"]] == ["dump"], job
    # The restarted processes resumed from memory at the locked step.
    reports = _rank_reports(job)
    assert {rank: rep["snapshots"]["resumed_from"] for rank, rep in reports.items()} == \
        {0: {"step": 6, "source": "memory"}, 1: {"step": 6, "source": "memory"}}, _said(job)
    assert all(len(pids) == 2 for pids in r["pids"].values()), r["pids"]
    assert "reuses its snapshot in memory" in job.log, job


DROPOUT = {"SNAP_DROPOUT": "1"}  # dropout drawing from each rank's own global RNG


@pytest.fixture(scope="module")
def dropout_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dropout-clean")
    job = _job(lambda name, **kw: run_job(tmp, name, **kw), "clean", env=DROPOUT)
    assert job.rc == 0, job
    return job.report["final_state_sha256"]


@pytest.mark.slow  # CI: the same with snapshot_shared
def test_random_streams_of_every_rank_come_back_from_memory(job_runner, dropout_free):
    """A restart from memory sets each rank's streams as they were at the
    step it resumes."""
    job = _job(job_runner, "dropout-crash", fault="crash:rank=1,step=6", extra_args=["--max-restarts", "1"],
               env={**DROPOUT, **LANDED})
    assert job.rc == 0, job
    assert {rank: rep["snapshots"]["resumed_from"] for rank, rep in _rank_reports(job).items()} == \
        {0: {"step": 6, "source": "memory"}, 1: {"step": 6, "source": "memory"}}, job
    assert job.report["final_state_sha256"] == dropout_free, job


def test_random_streams_of_a_rank_that_saves_no_shard_come_back_from_storage(job_runner, dropout_free):
    """Rank 0 saves the shard; every rank writes its own part (streams,
    data position) beside it, and takes it back when it resumes from storage."""
    job = _job(job_runner, "dropout-storage", fault="crash:rank=1,step=7", strategies="exit",
               extra_args=["--max-restarts", "1"], env={**DROPOUT, "CORRUPT_ON_RESTART": "1"})
    assert job.rc == 0, job
    assert _rank_reports(job)[1]["snapshots"]["resumed_from"] == {"step": 4, "source": "storage"}, job
    manifest = json.loads((job.ckpt / "step_00000004" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["own_r0.bin", "own_r1.bin", "shard_k0_r0.safetensors"], manifest
    assert "random streams" not in job.log, job  # every rank found its own
    assert job.report["final_state_sha256"] == dropout_free, job


def test_corrupt_snapshot_in_memory_falls_back_to_storage(job_runner, fault_free):
    job = _job(job_runner, "corrupt", fault="crash:rank=1,step=7", strategies="exit",
               extra_args=["--max-restarts", "1"], env={"CORRUPT_ON_RESTART": "1"})
    assert job.rc == 0, job
    assert job.report["final_state_sha256"] == fault_free, job
    reports = _rank_reports(job)
    # Rank 1's snapshots fail their checksum, so it takes the newest complete
    # checkpoint on storage (step 4), and rank 0 resumes at the same step
    # (from its memory if a slot still holds step 4, else from storage).
    assert reports[1]["snapshots"]["resumed_from"] == {"step": 4, "source": "storage"}, job
    assert reports[0]["snapshots"]["resumed_from"]["step"] == 4, job
    assert "fails its checksum (corrupted in memory)" in job.log, job



SHARED = {"SNAPSHOT_SHARED": "1"}


def test_shared_snapshots_a_replica_resumes_with_its_holders_state_and_its_own_streams(job_runner, dropout_free):
    job = _job(job_runner, "shared-crash", fault="crash:rank=1,step=6", extra_args=["--max-restarts", "1"],
               env={**DROPOUT, **SHARED, **LANDED})
    assert job.rc == 0, job
    reports = _rank_reports(job)
    resumed = {rank: rep["snapshots"]["resumed_from"] for rank, rep in reports.items()}
    assert resumed[0] == {"step": 6, "source": "memory"}, job
    assert resumed[1]["step"] == 6 and resumed[1]["source"] == "memory" and \
        resumed[1]["state_of"].startswith("r0.s"), job
    # After its first snapshot (rank 0's did not exist yet) rank 1 copied its own streams only.
    assert reports[0]["snapshots"]["shared"] == {"holder": 0, "own_part_taken": 0}, job
    assert reports[1]["snapshots"]["shared"]["holder"] == 0, job
    assert reports[1]["snapshots"]["shared"]["own_part_taken"] >= 12 - 6 - 1, job  # the restarted process's
    assert "reuses its snapshot in memory" in job.log, job  # rank 0's, for the dying gasp
    assert job.report["final_state_sha256"] == dropout_free, job


def test_shared_snapshots_when_the_holder_dies_its_replica_saves_its_whole_state(job_runner, fault_free):
    job = _job(job_runner, "shared-holder", fault="crash:rank=0,step=6", extra_args=["--max-restarts", "1"],
               env={**SHARED, **LANDED})
    assert job.rc == 0, job
    manifest = json.loads((job.ckpt / "step_00000006" / "manifest.json").read_text())
    assert [s["saved_by"] for s in manifest["layout"]["shards"]] == [1], manifest
    (name,) = manifest["layout"]["shards"][0]["files"]  # rank 1's snapshot held its streams only: it took a whole one
    assert {"model", "optimizer"} <= set(read_stored_snapshot(job.ckpt / "step_00000006" / name, "cpu")), manifest
    reports = _rank_reports(job)
    assert reports[1]["snapshots"]["resumed_from"]["step"] == 6, job
    assert reports[1]["snapshots"]["resumed_from"]["source"] == "memory", job
    assert reports[0]["snapshots"]["resumed_from"]["step"] == 6, job
    assert job.report["final_state_sha256"] == fault_free, job


def test_shared_snapshots_a_corrupt_holder_snapshot_sends_its_replicas_to_storage(job_runner, fault_free):
    # Rank 1's snapshot of step 7 must land before the crash (LANDED): without it rank 1 may hold no
    # step that rank 0 holds, and never read r0's.
    job = _job(job_runner, "shared-corrupt", fault="crash:rank=1,step=7", strategies="exit",
               extra_args=["--max-restarts", "1"], env={**SHARED, "CORRUPT_ON_RESTART": "0", **LANDED})
    assert job.rc == 0, job
    reports = _rank_reports(job)
    assert {rank: rep["snapshots"]["resumed_from"] for rank, rep in reports.items()} == \
        {0: {"step": 4, "source": "storage"}, 1: {"step": 4, "source": "storage"}}, job
    # Rank 1 read its own part, then rank 0's snapshot of the state failed its checksum, as it did for rank 0.
    assert any("rank 1 " in line and ": r0.s" in line and "fails its checksum" in line
               for line in job.log.splitlines()), job
    assert job.report["final_state_sha256"] == fault_free, job
