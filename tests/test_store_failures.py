"""A checkpoint store that fails -- full, over quota, read-only, failing I/O,
gone -- does not stop training that still has its state in memory: the
save fails, one warning per streak of failed saves says so, the previous
checkpoint stays whole, the next periodic save tries again, and
``trainguard status`` shows it meanwhile.

The jobs run on a tiny tmpfs mounted in a user and mount namespace of their
own (``unshare``), which rank 0 fills up (or remounts read-only) between two
saves. The persist worker's error paths are driven in process with a store
whose writes fail with a given errno."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from store_jobs import StoreJob
from trainguard.adapters.torch.snapshot import Snapshots
from trainguard.core import CheckpointError, ControllerConfig
from trainguard.core.api import DataStatus, RankStatus, RunStatus
from trainguard.core.reports import Hello, PersistReport
from trainguard.core.checkpoint import CheckpointStore, FileInfo, io_error
from trainguard.core.control.controller import ControllerCore
from trainguard.core.snapshot.persist import _persist
from trainguard.core.snapshot.records import write_record

pytestmark = pytest.mark.timeout(300)

NAME = "shard_k0_r0.safetensors"


# ------------------------------------------------------------------ persist
@pytest.fixture
def snaps(shm):
    ring = Snapshots(shm, 0, count=2)
    yield ring
    ring.close()


def _slot(snaps: Snapshots, step: int) -> str:
    index = snaps.take({"w": torch.full((1000,), float(step)), "step": step}, step)
    return str(snaps.slots[index].path)


class FailingStore(CheckpointStore):
    """A store whose writes (``copy_file``) or finalise fail with ``errno``,
    as :class:`CheckpointStore` reports an ``OSError``."""

    def __init__(self, root: Path, err: int, *, at: str = "copy_file") -> None:
        super().__init__(root)
        self.err, self.at = err, at

    def _fail(self, what: str):
        return io_error(what, OSError(self.err, os.strerror(self.err)))

    def copy_file(self, step, name, data, xxh3):
        if self.at == "copy_file":
            raise self._fail(f"writing {self.tmp_path(step) / name}")
        return super().copy_file(step, name, data, xxh3)

    def finalize(self, step, files, **kw):
        if self.at == "finalize":
            raise self._fail(f"finalising {self.final_path(step)}")
        return super().finalize(step, files, **kw)


def _layout(world_size: int, name: str = NAME) -> dict:
    """One dense shard, held by every rank, in file ``name``."""
    return {"world_size": world_size, "shards": [{"kind": 0, "copies": list(range(world_size)), "full": True,
                                                  "saved_by": 0, "files": [name]}]}


def _fin(world_size: int = 1, *others: str, **more) -> dict:
    return {"expected": [NAME, *others], "timeout_s": 60, "layout": _layout(world_size), "meta": {}, **more}


def _complete(root: Path, step: int) -> CheckpointStore:
    store = CheckpointStore(root)
    store.finalize(step, [store.write(step, "a.pt", lambda f: f.write(b"old"))], layout=_layout(1, "a.pt"))
    return store


def _request(snaps, root: Path, step: int, *, finalize: dict | None = None, name: str = NAME) -> dict:
    return {"slot": _slot(snaps, step), "step": step, "root": str(root), "naming": "torch", "name": name,
            "finalize": finalize}


def test_a_record_the_store_refuses_is_a_checkpoint_error_naming_the_reason(tmp_path):
    """A full store (the record's file is /dev/full: a real ENOSPC from the
    kernel) and a vanished directory (a file where the checkpoint directory's
    parent was) give a CheckpointError saying why, not a bare OSError, and
    leave no half-written record."""
    store = CheckpointStore(tmp_path / "ckpt")
    records = store.tmp_path(3) / ".records"
    records.mkdir(parents=True)
    (records / "own_r1.bin.part").symlink_to("/dev/full")
    with pytest.raises(CheckpointError, match=r"recording own_r1.bin of step 3: the disk is full \(No space"):
        write_record(store, 3, FileInfo("own_r1.bin", 10, "ab"))
    assert list(records.iterdir()) == []

    (tmp_path / "gone").write_text("not a directory any more")
    with pytest.raises(CheckpointError, match="Not a directory"):
        write_record(CheckpointStore(tmp_path / "gone" / "ckpt"), 3, FileInfo("own_r1.bin", 10, "ab"))


def test_a_failed_file_is_recorded_by_an_empty_file(tmp_path):
    """It needs no data block: a full store still takes it (the job tests
    below see it on a full tmpfs)."""
    store = CheckpointStore(tmp_path / "ckpt")
    write_record(store, 3, FileInfo("own_r1.bin", -1, ""))
    assert [(p.name, p.stat().st_size) for p in (store.tmp_path(3) / ".records").iterdir()] == \
        [("own_r1.bin.failed", 0)]


@pytest.mark.parametrize("err, says", [(errno.ENOSPC, "the disk is full"), (errno.EDQUOT, "the disk is full"),
                                       (errno.EROFS, "Read-only file system"), (errno.EIO, "Input/output error")])
def test_a_persist_the_store_refuses_is_answered_with_the_reason(snaps, tmp_path, err, says):
    """Not a raised error: the trainer goes on. The reply names the reason
    and the newest complete checkpoint; the file is recorded as failed so
    the finalising rank stops waiting; the previous checkpoint is whole."""
    root = tmp_path / "ckpt"
    _complete(root, 4)
    reply = _persist(_request(snaps, root, 6), os.getpid(), store=FailingStore(root, err))
    assert reply["ok"] is False and says in reply["error"] and reply["last_complete"] == 4
    assert not reply["superseded"]
    assert (root / "step_00000006_tmp" / ".records" / f"{NAME}.failed").exists()
    assert CheckpointStore(root).latest().step == 4


def test_the_finaliser_gives_up_at_once_on_a_failed_record_and_removes_the_step(snaps, tmp_path):
    """Another rank's file could not be written: the finalising worker does
    not wait its timeout, and removes the step's temporary directory (and an
    older one a slower rank left) so a full store gets its space back."""
    root = tmp_path / "ckpt"
    store = _complete(root, 2)
    write_record(store, 4, FileInfo("own_r1.bin", -1, ""))  # an older failed save, left behind
    write_record(store, 6, FileInfo("own_r1.bin", -1, ""))
    fin = _fin(2, "own_r1.bin", timeout_s=600)
    started = time.monotonic()
    reply = _persist(_request(snaps, root, 6, finalize=fin), os.getpid())
    assert time.monotonic() - started < 30
    assert reply["ok"] is False and "['own_r1.bin'] could not be written; not finalised" in reply["error"]
    assert sorted(p.name for p in root.iterdir()) == ["latest_step.txt", "step_00000002"]


def test_a_worker_that_gave_up_removes_the_step_once_the_other_ranks_are_done(snaps, tmp_path):
    """Its own file failed while another rank was still writing its own:
    the directory goes once that rank's record (here: failed) is in, so the
    slower rank does not make it again after it was removed."""
    from trainguard.core.snapshot.records import Leftovers

    root, leftovers = tmp_path / "ckpt", Leftovers()
    store = FailingStore(root, errno.ENOSPC)
    fin = _fin(2, "own_r1.bin", timeout_s=600)
    reply = _persist(_request(snaps, root, 6, finalize=fin), os.getpid(), store=store, leftovers=leftovers)
    assert reply["ok"] is False and leftovers.pending
    store.write(6, "own_r1.bin", lambda f: f.write(b"rank 1, slower"))
    leftovers.check()
    assert (root / "step_00000006_tmp" / "own_r1.bin").exists()
    write_record(store, 6, FileInfo("own_r1.bin", -1, ""))
    leftovers.check()
    assert not leftovers.pending and not (root / "step_00000006_tmp").exists()


@pytest.mark.parametrize("at", ["copy_file", "finalize"])
def test_a_finaliser_whose_store_fails_removes_the_step_and_keeps_the_tracker(snaps, tmp_path, at):
    """Its own file, or the manifest, does not fit: nothing of the step is
    left and the tracker still names the previous checkpoint."""
    root = tmp_path / "ckpt"
    _complete(root, 2)
    store = FailingStore(root, errno.ENOSPC, at=at)
    reply = _persist(_request(snaps, root, 6, finalize=_fin()), os.getpid(), store=store)
    assert reply["ok"] is False and "the disk is full" in reply["error"] and reply["last_complete"] == 2
    assert sorted(p.name for p in root.iterdir()) == ["latest_step.txt", "step_00000002"]
    assert CheckpointStore(root).tracked_step() == 2


def test_a_superseded_save_is_told_apart_from_a_failing_store(snaps, tmp_path):
    root = tmp_path / "ckpt"
    _complete(root, 8)
    reply = _persist(_request(snaps, root, 6), os.getpid())
    assert reply["ok"] is False and reply["superseded"] and "newer step 8 is final already" in reply["error"]


def test_a_vanished_store_fails_saves_until_it_is_back(snaps, tmp_path, caplog):
    """Through the persist worker: the checkpoint directory's parent is
    replaced by a file, the save fails (one warning), a second one fails
    silently, and once the directory is back the next save is finalised
    (one info line)."""
    parent = tmp_path / "mnt"
    parent.write_text("the mount went away")
    root = parent / "ckpt"
    fin, told = _fin(), []
    snaps.health.tell = told.append
    with caplog.at_level(logging.INFO, logger="trainguard.snapshot"):
        for step in (2, 4, 6):
            if step == 6:
                parent.unlink()
                parent.mkdir()
            snaps.persist(snaps.take({"w": torch.full((100,), float(step))}, step), step, root=str(root), name=NAME,
                          finalize=fin)
            snaps.wait(60)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "the checkpoint of step 2 was not saved" in warned[0], warned
    assert "Not a directory" in warned[0] and "the newest complete checkpoint is none" in warned[0]
    assert sum("the store works again (2 saves failed, steps 2-4)" in r.getMessage() for r in caplog.records) == 1
    assert [f if f is None else f.since for f in told] == [2, None]
    (streak,) = snaps.report(None)["persist_streaks"]
    assert (streak["since"], streak["latest"], streak["failed"], streak["last_complete"]) == (2, 4, 2, None)
    assert "Not a directory" in streak["reason"] and snaps.report(None)["persist_failing"] is None
    assert CheckpointStore(root).latest().step == 6


# ------------------------------------------------------------------ health, controller
def test_health_tells_once_per_streak_counting_saves_not_files(caplog):
    from trainguard.core.snapshot.health import PersistHealth

    told = []
    health = PersistHealth(3, tell=told.append)
    with caplog.at_level(logging.INFO, logger="trainguard.snapshot"):
        health.saved(2, final=True)
        health.failed(4, "own part: the disk is full", 2)
        health.failed(4, "shard: the disk is full", 2)  # the same save: its shard failed too
        health.failed(6, "the disk is full", None)
        health.saved(6)  # its own part of step 6 was written, its shard was not: still failing
        health.saved(8, final=True)
        health.failed(10, "Input/output error")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "INFO", "WARNING"], lines
    assert "step 4 was not saved: own part: the disk is full" in lines[0][1] and "is step 2" in lines[0][1]
    assert "(2 saves failed, steps 4-6)" in lines[1][1]
    assert "newest complete checkpoint is step 8" in lines[2][1]  # as this process saw it finalised
    assert [f if f is None else (f.since, f.last_complete) for f in told] == [(4, 2), None, (10, 8)]
    assert health.failing.describe() == \
        "persist failing since step 10: Input/output error; last complete checkpoint: step 8"


def test_the_controller_shows_whose_saves_fail_in_its_status():
    core = ControllerCore(ControllerConfig(), 2, send=lambda r, c: None)
    for rank in range(2):
        core.on_hello(Hello(rank=rank, pid=1 + rank,
                            status=RankStatus(step=1, run=RunStatus.TRAINING, data=DataStatus.UPDATED)))
    assert core.snapshot()["persist"] is None
    core.on_persist(1, PersistReport(failing=True, since_step=8, reason="the disk is full", last_complete=6))
    core.on_persist(0, PersistReport(failing=True, since_step=10, reason="Input/output error", last_complete=None))
    status = core.snapshot()["persist"]
    assert status["failing"] == "persist failing since step 8 on ranks [0, 1]: the disk is full; " \
                                "last complete checkpoint: step 6"
    assert status["ranks"]["0"] == {"since_step": 10, "reason": "Input/output error", "last_complete": None}
    core.on_persist(1, PersistReport(failing=False))
    core.on_persist(0, PersistReport(failing=False))
    assert core.snapshot()["persist"] is None


# ------------------------------------------------------------------ jobs
@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    job = StoreJob(tmp_path_factory.mktemp("clean"), "clean").finish()
    assert job.rc == 0 and job.ranks[0]["snapshots"]["errors"] == [], job
    assert job.store["latest"] == 12 and job.store["tmp"] == [], job
    return job.ranks[0]["final_state_sha256"]


def test_a_full_store_leaves_training_going_and_the_last_checkpoint_that_fit(tmp_path, fault_free):
    """The disk fills after the save of step 4 and stays full: every later
    save fails, training finishes (exit 0) bit-identical to a fault-free
    run, each rank warns once, the status shows it while the job runs, step
    4 is the newest complete checkpoint and verifies, and no failed save
    left anything behind."""
    job = StoreJob(tmp_path, "full", env={"STORE_BREAK_AT": "5", "STORE_HOLD_AT": "8"})
    # Each rank's failed persist reaches the controller with its own next report: wait for both.
    status = job.hold(8, lambda s: "on ranks [0, 1]" in (s.get("persist") or {}).get("failing", ""))
    job.finish()
    assert job.rc == 0, job
    assert all(rep["final_state_sha256"] == fault_free for rep in job.ranks.values()), job
    assert status["persist"]["failing"].startswith("persist failing since step 6 on ranks [0, 1]: writing "), status
    assert "the disk is full" in status["persist"]["failing"]
    assert status["persist"]["failing"].endswith("; last complete checkpoint: step 4"), status
    for rank in (0, 1):
        assert len(job.said("was not saved", rank)) == 1, job.said("was not saved")
        assert len(job.said("training ended with its last 4 saves failed", rank)) == 1, job
        streak = job.ranks[rank]["snapshots"]["persist_failing"]
        assert (streak["since"], streak["latest"], streak["failed"], streak["last_complete"]) == (6, 12, 4, 4)
    assert job.store == {"steps": [4, 2], "tracked": 4, "latest": 4, "tmp": []}, job


def test_a_read_only_store_that_comes_back_is_saved_to_again(tmp_path, fault_free):
    """Remounted read-only after step 4, read-write before step 9: the saves
    of steps 6 and 8 fail (one warning per rank), the status shows it, then
    the save of step 10 succeeds (one info line per rank) and the status
    clears."""
    job = StoreJob(tmp_path, "ro", env={"STORE_BREAK_AT": "5", "STORE_BREAK": "readonly", "STORE_MEND_AT": "9",
                                     "STORE_HOLD_AT": "8,11"})
    failing = job.hold(8, lambda s: s.get("persist") is not None)
    mended = job.hold(11, lambda s: s.get("persist") is None)
    job.finish()
    assert job.rc == 0, job
    assert all(rep["final_state_sha256"] == fault_free for rep in job.ranks.values()), job
    assert "Read-only file system" in failing["persist"]["failing"] and mended["persist"] is None
    for rank in (0, 1):
        assert len(job.said("was not saved", rank)) == 1, job
        assert len(job.said("the store works again (2 saves failed, steps 6-8)", rank)) == 1, job
        assert job.ranks[rank]["snapshots"]["persist_failing"] is None
    assert job.store["steps"][:2] == [12, 10] and job.store["tracked"] == job.store["latest"] == 12, job
    assert job.store["tmp"] == [], job


def test_without_snapshots_a_full_store_does_not_stop_training_either(tmp_path, fault_free):
    """Synchronous saves: every rank hears in the save's all-gather that one
    failed; nobody raises, rank 0 removes the step's files."""
    job = StoreJob(tmp_path, "sync", env={"STORE_SNAPSHOTS": "0", "STORE_BREAK_AT": "5", "STORE_MEND_AT": "9"})
    job.finish()
    assert job.rc == 0, job
    assert all(rep["final_state_sha256"] == fault_free for rep in job.ranks.values()), job
    for rank in (0, 1):
        assert len(job.said("was not saved", rank)) == 1 and len(job.said("works again", rank)) == 1, job
    assert job.store == {"steps": [12, 10], "tracked": 12, "latest": 12, "tmp": []}, job


def test_a_dying_gasp_on_a_full_store_stops_with_the_reason_and_writes_nothing_newer(tmp_path):
    """The store is full, the save of step 6 failed (training went on), then
    rank 1 is killed in step 7: the dump cannot be written, so the job stops
    -- rank 0 exits 76, the launcher 1 -- saying why, and the newest
    checkpoint is still step 4."""
    job = StoreJob(tmp_path, "gasp", env={"STORE_BREAK_AT": "5", "STORE_CRASH_AT": "7"}).finish()
    assert job.rc == 1, job
    assert job.said("rank 1: process lost") and not job.said("unknown: OSError"), job
    assert job.said("save failed on rank 0: CheckpointError: writing") and job.said("the disk is full"), job
    assert job.said("trainguard: rank 0 failed with exit code 76"), job
    assert job.store["tracked"] == 4 and job.store["latest"] == 4 and job.store["steps"] == [4, 2], job
