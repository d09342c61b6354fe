"""Driving :class:`ControllerCore` directly in ``test_controller_core.py``:
a rank's ``Hello`` as the server's edge hands it over (:func:`hello`), a
rank's status and its answer to a command (:func:`status`, :func:`answer`),
a controller whose ranks train at step 3 with what it sends to ranks and to
node agents recorded (:func:`training_job`), the same after an
elastic-training loss whose new process is not yet running
(:func:`elastic_job_waiting_for_its_new_process`), and the kill orders it
sent (:func:`kills`)."""

from trainguard.core import ControllerConfig, ControllerState, ReplicaGroup
from trainguard.core.agent_messages import AgentHello, AgentOrder, Kill, StartReplacement
from trainguard.core.api import DataStatus, RankStatus, RunStatus
from trainguard.core.reports import Hello
from trainguard.core.commands import Command, CommandResult
from trainguard.core.control.wire import Hellos
from trainguard.core.control.controller import ControllerCore
from trainguard.core.rank.messages import replica_group
from trainguard.core.protocol import trainguard_pb2 as pb

WORLD = 4096


def hello(parse: Hellos, rank: int, step: int) -> Hello:
    """Rank ``rank``'s Hello as the server hands it to the core (``parse``: its edge translation)."""
    return parse(pb.Hello(rank=rank, world_size=WORLD, pid=1000 + rank, host="h",
                          status=pb.Status(step=step, run=pb.TRAINING, data=pb.UPDATED), device_repairable=True,
                          replicas=[replica_group(ReplicaGroup.full(range(WORLD)))]))


def status(step: int, run: RunStatus = RunStatus.TRAINING, **kw) -> RankStatus:
    return RankStatus(step=step, run=run, data=DataStatus.UPDATED, **kw)


def answer(cmd: Command, step: int, run: RunStatus) -> CommandResult:
    """A rank's answer that ``cmd`` succeeded, at ``step``."""
    return CommandResult(command_id=cmd.id, ok=True, status=RankStatus(step=step, run=run, data=DataStatus.UPDATED))


def training_job(world: int, strategies: str, *, max_restarts: int):
    """A controller whose ``world`` ranks (pids 100 + rank) train at step 3,
    recording what it sends to ranks and to node agents."""
    sent: dict[int, list[Command]] = {}
    orders: list[tuple[str, AgentOrder]] = []
    core = ControllerCore(ControllerConfig(strategies=strategies, max_restarts=max_restarts), world,
                          send=lambda r, c: sent.setdefault(r, []).append(c),
                          send_agent=lambda n, o: orders.append((n, o)))
    full = (ReplicaGroup.full(range(world)),)
    for rank in range(world):
        core.on_hello(Hello(rank=rank, pid=100 + rank, replicas=full, status=status(3)))
    return core, sent, orders


def elastic_job_waiting_for_its_new_process(world: int = 3):
    """Rank ``world - 1`` of an elastic-training job was lost, the others went
    on, and its agent was ordered to start a new process for it."""
    core, sent, orders = training_job(world, "elastic-training,dump", max_restarts=1)
    core.on_agent("a", AgentHello(ranks=tuple(range(world))))
    core.on_disconnect(world - 1)
    live = range(world - 1)
    for rank in live:
        core.on_stopped(rank, RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    while core.state is not ControllerState.NORMAL:  # every phase of the plan succeeds
        for rank in live:
            core.on_result(rank, answer(sent[rank][-1], 3, RunStatus.STOPPED))
    (start,) = [o for _, o in orders if isinstance(o.action, StartReplacement)]
    assert start.action.rank == world - 1 and core.roster.dropped == {world - 1}
    return core, sent, orders, start


def kills(orders) -> list[tuple[str, int]]:
    return [(n, o.action.rank) for n, o in orders if isinstance(o.action, Kill)]
