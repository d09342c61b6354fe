"""A job resumes only where every rank loaded its state; a rank that cannot
stops them all, and the controller never lets a job that has not started go
on with fewer ranks (issue: a rank whose data position failed to load left
its peer training alone into a "complete" one-file checkpoint).

Units here: :func:`trainguard.core.rank.resume.resume` with ranks as threads, the
decision for a job some rank never joined, the controller driven by hand.
The real processes are in ``test_fault_matrix.py``."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainguard.core import CheckpointError, ControllerConfig, ControllerState, ResumeError
from trainguard.core.api import DataStatus, Fault, FaultKind, RankStatus, RunStatus, Severity
from trainguard.core.reports import Hello
from trainguard.core.checkpoint import FileInfo
from trainguard.core.checkpoint_parts import SavedShard
from trainguard.core.commands import CommandResult, Exit, Finalize, Rebuild, Repair, Save
from trainguard.core.control.controller import ControllerCore
from trainguard.core import ReplicaGroup
from trainguard.core.rank.resume import resume


@dataclass
class Found:
    step: int
    path: Path


class Ranks:
    """Collectives among ``n`` threads: each call returns every rank's value."""

    def __init__(self, n: int) -> None:
        self.n, self.values, self.barrier = n, {}, threading.Barrier(n)

    def gather(self, rank: int, value):
        self.values[rank] = value
        self.barrier.wait(5)
        out = [self.values[r] for r in range(self.n)]
        self.barrier.wait(5)
        return out


def run_ranks(n: int, body) -> list:
    """``body(rank, ranks)`` on ``n`` threads; each one's result or exception."""
    ranks, out = Ranks(n), [None] * n

    def one(rank: int) -> None:
        try:
            out[rank] = body(rank, ranks)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[rank] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


class Slot:
    closed = False

    def close(self):
        self.closed = True


def stored(steps: list[int]):
    """``newest_stored`` over a store holding complete checkpoints of ``steps``."""
    return lambda dropped: next((Found(s, Path(f"step_{s}")) for s in sorted(steps, reverse=True)
                                 if s not in dropped), None)


def test_a_rank_whose_objects_refuse_the_state_stops_every_rank_naming_it():
    loaded = {}

    def body(rank, ranks):
        def load(found):
            if rank == 1:
                raise RuntimeError("the data position cannot be restored")
            loaded[rank] = found.step
        return resume({}, stored([5, 10]), gather=lambda v: ranks.gather(rank, v),
                      outcomes=lambda c: ranks.gather(rank, c), load_memory=None, load_stored=load, rank=rank)
    out = run_ranks(2, body)
    assert all(isinstance(e, ResumeError) for e in out), out
    assert "rank [1] could not load the state of step 10" in str(out[0]) and "rank 1's log says why" in str(out[0])
    assert "the data position cannot be restored" in str(out[1]) and "nothing newer is written" in str(out[1])
    assert loaded == {0: 10}, "rank 0 loaded; what matters is that it does not train"


def test_a_checkpoint_file_that_does_not_load_gives_way_to_an_older_one_on_every_rank():
    tried: dict[int, list[int]] = {0: [], 1: []}

    def body(rank, ranks):
        def load(found):
            tried[rank].append(found.step)
            if rank == 1 and found.step == 10:  # its checksum passed, its safe load did not
                raise CheckpointError("shard_k0_r0.pt could not be loaded safely")
        return resume({}, stored([5, 10]), gather=lambda v: ranks.gather(rank, v),
                      outcomes=lambda c: ranks.gather(rank, c), load_memory=None, load_stored=load, rank=rank)
    assert run_ranks(2, body) == [5, 5]
    assert tried == {0: [10, 5], 1: [10, 5]}


