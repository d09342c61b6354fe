"""The persist worker keeps its trainer's slots mapped from one request to
the next (:class:`~trainguard.core.snapshot.segment.Mappings`)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import torch

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.adapters.torch.snapshot import Snapshots
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import SnapshotDir
from trainguard.core.snapshot.segment import Mappings, Slot, State


def _write(path: Path, step: int, data: bytes) -> None:
    """A complete snapshot of ``data`` in the slot at ``path``, as a trainer writes one."""
    slot = Slot(path)
    assert slot.lock(True)
    slot.begin(len(data))[:] = data
    slot.commit(step, len(data))
    slot.close()


def _exclusive(path: Path) -> bool:
    """Whether another open of the file gets its exclusive lock at once (as the trainer's next snapshot does)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_slot_is_mapped_once_mapped_again_when_rewritten_larger_or_replaced_and_never_left_locked(tmp_path):
    path, maps = tmp_path / "r0.s0", Mappings()
    _write(path, 1, b"a" * 5000)
    seen = []
    for _ in range(2):  # a seal and a persist of the same snapshot
        slot = Slot(path, maps)
        assert slot.lock(False, block=True)
        assert slot.seal() is not None and bytes(slot.payload()) == b"a" * 5000
        seen.append(id(slot._map))
        slot.close()
        # The mapping holds a duplicate of the closed descriptor: the lock must not stay with it.
        assert _exclusive(path)
    assert seen[0] == seen[1]

    _write(path, 2, b"b" * 9000)  # a new layout: the slot grows
    slot = Slot(path, maps)
    slot.lock(False, block=True)
    assert slot.info().state is State.COMPLETE and bytes(slot.payload()) == b"b" * 9000
    assert id(slot._map) != seen[0]
    slot.close()

    path.unlink()  # a new file at the same path and of the same size
    _write(path, 3, b"c" * 9000)
    slot = Slot(path, maps)
    slot.lock(False, block=True)
    assert slot.info().step == 3 and bytes(slot.payload()) == b"c" * 9000
    slot.close()
    assert _exclusive(path)
    maps.close()


def _mapped(pid: int, path: Path) -> int:
    """How many mappings of ``path`` process ``pid`` holds."""
    return sum(line.rstrip().endswith(str(path)) for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_the_persist_worker_maps_each_slot_once_across_seals_and_persists(tmp_path):
    (tmp_path / "shm").mkdir()
    shm = SnapshotDir.create("mappings", str(tmp_path / "shm"))
    snaps = Snapshots(shm, 0, count=2)
    root = tmp_path / "ckpt"
    try:
        w = torch.zeros(1 << 16)
        for step in range(1, 7):  # each slot used three times: a seal and a persist each time
            w.fill_(step)
            state = {"state": {"w": w}}
            index = snaps.take(state, step)
            snaps.persist(index, step, root=str(root), name="s.safetensors",
                          finalize={"expected": ["s.safetensors"], "layout": {
                              "world_size": 1, "shards": [{"kind": 0, "copies": [0], "full": True, "saved_by": 0,
                                                           "files": ["s.safetensors"]}]}})
            snaps.wait(60)
            assert not snaps.errors and snaps.persisted[-1]["step"] == step
        pid = snaps.worker.pid
        assert [_mapped(pid, s.path) for s in snaps.slots] == [1, 1]
        found = CheckpointStore(root).latest()
        assert found.step == 6
        assert torch.equal(read_stored_snapshot(found.file("s.safetensors"), torch.device("cpu"))["w"],
                           torch.full((1 << 16,), 6.0))
    finally:
        snaps.close()
        shm.remove()
