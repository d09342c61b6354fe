"""The decision table: which plan each situation gets, and why."""

import pytest

from trainguard.core.control.decide import Agents
from trainguard.core import (
    EXIT_AFTER_DUMP,
    ControllerConfig,
    DataStatus,
    Fault,
    FaultKind,
    RankState,
    ReplicaGroup,
    RunStatus,
    Severity,
    Strategy,
    Transfer,
    decide,
)

WORLD = 4
FULL = {r: (ReplicaGroup.full(range(WORLD)),) for r in range(WORLD)}
ALONE = {r: (ReplicaGroup.full([r]),) for r in range(WORLD)}
CONFIG = ControllerConfig()


def ranks(step=5, *, overrides=None):
    out = {r: RankState(rank=r, step=step, data=DataStatus.UPDATED, run=RunStatus.STOPPED, stopped=True)
           for r in range(WORLD)}
    for r, fields in (overrides or {}).items():
        out[r] = RankState(**{**out[r].__dict__, **fields})
    return out


def uce(rank=1, severity=Severity.HIGH):
    return Fault(kind=FaultKind.UCE, rank=rank, severity=severity, message="UCE ERROR")


def lost(rank=1):
    return Fault(kind=FaultKind.PROCESS_LOST, rank=rank, message="killed")