def test_a_checkpoint_unusable_on_one_rank_is_dropped_by_a_rank_that_holds_the_step_in_memory_too():
    def body(rank, ranks):
        def load_stored(found):
            if rank == 1 and found.step == 10:
                raise CheckpointError("shard_k0_r1.pt could not be loaded safely")
        memory = {10: (Slot(), "memory")} if rank == 0 else {}
        return resume(memory, stored([5, 10]), gather=lambda v: ranks.gather(rank, v),
                      outcomes=lambda c: ranks.gather(rank, c), load_memory=lambda *a: None,
                      load_stored=load_stored, rank=rank)
    assert run_ranks(2, body) == [5, 5]


def test_when_every_copy_is_unusable_the_job_refuses_to_start_over():
    def body(rank, ranks):
        def load(found):
            raise CheckpointError("does not fit")
        return resume({}, stored([5]), gather=lambda v: ranks.gather(rank, v),
                      outcomes=lambda c: ranks.gather(rank, c), load_memory=None, load_stored=load, rank=rank)
    out = run_ranks(2, body)
    assert all(isinstance(e, CheckpointError) and "not starting from step 0" in str(e) for e in out), out
    assert "step 5 from storage (step_5): does not fit" in str(out[0]), "the reason reaches the error"


def test_a_job_whose_only_snapshot_is_corrupt_and_storage_empty_starts_at_step_0():
    def body(rank, ranks):
        def load_memory(step, slot, source):
            raise CheckpointError("fails its checksum")
        return resume({4: (Slot(), "memory")}, stored([]), gather=lambda v: ranks.gather(rank, v),
                      outcomes=lambda c: ranks.gather(rank, c), load_memory=load_memory, load_stored=None, rank=rank)
    assert run_ranks(2, body) == [0, 0], "nothing on storage is passed over: starting over loses no checkpoint"


def test_nothing_anywhere_starts_at_step_0():
    out = run_ranks(2, lambda rank, ranks: resume(
        {}, stored([]), gather=lambda v: ranks.gather(rank, v), outcomes=lambda c: ranks.gather(rank, c),
        load_memory=None, load_stored=None, rank=rank))
    assert out == [0, 0]


def test_a_snapshot_that_fails_its_check_on_one_rank_sends_every_rank_to_storage():
    slots = {0: Slot(), 1: Slot()}
    from_memory, from_storage = [], []

    def body(rank, ranks):
        def load_memory(step, slot, source):
            if rank == 1:
                raise CheckpointError("fails its checksum")
            from_memory.append(rank)

        def load_stored(found):
            from_storage.append((rank, found.step))
        return resume({12: (slots[rank], "memory")}, stored([10]), gather=lambda v: ranks.gather(rank, v),
                      outcomes=lambda c: ranks.gather(rank, c), load_memory=load_memory, load_stored=load_stored,
                      rank=rank)
    assert run_ranks(2, body) == [10, 10]
    assert from_memory == [0] and sorted(from_storage) == [(0, 10), (1, 10)]
    assert slots[0].closed, "the candidate not read is closed"


# ----------------------------------------------------------- the controller
def hello(rank: int, world: int, step: int, host: str = "h") -> Hello:
    return Hello(rank=rank, pid=100 + rank, host=host, device_repairable=True,
                 status=RankStatus(step=step, run=RunStatus.TRAINING, data=DataStatus.UPDATED),
                 replicas=(ReplicaGroup.full(range(world)),))


