"""Which ranks hold identical copies of which state: MindIO's replica groups.

A rank registers one :class:`ReplicaGroup` per kind of state it holds (index
0: dense model + optimizer, index 1: expert parameters when MoE is on). A
group names the ranks whose state is interchangeable (``rank_list``, the
data-parallel group for plain DDP), how many copies of each shard exist
(``replica_cnt``) and how far apart the copies sit in ``rank_list``
(``replica_shift``).

* ``replica_cnt == len(rank_list)``: every rank holds the whole state (DDP).
* ``replica_cnt == 1``: every rank holds a shard of its own (FSDP2); a
  device mesh of replica groups x shards (HSDP) is :meth:`ReplicaGroup.mesh`.
* otherwise the state is sharded into ``len(rank_list) / replica_cnt``
  shards; copies of one shard sit ``replica_shift`` positions apart
  (default ``len / replica_cnt``, MindIO's ``offset``: shard ``i`` lives on
  positions ``i, i + offset, ...``). ``replica_shift = 1`` puts the copies of
  a shard next to each other.

:class:`Registry` collects the groups as ranks register, checking each
against what its peers said, in time proportional to the distinct groups
(every rank of a 16k-rank DP group sends the same group; it is checked once).
The functions below are pure: they answer "one consistent saver per shard"
and "a source replica for each bad rank", and "no complete copy" is an
answer (the ``missing`` part of the result), not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Iterator, Mapping, Sequence

from .api import ConfigError, Transfer

__all__ = [
    "Layout",
    "Registry",
    "ReplicaGroup",
    "ShardKey",
    "choose_savers",
    "choose_sources",
    "shard_ids",
    "validate_layout",
]


@dataclass(frozen=True, eq=False)
class ReplicaGroup:
    """One replica group. Equality is by value; identical groups registered
    by many ranks are interned by :class:`Registry` and compared by identity."""

    rank_list: tuple[int, ...]
    replica_cnt: int
    replica_shift: int = 0  # 0: len(rank_list) // replica_cnt

    @classmethod
    def full(cls, ranks: Iterable[int]) -> "ReplicaGroup":
        """Every rank holds the whole state (plain data parallel)."""
        ranks = tuple(ranks)
        return cls(ranks, len(ranks), 0)

    @classmethod
    def mesh(cls, rows: Sequence[Sequence[int]]) -> "ReplicaGroup":
        """The layout of a device mesh whose rows are replica groups and
        whose columns are shards (torch's HSDP: ``fully_shard`` over a
        ``(replicate, shard)`` mesh; one row: FSDP2, every rank its own
        shard): the rank in column ``i`` of every row holds shard ``i``.

        Raises:
            ConfigError: the rows are not all of one length.
        """
        rows = [tuple(int(r) for r in row) for row in rows]
        if not rows or len({len(row) for row in rows}) != 1 or not rows[0]:
            raise ConfigError(f"a mesh's rows must be non-empty and of one length, got {[len(r) for r in rows]}")
        return cls(tuple(r for row in rows for r in row), len(rows))

    @property
    def key(self) -> tuple:
        return (self.rank_list, self.replica_cnt, self.replica_shift)

    def __eq__(self, other: object) -> bool:
        return other is self or (isinstance(other, ReplicaGroup) and other.key == self.key)

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:  # a 16k-rank group's tuple takes ~40 us to hash: once per object
        return hash(self.key)

    @property
    def shift(self) -> int:
        return self.replica_shift or len(self.rank_list) // self.replica_cnt

    @property
    def num_shards(self) -> int:
        return len(self.rank_list) // self.replica_cnt

    @property
    def is_full(self) -> bool:
        return self.replica_cnt == len(self.rank_list)

    @cached_property
    def _position(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.rank_list)}

    def __contains__(self, rank: int) -> bool:
        return rank in self._position

    def check(self) -> None:
        """Raise ConfigError when the group cannot describe a layout."""
        size = len(self.rank_list)
        if size == 0:
            raise ConfigError("replica group has an empty rank_list")
        if len(self._position) != size:
            raise ConfigError(f"replica group rank_list repeats a rank: {list(self.rank_list)[:16]}")
        if self.replica_cnt < 1 or size % self.replica_cnt:
            raise ConfigError(
                f"replica_cnt={self.replica_cnt} must be >= 1 and divide the group size {size} "
                f"(rank_list={list(self.rank_list)[:16]})"
            )
        if self.replica_shift < 0 or size % (self.shift * self.replica_cnt):
            raise ConfigError(
                f"replica_shift={self.replica_shift} does not tile a group of {size} "
                f"ranks with {self.replica_cnt} copies"
            )

    def shard_of(self, rank: int) -> int:
        """The shard index (within this group) that ``rank`` holds."""
        block, within = divmod(self._position[rank], self.shift * self.replica_cnt)
        return block * self.shift + within % self.shift

    def copies(self, rank: int) -> list[int]:
        """Every rank holding the same shard as ``rank``, in MindIO's walk
        order: ``rank`` itself, then ``rank + shift``, ``rank + 2 shift``...
        wrapping around inside its block."""
        pos = self._position[rank]
        span = self.shift * self.replica_cnt
        base = (pos // span) * span
        off = pos - base
        return [self.rank_list[base + (off + k * self.shift) % span] for k in range(self.replica_cnt)]

    @cached_property
    def shard_sets(self) -> tuple[tuple[int, ...], ...]:
        """The sorted copy set of each shard of this group."""
        sets: dict[int, list[int]] = {}
        for rank in self.rank_list:
            sets.setdefault(self.shard_of(rank), []).append(rank)
        return tuple(tuple(sorted(v)) for _, v in sorted(sets.items()))


@dataclass(frozen=True, order=True)
class ShardKey:
    """A shard's identity in the job: which kind of state, and which copy set."""

    kind: int
    copies: tuple[int, ...]  # sorted ranks holding it


