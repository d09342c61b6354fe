"""Snapshots shared by the data-parallel replicas on one node.

Replicas hold the same parameters and optimizer state, so one copy per node
is enough. With sharing on, the lowest replica of a shard on a node (its
*holder*) snapshots the whole state, and every other replica there only what
is its own -- its random streams -- naming the holder in its snapshot's
metadata (:data:`DENSE_FROM`). A replica resumes from memory at a step when
its own snapshot and the holder's of that step are both sealed here
(:func:`with_holders`); its state is then the holder's with its own streams.

A replica snapshots its whole state itself when the holder's snapshots on
this node do not keep up (:func:`keeping_up`: a holder restarted on another
node, or one that skipped a snapshot), and when a save needs its payload.
Which ranks share a node comes from torchrun's environment (:func:`local_ranks`)
or from the adapter (MindSpore: the ranks' machine ids). :class:`Sharing` is
one rank's side of it, for any adapter.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Iterable

from ..api import CheckpointError
from .segment import PAGE, Slot, State, payload_header

__all__ = ["DENSE_FROM", "Sharing", "choose_holder", "dense_from", "keeping_up", "local_ranks", "newest_step",
           "with_holders"]

log = logging.getLogger("trainguard.snapshot")

#: The metadata key of a snapshot holding only its rank's own part: the rank
#: whose snapshot of the same step holds the rest.
DENSE_FROM = "dense_from"
_MAX_HEADER = 256 << 20


def local_ranks(environ=os.environ) -> set[int]:
    """The global ranks torchrun placed on this node (``RANK``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; one rank when they are unset)."""
    rank = int(environ.get("RANK", "0"))
    local, size = int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_WORLD_SIZE", "1"))
    return set(range(rank - local, rank - local + size))


def choose_holder(rank: int, copies: Iterable[int], members: Iterable[int], local: set[int]) -> int:
    """The lowest live replica of ``rank``'s shard on this node (``rank`` itself when none is lower)."""
    members = set(members)
    return min([r for r in copies if r in local and r in members] + [rank])


def newest_step(slots: Iterable[Slot]) -> int | None:
    """The newest step a complete or sealed snapshot among ``slots`` holds."""
    steps = []
    for slot in slots:
        try:
            info = slot.info()
        finally:
            slot.close()
        if info is not None and info.state in (State.COMPLETE, State.SEALED):
            steps.append(info.step)
    return max(steps, default=None)


def keeping_up(newest: int | None, last_shared: int | None, every: int) -> bool:
    """Whether the holder's snapshots here (``newest``: its newest step) keep
    up with this rank's: it has one, and none is more than one interval
    behind the last this rank took as its own part only (``last_shared``;
    the holder's copy of the step before may still be running)."""
    return newest is not None and (last_shared is None or newest >= last_shared - every)


def dense_from(slot: Slot) -> int | None:
    """The holder a snapshot names (``None``: it holds the whole state),
    read from its payload header alone (a whole state is not mapped for it).

    Raises:
        CheckpointError: the payload header is malformed.
    """
    fd = slot.fileno()
    try:
        if fd is None:
            raise OSError("gone")
        (n,) = struct.unpack("<Q", os.pread(fd, 8, PAGE).ljust(8, b"\0"))
        if n > _MAX_HEADER:
            raise CheckpointError(f"{slot.path.name}: malformed snapshot payload header (length {n})")
        holder = payload_header(os.pread(fd, 8 + n, PAGE))[1].get(DENSE_FROM)
        return None if holder is None else int(holder)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{slot.path.name}: cannot read its payload header ({e})") from None


def with_holders(memory: dict[int, tuple[Slot, str]], holder_slots) -> tuple[dict, dict[int, Slot]]:
    """Narrow ``memory`` (step -> (slot, source), this rank's sealed
    snapshots) to the steps this rank can load: whole snapshots, and
    own-part ones whose holder's snapshot of the same step is sealed here.

    Args:
        holder_slots: ``holder_slots(rank)`` -> step -> that rank's sealed slots here.

    Returns:
        ``(memory, dense)``: the loadable steps, and for the own-part ones
        the holder's slot (the caller closes every slot it does not read).
    """
    loadable, dense, theirs = {}, {}, {}
    for step, (slot, source) in memory.items():
        try:
            holder = dense_from(slot)
        except CheckpointError as e:
            log.warning("not using snapshot %s: %s", slot.path.name, e)
            slot.close()
            continue
        if holder is None:
            loadable[step] = (slot, source)
            continue
        if holder not in theirs:
            theirs[holder] = holder_slots(holder)
        if step in theirs[holder]:
            loadable[step], dense[step] = (slot, source), theirs[holder].pop(step)
        else:
            log.warning("not using snapshot %s of step %d: rank %d's snapshot of that step is not sealed in "
                        "this node's memory", slot.path.name, step, holder)
            slot.close()
    for slots in theirs.values():
        for slot in slots.values():
            slot.close()
    return loadable, dense


class Sharing:
    """One rank's side of shared snapshots: whose snapshots hold its state,
    and which of its own snapshots hold its own part only.

    Args:
        rank: this rank.
        every: the snapshot interval (steps).
        enabled: sharing on (else this rank is always its own holder).
        local: the global ranks on this node.
    """

    def __init__(self, rank: int, every: int, enabled: bool, local: set[int]) -> None:
        self.rank, self.every, self.enabled, self.local = rank, every, enabled, set(local)
        self.own_part: dict[int, int] = {}  # step -> holder, of this rank's snapshots holding its own part only
        self.own_part_taken = 0
        self._behind = False

    def holder(self, copies: Iterable[int], members: Iterable[int], slots_of) -> int:
        """The rank whose snapshots hold this rank's state on this node: the
        lowest live replica here (while its snapshots keep up), else this
        rank. ``slots_of(rank)``: that rank's slots on this node."""
        if not self.enabled:
            return self.rank
        holder = choose_holder(self.rank, copies, members, self.local)
        if holder == self.rank:
            return holder
        last = max(self.own_part, default=None)
        if keeping_up(newest_step(slots_of(holder)), last, self.every):
            self._behind = False
            return holder
        if not self._behind and last is not None:
            log.warning("rank %d: rank %d's snapshots on this node fell behind; snapshotting the whole state",
                        self.rank, holder)
        self._behind = True
        return self.rank

    def meta(self, holder: int) -> dict | None:
        """The payload metadata of a snapshot whose state ``holder`` holds."""
        return {DENSE_FROM: holder} if holder != self.rank else None

    def taken(self, step: int, holder: int, slots: int) -> None:
        """Record a snapshot of ``step`` taken (whole when ``holder`` is this
        rank); ``slots``: this rank's slot count (older records are dropped)."""
        self.own_part.pop(step, None)
        if holder != self.rank:
            self.own_part[step] = holder
            self.own_part_taken += 1
            for old in sorted(self.own_part)[:-2 * slots]:
                del self.own_part[old]

    def whole(self, step: int) -> bool:
        """Whether this rank's snapshot of ``step`` (if memory holds one) holds its whole state."""
        return step not in self.own_part

    def report(self, holder: int) -> dict:
        return {"shared": {"holder": holder, "own_part_taken": self.own_part_taken}} if self.enabled else {}
