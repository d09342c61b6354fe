"""The node agent's verdict on its workers, one monitoring pass at a time:
a node whose only rank died waits for the controller's orders while the job
handles the fault, instead of re-rendezvousing (which makes every other
agent end its workers, survivors in the middle of a recovery included)."""

import queue
import subprocess
import sys

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from trainguard.core import ControllerConfig
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.launcher.agent import TrainguardAgent
from trainguard.launcher.watch import FrozenWatch


class FakeController:
    def __init__(self, state):
        self.state = state
        self.exits = []

    def snapshot(self):
        return {"state": self.state}

    def report_process_exit(self, rank, pid, code, reason="", last_running=0.0):
        self.exits.append((rank, pid, code))


class FakeReplacements:
    """This node's one worker (rank 1), already killed."""

    def __init__(self, context, proc):
        self.context = context
        self.procs = {1: proc}

    def ready(self):
        return []

    def processes(self):
        return dict(self.procs)

    def release(self, rank):
        self.procs.pop(rank, None)


@pytest.fixture
def agent(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    proc.wait()
    torch_verdicts = []

    def torch_monitor(self, group):
        torch_verdicts.append(group)
        return RunResult(state=WorkerState.FAILED)

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", torch_monitor)
    a = object.__new__(TrainguardAgent)
    a._pcontext = type("Context", (), {"subprocess_handlers": {0: object()}})()
    a.replacements = FakeReplacements(a._pcontext, proc)
    a._config = ControllerConfig()
    a._orders, a._reported, a._failed_at, a._ended_at, a._frozen = queue.Queue(), set(), None, None, FrozenWatch()
    a.controller, a._client, a.relay = FakeController("RECOVERING"), None, None
    a.torch_verdicts = torch_verdicts
    return a


def test_a_node_whose_ranks_all_died_waits_for_the_orders_of_a_recovery(agent):
    assert agent._monitor_workers("group").state is WorkerState.HEALTHY
    assert [code for _, _, code in agent.controller.exits] == [-9]  # reported once, at once
    assert agent._monitor_workers("group").state is WorkerState.HEALTHY
    assert agent.torch_verdicts == [] and len(agent.controller.exits) == 1
    # The controller starts the rank on another node: nothing failed is left
    # here, and torch's context (which ``release`` cleared) has the last word.
    agent._orders.put(pb.AgentOrder(id=1, moved=1))
    agent._monitor_workers("group")
    assert agent._failed_at is None and agent.torch_verdicts == ["group"]


@pytest.mark.parametrize("state", ["EXITED", "NORMAL", "INIT"])
def test_with_no_fault_in_hand_a_dead_node_is_a_failure_as_torch_says(agent, state):
    agent.controller.state = state
    assert agent._monitor_workers("group").state is WorkerState.FAILED
    assert agent.torch_verdicts == ["group"]


def test_a_controller_out_of_reach_gives_no_orders_to_wait_for(agent):
    def gone():
        raise ConnectionError("controller unreachable")

    agent.controller.snapshot = gone
    assert agent._monitor_workers("group").state is WorkerState.FAILED


def test_the_wait_is_bounded_by_the_grace_period(agent):
    assert agent._monitor_workers("group").state is WorkerState.HEALTHY
    agent._failed_at -= agent._grace_s() + 1
    assert agent._monitor_workers("group").state is WorkerState.FAILED


def test_workers_left_running_after_the_job_ended_are_stopped_after_a_short_grace(agent):
    """The job ended (the controller EXITED) while a rank it had given up for
    lost still runs: the agent stops it ENDED_GRACE_S later, not after every
    grace period of a recovery summed."""
    from trainguard.launcher import agent as agent_module

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent.replacements.procs[0] = alive
        agent.controller.state = "EXITED"
        assert agent._monitor_workers("group").state is WorkerState.HEALTHY  # its exit grace first
        assert agent.torch_verdicts == []
        agent._ended_at -= agent_module.ENDED_GRACE_S + 1
        assert agent._monitor_workers("group").state is WorkerState.FAILED  # torch's verdict ends the workers
        assert agent.torch_verdicts == ["group"]
    finally:
        alive.kill()
        alive.wait()


class RecordingPool:
    def __init__(self):
        self.kept = []

    def keep(self, workers, *, dumping, ranks_up, for_a_rank):
        self.kept.append((workers, dumping, ranks_up, for_a_rank))


class FakeRelay:
    def __init__(self):
        self.connected = frozenset()

    def report(self, event):
        pass


def test_standbys_wait_until_every_rank_of_the_node_has_its_session(agent):
    """A standby's import beside workers still starting slowed their start
    (seconds on a small box): the pool is filled only once each rank here
    has connected to the node's relay, and one per worker while a dump runs."""
    from trainguard.core.config import parse_strategies
    from trainguard.core.config_launch import LaunchConfig

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent.replacements.procs = {1: live}
        agent.relay, agent._warm = FakeRelay(), RecordingPool()
        agent._remaining_restarts, agent._launch, agent._spare = 3, LaunchConfig(), 0
        agent._config = ControllerConfig(strategies=parse_strategies("retry,recover-in-place,dump,exit"))
        group = type("Group", (), {"spec": type("Spec", (), {"local_world_size": 1})()})()
        assert agent._monitor_workers(group).state is WorkerState.HEALTHY
        assert agent._warm.kept == [(1, False, False, True)]  # rank 1 has no session yet: nothing starts
        agent.relay.connected = frozenset({1})
        agent._monitor_workers(group)
        assert agent._warm.kept[-1] == (1, False, True, True)
        agent._remaining_restarts = 0  # no budget: no standby at all
        agent._monitor_workers(group)
        assert len(agent._warm.kept) == 2
    finally:
        live.kill()
        live.wait()
