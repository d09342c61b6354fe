"""Finding a rank's sealed snapshots in a node's memory, and loading one
whose checksum checks out (the load half of :mod:`.ring`)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..api import CheckpointError
from .segment import Slot, State
from .shm import SnapshotDir

__all__ = ["load_verified", "verified"]

log = logging.getLogger("trainguard.snapshot")


def verified(directory: SnapshotDir, slots: list[Slot], verify: bool, rank: int) -> dict[int, tuple[Slot, str]]:
    """The sealed snapshots among ``slots``, by step: (slot, "memory" or
    "peer memory"); with ``verify``, only those whose checksum checks out.
    Bad ones are logged (as ``rank``'s) and skipped."""
    found: dict[int, tuple[Slot, str]] = {}
    peer_dir = directory.path / "peer"
    for slot in slots:
        source = "peer memory" if slot.path.parent == peer_dir else "memory"
        try:
            if not slot.lock(False):
                continue
            info = slot.verified() if verify else slot.info()
            if info is None or info.state is not State.SEALED:
                raise CheckpointError(f"{slot.path.name}: snapshot is "
                                      f"{info.state.name.lower() if info else 'unreadable'}, not sealed")
            found.setdefault(info.step, (slot, source))
        except CheckpointError as e:
            log.warning("rank %d: not using snapshot %s: %s", rank, slot.path.name, e)
        finally:
            slot.unlock()
    return found


def load_verified(slot: Slot, read: Callable[[memoryview], Any],
                  then: Callable[[Any], Any] = lambda got: got) -> Any:
    """``then(read(payload))`` of a slot whose checksum checks out, under its
    lock (the read runs beside the checksum pass; its result is dropped
    unless the checksum matches; ``then`` runs after the check, with the
    payload still mapped).

    Raises:
        CheckpointError: the snapshot fails its check (or vanished).
    """
    try:
        if not slot.lock(False, block=True):
            raise CheckpointError(f"{slot.path.name}: gone")
        return then(slot.verified(read)[1])
    finally:
        slot.close()