def test_a_fault_before_every_rank_registered_ends_the_job_without_a_save():
    """Rank 1 never registered (it failed loading its state); rank 0 trains
    and its collective breaks. Retry with rank 0 alone, or a dump that would
    not hold rank 1's state, are both wrong: exit."""
    sent: list = []
    core = ControllerCore(ControllerConfig(strategies="retry,dump,exit"), 2, send=lambda r, c: sent.append((r, c)))
    core.on_hello(hello(0, 2, 10))
    assert core.state is ControllerState.INIT
    core.on_fault(0, Fault(kind=FaultKind.COMM, rank=0, severity=Severity.HIGH, message="Connection closed by peer"),
                  RankStatus(step=10, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    commands = [c for _, c in sent]
    assert not any(isinstance(c.action, (Rebuild, Save, Repair)) for c in commands), commands
    assert isinstance(commands[-1].action, Exit) and commands[-1].action.code == 76
    assert "ranks [1] never registered" in core.episode.reason
    assert core.state is ControllerState.EXITED


def test_a_dump_asks_every_survivor_for_its_own_part_and_a_survivor_on_the_lost_rank_s_host_to_carry_its():
    sent: dict[int, list] = {}
    core = ControllerCore(ControllerConfig(strategies="dump"), 4, send=lambda r, c: sent.setdefault(r, []).append(c))
    for rank in range(4):
        core.on_hello(hello(rank, 4, 6, host="a" if rank < 2 else "b"))
    core.on_process_exit(1, 101, -9)
    for rank in (0, 2, 3):
        core.on_stopped(rank, RankStatus(step=6, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    saves = {r: cmds[-1].action for r, cmds in sent.items() if isinstance(cmds[-1].action, Save)}
    assert sorted(saves) == [0, 2, 3], "every survivor saves its own part"
    assert list(saves[0].carry) == [1] and not saves[2].carry and not saves[3].carry
    for rank in (0, 2, 3):
        own = (FileInfo(name=f"own_r{rank}.bin", bytes=10, sha256="a" * 64),)
        if rank == 0:
            own += (FileInfo(name="own_r1.bin", bytes=10, sha256="b" * 64),)
        shards = (SavedShard(kind=0, copies=(), full=False, rank=0,
                             files=(FileInfo(name="shard_k0_r0.pt", bytes=5, sha256="c" * 64),)),) \
            if saves[rank].kinds else ()
        status = RankStatus(step=6, run=RunStatus.RECOVERING, data=DataStatus.UPDATED)
        core.on_result(rank, CommandResult(command_id=sent[rank][-1].id, ok=True, shards=shards, own=own,
                                           status=status))
    (finalize,) = [cmds[-1].action for cmds in sent.values() if isinstance(cmds[-1].action, Finalize)]
    assert sorted(f.name for f in finalize.own) == ["own_r0.bin", "own_r1.bin", "own_r2.bin", "own_r3.bin"]


def test_a_lost_rank_with_no_survivor_on_its_host_is_named_in_the_reason():
    sent: dict[int, list] = {}
    core = ControllerCore(ControllerConfig(strategies="dump"), 2, send=lambda r, c: sent.setdefault(r, []).append(c))
    for rank in range(2):
        core.on_hello(hello(rank, 2, 6, host=f"host{rank}"))
    core.on_process_exit(1, 101, -9)
    core.on_stopped(0, RankStatus(step=6, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    assert isinstance(sent[0][-1].action, Save) and not sent[0][-1].action.carry
    assert "random streams and data positions of ranks [1] are lost with their hosts" in core.episode.reason


def test_decide_refuses_every_strategy_for_a_job_that_has_not_started():
    from trainguard.core import RankState, DataStatus, RunStatus, Strategy, decide
    view = {0: RankState(rank=0, step=10, data=DataStatus.UPDATED, run=RunStatus.STOPPED, alive=True, stopped=True)}
    plan, reason = decide(view, [], ControllerConfig(strategies="retry,elastic-training,dump,exit"), 0.0,
                          layout={0: (ReplicaGroup.full(range(2)),)}, missing=[1])
    assert plan.strategy is Strategy.EXIT and "never registered" in reason
    plan, _ = decide(view, [], ControllerConfig(strategies="retry,dump,exit"), 0.0,
                     layout={0: (ReplicaGroup.full(range(2)),)})
    assert plan.strategy is Strategy.RETRY, "the same view with every rank registered is retried"


if __name__ == "__main__":
    pytest.main([__file__])
