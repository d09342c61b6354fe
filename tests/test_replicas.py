"""Replica groups: shard identity, savers, repair sources, validation."""

import pytest

from trainguard.core import ConfigError, ReplicaGroup, Transfer, choose_savers, choose_sources
from trainguard.core.replicas import Registry, shard_ids, validate_layout


def layout_of(group, world):
    return {r: (group,) for r in range(world)}


def test_full_group_is_one_shard_everyone_holds():
    g = ReplicaGroup.full(range(4))
    assert g.num_shards == 1
    assert g.copies(2) == [2, 3, 0, 1]
    assert len(shard_ids(layout_of(g, 4))) == 1


def test_mindio_offset_layout():
    # 8 ranks, 2 copies: offset 4, shard i on positions i and i + 4.
    g = ReplicaGroup(tuple(range(8)), 2)
    assert [g.shard_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert g.copies(1) == [1, 5]
    assert g.copies(5) == [5, 1]


def test_shift_one_puts_copies_next_to_each_other():
    g = ReplicaGroup(tuple(range(8)), 2, replica_shift=1)
    assert [g.shard_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert g.copies(4) == [4, 5]


def test_groups_over_non_contiguous_ranks():
    g = ReplicaGroup((1, 3, 5, 7), 2)
    assert g.copies(3) == [3, 7]


def test_one_saver_per_shard_lowest_usable_rank():
    layout = layout_of(ReplicaGroup(tuple(range(4)), 2), 4)
    savers, missing = choose_savers(layout, usable={1, 2, 3})
    assert sorted(savers.values()) == [1, 2] and missing == []
    savers, missing = choose_savers(layout, usable={1, 3})
    assert len(missing) == 1 and missing[0].copies == (0, 2)


def test_sources_follow_the_walk_and_report_missing():
    layout = layout_of(ReplicaGroup(tuple(range(6)), 3), 6)  # shards {0,2,4}, {1,3,5}
    transfers, missing = choose_sources(layout, targets=[0], usable={4, 2})
    assert transfers == [Transfer(2, 0)] and missing == []
    transfers, missing = choose_sources(layout, targets=[1], usable={0, 2, 4})
    assert transfers == [] and missing == [(1, 0)]


def test_unregistered_target_has_no_source():
    transfers, missing = choose_sources({0: (ReplicaGroup.full([0, 1]),)}, targets=[1], usable={0})
    assert missing == [(1, 0)]


@pytest.mark.parametrize("group, message", [
    (ReplicaGroup((), 1), "empty rank_list"),
    (ReplicaGroup((0, 0), 2), "repeats a rank"),
    (ReplicaGroup((0, 1, 2), 2), "must be >= 1 and divide"),
    (ReplicaGroup((0, 1, 2, 3), 2, replica_shift=3), "does not tile"),
])
def test_malformed_groups_are_refused(group, message):
    with pytest.raises(ConfigError, match=message):
        group.check()


def test_layout_validation_names_the_problem():
    with pytest.raises(ConfigError, match="not in its own replica group"):
        validate_layout({0: (ReplicaGroup.full([1, 2]),)}, 4)
    with pytest.raises(ConfigError, match="outside a world of 4"):
        validate_layout({0: (ReplicaGroup.full([0, 9]),)}, 4)
    with pytest.raises(ConfigError, match="disagree"):
        validate_layout({0: (ReplicaGroup.full([0, 1]),), 1: (ReplicaGroup((0, 1), 1),)}, 2)


def test_registry_interns_groups():
    registry = Registry(8)
    registered = [registry.register(r, [ReplicaGroup.full(range(8))]) for r in range(8)]
    assert all(groups[0] is registered[0][0] for groups in registered)


def test_overlapping_groups_are_refused():
    registry = Registry(4)
    registry.register(0, [ReplicaGroup((0, 1), 2)])
    with pytest.raises(ConfigError, match="overlaps"):
        registry.register(2, [ReplicaGroup((1, 2), 2)])


def test_groups_travel_as_ranges_when_they_are_progressions():
    from trainguard.core.rank.messages import replica_group

    wire = replica_group(ReplicaGroup(tuple(range(3, 4099, 4)), 1024))
    assert (wire.range_start, wire.range_step, wire.range_count, len(wire.rank_list)) == (3, 4, 1024, 0)
    odd = replica_group(ReplicaGroup((0, 1, 5), 3))
    assert list(odd.rank_list) == [0, 1, 5] and odd.range_count == 0


def test_a_device_meshs_rows_are_replica_groups_and_its_columns_shards():
    """HSDP over a 2x3 mesh (rows [0, 1, 2] and [3, 4, 5]): shard i is held by
    column i; FSDP2 (one row) leaves every rank the only copy of its shard."""
    hsdp = ReplicaGroup.mesh([[0, 1, 2], [3, 4, 5]])
    assert hsdp.shard_sets == ((0, 3), (1, 4), (2, 5)) and not hsdp.is_full
    layout = {r: (hsdp,) for r in range(6)}
    assert choose_sources(layout, [4], usable=range(6)) == ([Transfer(1, 4, 0)], [])
    savers, missing = choose_savers(layout, usable=[1, 2, 3, 5])
    assert sorted(savers.values()) == [1, 2, 3] and missing == []
    fsdp2 = ReplicaGroup.mesh([[0, 1, 2, 3]])
    assert fsdp2.shard_sets == ((0,), (1,), (2,), (3,))
    assert choose_sources({r: (fsdp2,) for r in range(4)}, [2], usable=[0, 1, 3]) == ([], [(2, 0)])
    with pytest.raises(ConfigError, match="of one length"):
        ReplicaGroup.mesh([[0, 1], [2]])


def test_registry_interns_equal_groups_sent_as_different_objects():
    """Interning is by value (ranks, copies, shift), whichever object a rank's
    Hello was parsed into; a group of the same ranks with other copies is another group."""
    registry = Registry(8)
    first = registry.intern(ReplicaGroup(tuple(range(8)), 8))
    again = ReplicaGroup(tuple(list(range(8))), 8)
    assert again is not first and hash(again) == hash(first) and registry.intern(again) is first
    halves = ReplicaGroup(tuple(range(8)), 2)
    assert halves != first and registry.intern(halves) is halves
    assert registry.intern(ReplicaGroup(tuple(range(8)), 2, 0)) is halves
