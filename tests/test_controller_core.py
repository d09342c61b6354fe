"""The controller's state machine driven directly, at thousands of ranks."""

from trainguard.core import ControllerConfig, ControllerState
from trainguard.core.controller import ControllerCore
from trainguard.core.processor import _pb_group
from trainguard.core import ReplicaGroup
from trainguard.core.protocol import trainguard_pb2 as pb

WORLD = 4096


def hello(rank: int, step: int) -> pb.Hello:
    return pb.Hello(rank=rank, world_size=WORLD, pid=1000 + rank, host="h",
                    status=pb.Status(step=step, run=pb.TRAINING, data=pb.UPDATED), device_repairable=True,
                    replicas=[_pb_group(ReplicaGroup.full(range(WORLD)))])


def test_a_retry_reaches_every_rank_of_a_large_job():
    sent: dict[int, list[pb.Command]] = {}
    core = ControllerCore(ControllerConfig(), WORLD, send=lambda r, c: sent.setdefault(r, []).append(c))
    for rank in range(WORLD):
        core.on_hello(hello(rank, 7))
    assert core.state is ControllerState.NORMAL
    assert len(core._parsed) == 1, "every rank's group must be parsed once and shared"
    assert core.heartbeat_interval_s == 1.0

    core.on_fault(5, pb.FaultReport(kind=pb.UCE, severity=pb.HIGH, message="UCE ERROR",
                                    status=pb.Status(step=7, run=pb.STOPPED, data=pb.UPDATED)))
    assert len(sent) == WORLD - 1 and all(c[-1].HasField("stop") for c in sent.values())
    assert len({id(c[-1]) for c in sent.values()}) == 1, "one STOP command shared by every rank"
    for rank in range(WORLD):
        if rank != 5:
            core.on_stopped(rank, pb.Status(step=7, run=pb.STOPPED, data=pb.UPDATED))
    assert core.state is ControllerState.RECOVERING
    for phase in ("clean", "rebuild", "repair", "rollback"):
        targets = [r for r, cmds in sent.items() if cmds[-1].HasField(phase)]
        assert targets, phase
        for r in targets:
            core.on_result(r, pb.CommandResult(command_id=sent[r][-1].id, ok=True,
                                               status=pb.Status(step=7, run=pb.RECOVERING, data=pb.UPDATED)))
    assert all(cmds[-1].HasField("resume") for cmds in sent.values()) and len(sent) == WORLD
    assert core.state is ControllerState.NORMAL
    assert core.records[-1].strategy == "retry" and core.records[-1].lost_steps == 0


def test_heartbeat_interval_stretches_above_4096_ranks():
    assert ControllerConfig().heartbeat_interval_for(16384) == 4.0
    assert ControllerConfig(heartbeat_interval_s=0.5).heartbeat_interval_for(16384) == 0.5


def test_a_stalled_controller_does_not_declare_everyone_hung():
    now = [0.0]
    sent = []
    core = ControllerCore(ControllerConfig(), 4, send=lambda r, c: sent.append((r, c)), clock=lambda: now[0])
    for rank in range(4):
        core.on_hello(pb.Hello(rank=rank, world_size=4, pid=1 + rank,
                               status=pb.Status(step=1, run=pb.TRAINING, data=pb.UPDATED)))
    now[0] = 10.0  # the event loop was blocked for 10 s: no tick, no heartbeat processed
    core.tick()
    assert core.state is ControllerState.NORMAL and not sent
    while now[0] < 14.0:  # the loop runs again (ticks every 50 ms) and the ranks stay silent
        now[0] += 0.05
        core.tick()
    # 4 s > 3 missed 1 s heartbeats: every rank is hung, nobody is left to save, the job exits.
    assert core.state is ControllerState.EXITED
    assert core.records[-1].fault == "hang" and core.records[-1].strategy == "exit"


def test_a_rank_that_does_not_stop_is_told_to_exit_and_the_others_dump():
    """A rank stuck in a collective with a peer that has left it (megatron's
    own groups cannot be aborted) keeps its heartbeat but never stops: at the
    prelock deadline it is counted hung and sent an exit (its processor then
    ends the process), and the dump goes on without it."""
    now, sent = [0.0], []
    core = ControllerCore(ControllerConfig(prelock_timeout_s=5), 4, send=lambda r, c: sent.append((r, c)),
                          clock=lambda: now[0])
    for rank in range(4):
        core.on_hello(pb.Hello(rank=rank, world_size=4, pid=1 + rank, replicas=[_pb_group(ReplicaGroup.full(range(4)))],
                               status=pb.Status(step=3, run=pb.TRAINING, data=pb.UPDATED)))
    core.on_process_exit(1, 2, -9)
    for rank in (0, 3):  # their collectives with rank 1 broke; rank 2 waits on rank 0 in another group
        core.on_stopped(rank, pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED))
    def beat() -> None:  # every live process heartbeats, rank 2's too
        for rank in (0, 3):
            core.on_heartbeat(rank, pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED))
        core.on_heartbeat(2, pb.Status(step=3, run=pb.TRAINING, data=pb.UPDATED))
    while now[0] < 4.5:
        now[0] += 0.5
        beat()
        core.tick()
    assert core.state is ControllerState.ABNORMAL and not [c for r, c in sent if r == 2 and c.HasField("exit")]
    now[0] = 5.5
    beat()
    core.tick()
    exits = [c for r, c in sent if r == 2 and c.HasField("exit")]
    assert len(exits) == 1 and exits[0].exit.code == 77 and "did not stop within 5 s" in exits[0].exit.reason
    assert core.state is ControllerState.DUMPING
    saves = {r for r, c in sent if c.HasField("save")}
    assert saves and saves <= {0, 3}, saves