Layout = Mapping[int, Sequence[ReplicaGroup]]  # rank -> its groups, by kind


class Registry:
    """The job's replica groups, filled as ranks register.

    Args:
        world_size: ranks in the job; every group must stay inside it.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._interned: dict[ReplicaGroup, ReplicaGroup] = {}  # by value; the same object hashes once
        self._owner: list[dict[int, ReplicaGroup]] = []  # per kind: rank -> the group that claimed it
        self.layout: dict[int, tuple[ReplicaGroup, ...]] = {}

    def intern(self, group: ReplicaGroup) -> ReplicaGroup:
        """The registry's copy of ``group`` (checked the first time it is seen).

        Raises:
            ConfigError: the group is malformed or reaches outside the world.
        """
        known = self._interned.get(group)
        if known is not None:
            return known
        group.check()
        if min(group.rank_list) < 0 or max(group.rank_list) >= self.world_size:
            raise ConfigError(f"replica group names ranks outside a world of {self.world_size}")
        self._interned[group] = group
        return group

    def register(self, rank: int, groups: Sequence[ReplicaGroup]) -> tuple[ReplicaGroup, ...]:
        """Record ``rank``'s groups; return the interned ones.

        Raises:
            ConfigError: a malformed group, a rank outside its own group, or
                a group that disagrees with one a peer registered.
        """
        interned = tuple(self.intern(g) for g in groups)
        while len(self._owner) < len(interned):
            self._owner.append({})
        for kind, group in enumerate(interned):
            if rank not in group:
                raise ConfigError(f"rank {rank} is not in its own replica group {list(group.rank_list)[:16]}")
            owners = self._owner[kind]
            owner = owners.get(rank)
            if owner is group:
                continue  # the group was claimed already: checked then
            if owner is not None:
                raise ConfigError(f"ranks disagree on replica group {kind} of rank {rank}: "
                                  f"{list(group.rank_list)[:16]} vs {list(owner.rank_list)[:16]}")
            clash = next((owners[p] for p in group.rank_list if owners.get(p, group) is not group), None)
            if clash is not None:
                raise ConfigError(f"ranks disagree on replica group {kind}: {list(group.rank_list)[:16]} "
                                  f"overlaps {list(clash.rank_list)[:16]}")
            for p in group.rank_list:
                owners[p] = group
        self.layout[rank] = interned
        return interned


def validate_layout(layout: Layout, world_size: int) -> None:
    """Check a whole layout at once (every rank's groups, against each other).

    Raises:
        ConfigError: naming the first inconsistency.
    """
    registry = Registry(world_size)
    for rank, groups in layout.items():
        registry.register(rank, groups)


def _distinct(layout: Layout) -> Iterator[tuple[int, ReplicaGroup]]:
    seen: set[tuple[int, int]] = set()
    for groups in layout.values():
        for kind, group in enumerate(groups):
            if (kind, id(group)) not in seen:
                seen.add((kind, id(group)))
                yield kind, group


def shard_ids(layout: Layout) -> dict[ShardKey, int]:
    """Number every shard of the job, stably: same layout, same numbers."""
    keys = {ShardKey(kind, copies) for kind, group in _distinct(layout) for copies in group.shard_sets}
    return {key: i for i, key in enumerate(sorted(keys))}


def choose_savers(layout: Layout, usable: Iterable[int]) -> tuple[dict[int, int], list[ShardKey]]:
    """Pick one saver per shard among ``usable`` ranks.

    The lowest usable rank of each copy set is chosen, so the choice is
    deterministic and prefers rank 0.

    Returns:
        ``(savers, missing)``: shard id -> saving rank, and the shards with
        no usable copy.
    """
    usable = set(usable)
    savers: dict[int, int] = {}
    missing: list[ShardKey] = []
    for key, sid in shard_ids(layout).items():
        candidate = next((r for r in key.copies if r in usable), None)  # copies are sorted
        if candidate is None:
            missing.append(key)
        else:
            savers[sid] = candidate
    return savers, missing


def choose_sources(
    layout: Layout, targets: Iterable[int], usable: Iterable[int]
) -> tuple[list[Transfer], list[tuple[int, int]]]:
    """Pick a source replica for every kind of state of every target rank.

    The walk follows MindIO: for target ``t`` try ``t + shift``, ``t + 2
    shift``, ... and take the first usable rank.

    Returns:
        ``(transfers, missing)``: the copies to make, and ``(rank, kind)``
        pairs that have no usable source.
    """
    usable = set(usable)
    transfers: list[Transfer] = []
    missing: list[tuple[int, int]] = []
    for target in sorted(set(targets)):
        groups = layout.get(target)
        if not groups:
            missing.append((target, 0))
            continue
        for kind, group in enumerate(groups):
            source = next((r for r in group.copies(target)[1:] if r in usable), None)
            if source is None:
                missing.append((target, kind))
            else:
                transfers.append(Transfer(source, target, kind))
    return transfers, missing
