"""Which ranks hold identical copies of which state: MindIO's replica groups.

A rank registers one :class:`ReplicaGroup` per kind of state it holds (index
0: dense model + optimizer, index 1: expert parameters when MoE is on). A
group names the ranks whose state is interchangeable (``rank_list``, the
data-parallel group for plain DDP), how many copies of each shard exist
(``replica_cnt``) and how far apart the copies sit in ``rank_list``
(``replica_shift``).

* ``replica_cnt == len(rank_list)``: every rank holds the whole state (DDP).
* otherwise the state is sharded into ``len(rank_list) / replica_cnt``
  shards; copies of one shard sit ``replica_shift`` positions apart
  (default ``len / replica_cnt``, MindIO's ``offset``: shard ``i`` lives on
  positions ``i, i + offset, ...``). ``replica_shift = 1`` puts the copies of
  a shard next to each other.

The functions here are pure: they answer "one consistent saver per shard"
and "a source replica for each bad rank", and "no complete copy" is an
answer (the ``missing`` part of the result), not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .api import ConfigError, Transfer

__all__ = [
    "ReplicaGroup",
    "ShardKey",
    "choose_savers",
    "choose_sources",
    "shard_ids",
    "validate_layout",
]


@dataclass(frozen=True)
class ReplicaGroup:
    rank_list: tuple[int, ...]
    replica_cnt: int
    replica_shift: int = 0  # 0: len(rank_list) // replica_cnt

    @classmethod
    def full(cls, ranks: Iterable[int]) -> "ReplicaGroup":
        """Every rank holds the whole state (plain data parallel)."""
        ranks = tuple(ranks)
        return cls(ranks, len(ranks), 0)

    @property
    def shift(self) -> int:
        return self.replica_shift or len(self.rank_list) // self.replica_cnt

    @property
    def num_shards(self) -> int:
        return len(self.rank_list) // self.replica_cnt

    def check(self) -> None:
        """Raise ConfigError when the group cannot describe a layout."""
        size = len(self.rank_list)
        if size == 0:
            raise ConfigError("replica group has an empty rank_list")
        if len(set(self.rank_list)) != size:
            raise ConfigError(f"replica group rank_list repeats a rank: {list(self.rank_list)}")
        if self.replica_cnt < 1 or size % self.replica_cnt:
            raise ConfigError(
                f"replica_cnt={self.replica_cnt} must be >= 1 and divide the group size {size} "
                f"(rank_list={list(self.rank_list)})"
            )
        if self.replica_shift < 0 or (self.shift * self.replica_cnt) == 0 or size % (
            self.shift * self.replica_cnt
        ):
            raise ConfigError(
                f"replica_shift={self.replica_shift} does not tile a group of {size} "
                f"ranks with {self.replica_cnt} copies"
            )

    def shard_of(self, rank: int) -> int:
        """The shard index (within this group) that ``rank`` holds."""
        pos = self.rank_list.index(rank)
        block, within = divmod(pos, self.shift * self.replica_cnt)
        return block * self.shift + within % self.shift

    def copies(self, rank: int) -> list[int]:
        """Every rank holding the same shard as ``rank``, in MindIO's walk
        order: ``rank`` itself, then ``rank + shift``, ``rank + 2 shift``...
        wrapping around inside its block."""
        pos = self.rank_list.index(rank)
        span = self.shift * self.replica_cnt
        base = (pos // span) * span
        off = pos - base
        return [self.rank_list[base + (off + k * self.shift) % span] for k in range(self.replica_cnt)]


@dataclass(frozen=True, order=True)
class ShardKey:
    """A shard's identity in the job: which kind of state, and which copy set."""

    kind: int
    copies: tuple[int, ...]  # sorted ranks holding it


Layout = Mapping[int, Sequence[ReplicaGroup]]  # rank -> its groups, by kind


def _shard_key(layout: Layout, rank: int, kind: int) -> ShardKey:
    return ShardKey(kind, tuple(sorted(layout[rank][kind].copies(rank))))


def shard_ids(layout: Layout) -> dict[ShardKey, int]:
    """Number every shard of the job, stably: same layout, same numbers."""
    keys = {_shard_key(layout, r, k) for r, groups in layout.items() for k in range(len(groups))}
    return {key: i for i, key in enumerate(sorted(keys))}


def validate_layout(layout: Layout, world_size: int) -> None:
    """Check that every rank's groups are well formed and agree with each other.

    Raises:
        ConfigError: naming the first inconsistent rank or group.
    """
    for rank, groups in layout.items():
        for kind, group in enumerate(groups):
            group.check()
            if rank not in group.rank_list:
                raise ConfigError(f"rank {rank} is not in its own replica group {list(group.rank_list)}")
            bad = [r for r in group.rank_list if not 0 <= r < world_size]
            if bad:
                raise ConfigError(f"replica group of rank {rank} names ranks outside the world: {bad}")
            for peer in group.rank_list:
                peer_groups = layout.get(peer)
                if peer_groups is None or len(peer_groups) <= kind:
                    continue
                if peer_groups[kind] != group:
                    raise ConfigError(
                        f"ranks {rank} and {peer} disagree on replica group {kind}: "
                        f"{group} vs {peer_groups[kind]}"
                    )


def choose_savers(layout: Layout, usable: Iterable[int]) -> tuple[dict[int, int], list[ShardKey]]:
    """Pick one saver per shard among ``usable`` ranks.

    The lowest usable rank of each copy set is chosen, so the choice is
    deterministic and prefers rank 0 (DDP's authoritative rank for buffers).

    Returns:
        ``(savers, missing)``: shard id -> saving rank, and the shards with
        no usable copy.
    """
    usable = set(usable)
    savers: dict[int, int] = {}
    missing: list[ShardKey] = []
    for key, sid in shard_ids(layout).items():
        candidates = [r for r in key.copies if r in usable]
        if candidates:
            savers[sid] = min(candidates)
        else:
            missing.append(key)
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