def test_two_lost_ranks_on_two_nodes_are_restarted_on_one_store():
    """recover-in-place with a rank lost on each of two nodes: the first
    agent makes the store, the second is ordered onto it; the survivors are
    told to join only when both new processes run; the new ranks register,
    get their state and resume with everyone."""
    world = 4
    sent: dict[int, list[pb.Command]] = {}
    orders: list[tuple[str, pb.AgentOrder]] = []
    core = ControllerCore(ControllerConfig(strategies="recover-in-place,dump", max_restarts=2), world,
                          send=lambda r, c: sent.setdefault(r, []).append(c),
                          send_agent=lambda n, o: orders.append((n, o)))
    full = [_pb_group(ReplicaGroup.full(range(world)))]
    for rank in range(world):
        core.on_hello(pb.Hello(rank=rank, world_size=world, pid=100 + rank, replicas=full,
                               status=pb.Status(step=3, run=pb.TRAINING, data=pb.UPDATED)))
    core.on_agent("a", pb.AgentHello(ranks=[0, 1]))
    core.on_agent("b", pb.AgentHello(ranks=[2, 3]))
    core.on_disconnect(1)
    core.on_disconnect(3)
    for rank in (0, 2):
        core.on_stopped(rank, pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED))
    for rank in (0, 2):  # clean
        core.on_result(rank, pb.CommandResult(command_id=sent[rank][-1].id, ok=True,
                                              status=pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED)))
    starts = [(n, o) for n, o in orders if o.HasField("start")]
    assert [(n, o.start.rank, o.start.join_store) for n, o in starts] == [("a", 1, "")]  # one at a time
    core.on_agent_event("a", pb.AgentEvent(rank=1, order=starts[0][1].id, ok=True, pid=201, join_store="h:1"))
    starts = [(n, o) for n, o in orders if o.HasField("start")]
    assert [(n, o.start.rank, o.start.join_store) for n, o in starts] == [("a", 1, ""), ("b", 3, "h:1")]
    assert not sent[0][-1].HasField("rebuild"), "the survivors wait until every new process runs"
    core.on_agent_event("b", pb.AgentEvent(rank=3, order=starts[1][1].id, ok=True, pid=203, join_store="h:1"))
    assert sent[0][-1].rebuild.join_store == "h:1" and sent[2][-1].rebuild.join_store == "h:1"
    assert core.agents.restarts_left == 0
    for rank in (0, 2):
        core.on_result(rank, pb.CommandResult(command_id=sent[rank][-1].id, ok=True,
                                              status=pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED)))
    assert core.episode.phases[0].name == "join", "still waiting for the new processes to register"
    for rank in (1, 3):
        core.on_hello(pb.Hello(rank=rank, world_size=world, pid=200 + rank, replicas=full, joining=True,
                               status=pb.Status(step=0, run=pb.STARTING, data=pb.UPDATED)))
    for phase in ("repair", "rollback"):
        targets = [r for r, cmds in sent.items() if cmds[-1].HasField(phase)]
        assert set(targets) >= {1, 3}, phase
        for r in targets:
            core.on_result(r, pb.CommandResult(command_id=sent[r][-1].id, ok=True,
                                               status=pb.Status(step=3, run=pb.RECOVERING, data=pb.UPDATED)))
    assert all(sent[r][-1].HasField("resume") for r in range(world))
    assert core.state is ControllerState.NORMAL
    assert core.records[-1].strategy == "recover-in-place"
    assert core.snapshot()["pids"] == {"0": [100], "1": [101, 201], "2": [102], "3": [103, 203]}


def test_the_record_names_the_lost_rank_not_the_peer_whose_collective_broke():
    """A survivor's broken collective often reaches the controller before
    the lost process does; the record still names the cause."""
    world = 3
    sent: dict[int, list[pb.Command]] = {}
    core = ControllerCore(ControllerConfig(strategies="dump"), world,
                          send=lambda r, c: sent.setdefault(r, []).append(c))
    full = [_pb_group(ReplicaGroup.full(range(world)))]
    for rank in range(world):
        core.on_hello(pb.Hello(rank=rank, world_size=world, pid=100 + rank, replicas=full,
                               status=pb.Status(step=3, run=pb.TRAINING, data=pb.UPDATED)))
    core.on_fault(0, pb.FaultReport(kind=pb.COMM, message="Connection closed by peer",
                                    status=pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED)))
    core.on_disconnect(1)
    core.on_stopped(2, pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED))
    (saver,) = [r for r, cmds in sent.items() if cmds[-1].HasField("save")]
    core.on_result(saver, pb.CommandResult(command_id=sent[saver][-1].id, ok=True,
                                           status=pb.Status(step=3, run=pb.STOPPED, data=pb.UPDATED)))
    (record,) = core.records
    assert (record.fault, record.rank, record.strategy, record.step) == ("process_lost", 1, "dump", 3)
