"""Snapshots shared by the data-parallel replicas on a node
(``core/snapshot/shared.py``): which steps a replica can load, and which
rank's snapshots hold its state. The process tests are in
test_snapshot_guard.py (torch) and test_mindspore.py."""

from __future__ import annotations

import torch

from snapshot_states import equal, sample_state, wait_sealed
from trainguard.adapters.torch.snapshot import Snapshots, read_payload


def test_a_replica_can_load_the_steps_its_holder_holds_sealed_on_the_node(shm, caplog):
    """``snapshot_shared``: rank 1's own-part snapshots need rank 0's of the same step."""
    from trainguard.core.snapshot.shared import DENSE_FROM, choose_holder, keeping_up, local_ranks, with_holders

    caplog.set_level("INFO", logger="trainguard.snapshot")
    holder, replica = Snapshots(shm, 0, count=2), Snapshots(shm, 1, count=3)
    try:
        for step in (1, 2):
            wait_sealed(holder, holder.take(sample_state(step), step))
        for step in (1, 2, 3):  # rank 0 holds no step 3
            own = {"state": {"rng": {"1": {"torch": torch.tensor([step])}}, "step": step}, "history": {}}
            wait_sealed(replica, replica.take(own, step, meta={DENSE_FROM: 0}))
        memory, dense = with_holders(replica.available(), replica.replica_slots)
        assert sorted(memory) == sorted(dense) == [1, 2]
        assert "rank 0's snapshot of that step is not sealed in this node's memory" in caplog.text
        _, own = read_payload(memory[2][0].payload())
        _, state = read_payload(dense[2].payload())
        assert own["state"]["rng"]["1"]["torch"].item() == 2 and equal(state, sample_state(2))
        for slot in [s for s, _ in memory.values()] + list(dense.values()):
            slot.close()
    finally:
        holder.close()
        replica.close()
    assert local_ranks({"RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}) == {4, 5, 6, 7}
    assert choose_holder(5, copies=range(8), members=[0, 1, 5, 6, 7], local={4, 5, 6, 7}) == 5  # 4 was dropped
    assert choose_holder(7, copies=[1, 3, 5, 7], members=range(8), local={4, 5, 6, 7}) == 5
    assert not keeping_up(None, None, 1) and keeping_up(3, None, 1)
    assert keeping_up(3, 4, 1) and not keeping_up(2, 4, 1)  # the holder's copy of the step before may be running


def test_sharing_follows_the_holder_while_its_snapshots_keep_up(shm, caplog):
    """Which rank's snapshots hold a replica's state, and the bookkeeping of
    its own-part snapshots (both adapters use :class:`Sharing`)."""
    from trainguard.core.snapshot.shared import Sharing

    holder = Snapshots(shm, 0, count=2)
    try:
        for step in (1, 2):
            wait_sealed(holder, holder.take(sample_state(step), step))
        assert Sharing(1, 1, False, {0, 1}).holder([0, 1], [0, 1], shm.slots_of) == 1  # sharing off
        assert Sharing(0, 1, True, {0, 1}).holder([0, 1], [0, 1], shm.slots_of) == 0  # the holder itself
        assert Sharing(1, 1, True, {1}).holder([0, 1], [0, 1], shm.slots_of) == 1  # rank 0 on another node
        sharing = Sharing(1, 1, True, {0, 1})
        assert sharing.holder([0, 1], [0, 1], shm.slots_of) == 0 and sharing.meta(0) == {"dense_from": 0}
        sharing.taken(3, 0, slots=2)  # rank 0's newest, 2, is one interval behind: it may be copying 3
        assert not sharing.whole(3) and sharing.holder([0, 1], [0, 1], shm.slots_of) == 0
        sharing.taken(4, 0, slots=2)
        caplog.set_level("WARNING", logger="trainguard.snapshot")
        assert sharing.holder([0, 1], [0, 1], shm.slots_of) == 1 == sharing.holder([0, 1], [0, 1], shm.slots_of)
        assert caplog.text.count("rank 0's snapshots on this node fell behind") == 1
        sharing.taken(5, 1, slots=2)
        assert sharing.whole(5) and sharing.meta(1) is None
        for step in range(6, 12):
            sharing.taken(step, 0, slots=2)
        assert sorted(sharing.own_part) == [8, 9, 10, 11] and sharing.own_part_taken == 8
        assert sharing.report(0) == {"shared": {"holder": 0, "own_part_taken": 8}}
    finally:
        holder.close()
