"""A save whose file will never be written -- the rank that had to write it
was lost before it did, and its replacement does not write that step -- is
given up at once by the rank that finalises it (:meth:`SnapshotRing.give_up`),
not waited for until the save timeout while training waits for the snapshot
slot it holds. The real-process case is in ``test_defaults.py``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from trainguard.adapters.torch.snapshot import Snapshots
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot.records import give_up, record_path

pytestmark = pytest.mark.timeout(120)

NAME = "shard_k0_r0.safetensors"
OWN = ["own_r0.bin", "own_r1.bin"]


@pytest.fixture
def snaps(shm):
    ring = Snapshots(shm, 0, count=2)
    yield ring
    ring.close()


def _save(snaps: Snapshots, root: Path, step: int, *, written: list[str]) -> CheckpointStore:
    """Rank 0's save of ``step``, finalised by its worker: its shard persisted,
    the own parts in ``written`` beside it (the others' not yet)."""
    store = CheckpointStore(root)
    index = snaps.take({"w": torch.full((1000,), float(step))}, step)
    for name in written:
        snaps.write_beside(store, step, name, lambda n=name: store.write(step, n, lambda f: f.write(n.encode())),
                           whole=False)
    layout = {"world_size": 2, "shards": [{"kind": 0, "copies": [0, 1], "full": True, "saved_by": 0,
                                           "files": [NAME]}]}
    snaps.persist(index, step, root=str(root), name=NAME,
                  finalize={"expected": [NAME, *OWN], "timeout_s": 600, "layout": layout, "meta": {}})
    return store


def _answered(snaps: Snapshots) -> None:
    deadline = time.monotonic() + 60  # (far below the save's 600 s timeout: a wait for the file fails here)
    while snaps.pinned and time.monotonic() < deadline:
        snaps.poll(timeout=0.2)
    assert not snaps.pinned, "the finaliser still waits"


def test_a_file_whose_writer_was_lost_gives_the_save_up_at_once_in_one_line(snaps, tmp_path, caplog):
    root = tmp_path / "ckpt"
    store = _save(snaps, root, 3, written=["own_r0.bin"])
    with caplog.at_level(logging.DEBUG, logger="trainguard"):
        assert snaps.give_up(store, ["own_r1.bin"], "rank 1 died before writing it and was restarted") == [3]
        _answered(snaps)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["rank 0: the checkpoint of step 3 is given up: own_r1.bin will never be written (rank 1 "
                        "died before writing it and was restarted). Training goes on; the next save writes a "
                        "complete one (the newest complete checkpoint is none)"], warnings
    assert snaps.health.failing is None and not snaps.persisted  # not a failure of the store; nothing final
    assert store.tracked_step() is None and store.latest() is None
    deadline = time.monotonic() + 30  # the worker removes the step's directory between requests
    while store.tmp_path(3).exists() and time.monotonic() < deadline:
        snaps.poll(timeout=0.2)
    assert not store.tmp_path(3).exists()


def test_a_file_its_writer_wrote_before_it_was_lost_still_completes_the_save(snaps, tmp_path):
    root = tmp_path / "ckpt"
    store = _save(snaps, root, 3, written=OWN)
    assert snaps.give_up(store, ["own_r1.bin"], "rank 1 was lost") == []
    _answered(snaps)
    assert store.latest().step == 3 and set(store.latest().manifest["files"]) == {NAME, *OWN}


def test_a_step_done_with_is_not_made_again(tmp_path):
    """The finaliser removed the records (it finalised, or gave the step
    up): marking a file lost there would leave a stray directory behind."""
    store = CheckpointStore(tmp_path / "ckpt")
    assert give_up(store, 5, ["own_r1.bin"]) == []
    assert not store.tmp_path(5).exists()
    record_path(store.tmp_path(6), "x").parent.mkdir(parents=True)
    assert give_up(store, 6, ["own_r1.bin"]) == ["own_r1.bin"]
    assert record_path(store.tmp_path(6), "own_r1.bin").with_suffix(".lost").exists()
