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