def test_uce_is_retried_from_a_replica():
    plan, reason = decide(ranks(), [uce(1)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.RETRY
    assert plan.step == 5
    assert plan.transfers == (Transfer(src=2, dst=1),)  # MindIO's walk: rank + 1, + 2, ...
    assert plan.participants == (0, 1, 2, 3)
    assert "retry at step 5" in reason and "rank 1 from rank 2" in reason


def test_comm_fault_is_retried_without_copying_state():
    plan, _ = decide(ranks(), [Fault(kind=FaultKind.COMM, rank=2)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.RETRY
    assert plan.transfers == ()


def test_low_severity_uce_keeps_the_ranks_state():
    plan, _ = decide(ranks(), [uce(1, Severity.LOW)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.RETRY and plan.transfers == ()


def test_lock_is_the_highest_consistent_step_and_stale_ranks_are_repaired():
    state = ranks(5, overrides={0: {"step": 6}, 3: {"step": 6}, 2: {"data": DataStatus.UPDATING}})
    plan, _ = decide(state, [uce(1)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.RETRY and plan.step == 6
    assert {t.dst for t in plan.transfers} == {1, 2}
    assert {t.src for t in plan.transfers} <= {0, 3}


def test_lost_process_falls_back_from_retry_to_dump():
    plan, reason = decide(ranks(), [lost(2)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.DUMP
    assert plan.savers == {0: 0} and plan.finaliser == 0
    assert plan.exit_code == EXIT_AFTER_DUMP
    assert reason.startswith("retry: rank 2: process lost")
    assert "dump at step 5" in reason


def test_uce_without_a_replica_exits():
    # Each rank is its own replica group: nobody can repair rank 1, and its
    # shard has no other copy to save either.
    plan, reason = decide(ranks(), [uce(1)], CONFIG, 0.0, layout=ALONE)
    assert plan.strategy is Strategy.EXIT
    assert "no consistent replica at step 5 to repair rank 1" in reason
    assert "dump: no consistent copy of shard [1]" in reason


def test_sharded_state_dumps_one_saver_per_shard():
    layout = {r: (ReplicaGroup(tuple(range(WORLD)), 2),) for r in range(WORLD)}  # shards {0,2} and {1,3}
    plan, _ = decide(ranks(), [lost(0)], CONFIG, 0.0, layout=layout)
    assert plan.strategy is Strategy.DUMP
    assert sorted(plan.savers.values()) == [1, 2]


def test_sharded_state_with_both_copies_lost_exits():
    layout = {r: (ReplicaGroup(tuple(range(WORLD)), 2),) for r in range(WORLD)}
    state = ranks(overrides={0: {"alive": False}, 2: {"alive": False}})
    plan, reason = decide(state, [lost(0), lost(2)], CONFIG, 0.0, layout=layout)
    assert plan.strategy is Strategy.EXIT
    assert "dump: no consistent copy of shard [0, 2]" in reason


def test_fault_at_step_zero_exits():
    plan, reason = decide(ranks(step=0), [uce(1)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.EXIT
    assert "retry: the fault came at step 0" in reason
    assert "dump: the fault came at step 0" in reason


def test_corrupted_state_forbids_retry_and_dump():
    plan, reason = decide(ranks(), [uce(1, Severity.CORRUPTED)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.EXIT
    assert reason.count("corrupted data may have reached the replicas") == 2


def test_second_fault_excludes_the_strategy_that_failed():
    plan, reason = decide(ranks(), [uce(1), lost(3)], CONFIG, 0.0, layout=FULL, tried={Strategy.RETRY})
    assert plan.strategy is Strategy.DUMP
    assert "retry: already failed in this episode" in reason


def test_failed_dump_falls_back_to_exit():
    plan, reason = decide(ranks(), [lost(1)], CONFIG, 0.0, layout=FULL, tried={Strategy.DUMP})
    assert plan.strategy is Strategy.EXIT
    assert "dump: already failed" in reason


def test_device_that_cannot_repair_a_uce_escalates_to_dump():
    state = ranks(overrides={1: {"device_repairable": False}})
    plan, reason = decide(state, [uce(1)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.DUMP
    assert "cannot be repaired in-process" in reason


def test_rank_that_did_not_stop_blocks_retry_and_is_not_a_saver():
    state = ranks(overrides={0: {"stopped": False}})
    plan, reason = decide(state, [Fault(kind=FaultKind.HANG, rank=0)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.DUMP
    assert plan.savers == {0: 1}
    assert "retry only repairs in-process faults" in reason


def test_unknown_error_is_not_retried_and_its_rank_does_not_save():
    fault = Fault(kind=FaultKind.UNKNOWN, rank=0, message="ValueError: bad batch")
    plan, _ = decide(ranks(), [fault], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.DUMP and plan.savers == {0: 1}


@pytest.mark.parametrize("strategies", ["dump,exit", "dump"])
def test_the_job_list_is_respected(strategies):
    plan, _ = decide(ranks(), [uce(1)], ControllerConfig(strategies=strategies), 0.0, layout=FULL)
    assert plan.strategy is Strategy.DUMP


def test_exit_is_the_last_resort_even_when_not_listed():
    plan, reason = decide(ranks(step=0), [uce(1)], ControllerConfig(strategies="retry"), 0.0, layout=FULL)
    assert plan.strategy is Strategy.EXIT
    assert reason.endswith("exit (no strategy left)")


TWO_NODES = Agents(home={0: "a", 1: "a", 2: "b", 3: "b"}, spare={"a": 0, "b": 1}, restarts_left=3, max_restarts=3)


def test_a_lost_process_is_restarted_on_its_node_and_repaired_from_a_replica():
    view = ranks(overrides={1: {"alive": False}})
    config = ControllerConfig(strategies="recover-in-place,dump")
    plan, reason = decide(view, [lost(1)], config, 0.0, layout=FULL, agents=TWO_NODES)
    assert plan.strategy is Strategy.RECOVER_IN_PLACE
    assert plan.replacements == {1: "a"} and plan.participants == (0, 2, 3)
    assert plan.transfers == (Transfer(src=2, dst=1),) and plan.step == 5
    assert "new process for rank 1 on a" in reason


def test_recover_starts_the_process_on_another_node():
    view = ranks(overrides={1: {"alive": False}})
    plan, _ = decide(view, [lost(1)], ControllerConfig(strategies="recover,dump"), 0.0, layout=FULL,
                     agents=TWO_NODES)
    assert plan.strategy is Strategy.RECOVER and plan.replacements == {1: "b"}


def test_recover_needs_a_spare_slot_elsewhere():
    view = ranks(overrides={2: {"alive": False}})  # rank 2 lives on b, the only node with a spare slot
    plan, reason = decide(view, [lost(2)], ControllerConfig(strategies="recover,dump"), 0.0, layout=FULL,
                          agents=TWO_NODES)
    assert plan.strategy is Strategy.DUMP
    assert "no other node agent has a spare slot for rank 2" in reason


def test_a_spent_restart_budget_names_the_limit():
    view = ranks(overrides={1: {"alive": False}})
    spent = Agents(home=TWO_NODES.home, spare=TWO_NODES.spare, restarts_left=0, max_restarts=2)
    plan, reason = decide(view, [lost(1)], ControllerConfig(strategies="recover-in-place,dump"), 0.0,
                          layout=FULL, agents=spent)
    assert plan.strategy is Strategy.DUMP
    assert "--max-restarts 2, 2 used" in reason


def test_a_rank_whose_agent_is_gone_is_not_restarted_in_place():
    view = ranks(overrides={1: {"alive": False}})
    gone = Agents(home={2: "b", 3: "b"}, spare={"b": 1}, restarts_left=3, max_restarts=3)
    plan, reason = decide(view, [lost(1)], ControllerConfig(strategies="recover-in-place,recover,dump"), 0.0,
                          layout=FULL, agents=gone)
    assert plan.strategy is Strategy.RECOVER and plan.replacements == {1: "b"}
    assert "rank 1's node agent is gone" in reason


def test_in_process_faults_are_not_restarted():
    plan, reason = decide(ranks(), [uce(1)], ControllerConfig(strategies="recover-in-place,dump"), 0.0,
                          layout=FULL, agents=TWO_NODES)
    assert plan.strategy is Strategy.DUMP and "no process was lost" in reason


def test_elastic_training_goes_on_with_the_survivors():
    view = ranks(overrides={3: {"alive": False}})
    plan, reason = decide(view, [lost(3)], ControllerConfig(strategies="elastic-training,dump"), 0.0, layout=FULL)
    assert plan.strategy is Strategy.ELASTIC_TRAINING
    assert plan.participants == (0, 1, 2) and plan.transfers == () and plan.step == 5
    assert "elastic-training at step 5 with ranks [0, 1, 2]" in reason


def test_elastic_training_refuses_sharded_state():
    sharded = {r: (ReplicaGroup((0, 1, 2, 3), 2, 0),) for r in range(WORLD)}
    view = ranks(overrides={3: {"alive": False}})
    plan, reason = decide(view, [lost(3)], ControllerConfig(strategies="elastic-training,dump"), 0.0,
                          layout=sharded)
    assert plan.strategy is not Strategy.ELASTIC_TRAINING
    assert "hold part of the state (sharded)" in reason


def test_a_dump_saves_the_step_every_live_rank_has_when_one_is_a_step_behind():
    """A fault cut an all-reduce that finished on some ranks only: rank 1
    committed step 6, rank 0 is still at 5 (it never began step 6's update,
    so it has no random streams or data position of step 6). The dump saves
    step 5: rank 0 holds it committed, rank 1 its node's record of it (CI
    saw the dump of step 6 fail on rank 0 and the job exit with nothing)."""
    state = ranks(5, overrides={1: {"step": 6}, 2: {"alive": False}, 3: {"alive": False}})
    plan, reason = decide(state, [lost(2), lost(3)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.DUMP and plan.step == 5
    assert plan.savers == {0: 0} and plan.participants == (0, 1)
    assert "dump at step 5" in reason


def test_a_dump_keeps_the_locked_step_when_the_rank_behind_is_not_consistent():
    """A rank behind that is inside its update (UPDATING) has no consistent
    step at all: the locked step is saved by the ranks at it, as before."""
    state = ranks(5, overrides={0: {"data": DataStatus.UPDATING}, 1: {"step": 6}, 2: {"step": 6},
                                3: {"alive": False}})
    plan, _ = decide(state, [lost(3)], CONFIG, 0.0, layout=FULL)
    assert plan.strategy is Strategy.DUMP and plan.step == 6 and plan.savers == {0: 1}


# FSDP2 over 4 ranks: every rank its own shard; HSDP on a 2x2 mesh (replicate x shard): rows [0, 1] and [2, 3]
# are the replica groups, so shard 0 is on ranks 0 and 2, shard 1 on ranks 1 and 3.
FSDP2 = {r: (ReplicaGroup(tuple(range(WORLD)), 1),) for r in range(WORLD)}
HSDP = {r: (ReplicaGroup((0, 1, 2, 3), 2),) for r in range(WORLD)}


def test_hsdp_retries_a_uce_from_the_same_shard_of_the_other_replica_group():
    plan, reason = decide(ranks(), [uce(1)], CONFIG, 0.0, layout=HSDP)
    assert plan.strategy is Strategy.RETRY and plan.transfers == (Transfer(src=3, dst=1),), reason


def test_hsdp_dumps_one_copy_of_each_shard_without_the_lost_rank():
    plan, reason = decide(ranks(overrides={1: {"alive": False}}), [lost(1)], CONFIG, 0.0, layout=HSDP)
    assert plan.strategy is Strategy.DUMP and sorted(plan.savers.values()) == [0, 3], reason


def test_fsdp2_has_no_copy_of_a_lost_or_corrupted_shard():
    plan, reason = decide(ranks(overrides={1: {"alive": False}}), [lost(1)], CONFIG, 0.0, layout=FSDP2)
    assert plan.strategy is Strategy.EXIT and "no consistent copy of shard [1]" in reason
    plan, reason = decide(ranks(), [uce(2)], CONFIG, 0.0, layout=FSDP2)
    assert plan.strategy is Strategy.EXIT and "no consistent replica at step 5 to repair rank 2" in reason


def test_no_process_is_restarted_into_a_job_that_says_none_can_join():
    """An HSDP job's device mesh is built with collectives the running
    ranks do not take part in: a new process would wait in them for good."""
    why = "a new process cannot join an HSDP job"
    view = ranks(overrides={r: {"join_refused": why} for r in range(WORLD)} | {1: {"alive": False,
                                                                               "join_refused": why}})
    plan, reason = decide(view, [lost(1)], ControllerConfig(strategies="recover-in-place,recover,dump"), 0.0,
                          layout=HSDP, agents=TWO_NODES)
    assert plan.strategy is Strategy.DUMP
    assert f"recover-in-place: rank 0: {why}" in reason and f"recover: rank 0: {why}" in reason
