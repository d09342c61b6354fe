"""The controller's state machine driven directly, at thousands of ranks."""

from dataclasses import fields

import pytest

from controller_jobs import (WORLD, answer, elastic_job_waiting_for_its_new_process, hello, kills, status,
                             training_job)
from trainguard.core import EXIT_HUNG, ControllerConfig, ControllerState
from trainguard.core.agent_messages import (AgentEvent, AgentHello, AgentOrder, Dropped, Kill, LinkProbe, LinkRate,
                                            Moved, RestartsLeft, StartReplacement)
from trainguard.core.api import DataStatus, Fault, FaultKind, ProtocolError, RankStatus, RunStatus, Severity, Transfer
from trainguard.core.reports import Hello, PersistReport
from trainguard.core.checkpoint_parts import FileInfo, SavedShard
from trainguard.core.commands import (Clean, Command, CommandResult, Exit, Finalize, Rebuild, Repair, Resume,
                                      Rollback, Save, Stop)
from trainguard.core.control.wire import (Hellos, Wired, agent_event, agent_event_to_pb, agent_hello, agent_order,
                                         agent_order_to_pb, command, command_result, command_to_pb, persist_report,
                                         result_to_pb)
from trainguard.core.control.controller import ControllerCore
from trainguard.core import ReplicaGroup
from trainguard.core.protocol import trainguard_pb2 as pb


def test_a_retry_reaches_every_rank_of_a_large_job():
    sent: dict[int, list[Command]] = {}
    core = ControllerCore(ControllerConfig(), WORLD, send=lambda r, c: sent.setdefault(r, []).append(c))
    parse, hellos = Hellos(WORLD), []
    for rank in range(WORLD):
        hellos.append(hello(parse, rank, 7))
        core.on_hello(hellos[-1])
    assert core.state is ControllerState.NORMAL
    assert len(parse.parsed) == 1 and len({id(h.replicas[0]) for h in hellos}) == 1, \
        "every rank's group must be parsed once and shared"
    assert core.heartbeat_interval_s == 1.0

    core.on_fault(5, Fault(kind=FaultKind.UCE, rank=5, severity=Severity.HIGH, message="UCE ERROR"),
                  RankStatus(step=7, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    assert len(sent) == WORLD - 1 and all(isinstance(c[-1].action, Stop) for c in sent.values())
    assert len({id(c[-1]) for c in sent.values()}) == 1, "one STOP command shared by every rank"
    for rank in range(WORLD):
        if rank != 5:
            core.on_stopped(rank, RankStatus(step=7, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    assert core.state is ControllerState.RECOVERING
    for phase in ("clean", "rebuild", "repair", "rollback"):
        targets = [r for r, cmds in sent.items() if cmds[-1].name == phase]
        assert targets, phase
        for r in targets:
            core.on_result(r, answer(sent[r][-1], 7, RunStatus.RECOVERING))
    assert all(isinstance(cmds[-1].action, Resume) for cmds in sent.values()) and len(sent) == WORLD
    assert core.state is ControllerState.NORMAL
    assert core.journal.records[-1].strategy == "retry" and core.journal.records[-1].lost_steps == 0


def test_heartbeat_interval_stretches_above_4096_ranks():
    assert ControllerConfig().heartbeat_interval_for(16384) == 4.0
    assert ControllerConfig(heartbeat_interval_s=0.5).heartbeat_interval_for(16384) == 0.5


def test_a_stalled_controller_does_not_declare_everyone_hung():
    now = [0.0]
    sent = []
    core = ControllerCore(ControllerConfig(), 4, send=lambda r, c: sent.append((r, c)), clock=lambda: now[0])
    for rank in range(4):
        core.on_hello(Hello(rank=rank, pid=1 + rank, status=status(1, step_time_s=0.1)))
    now[0] = 10.0  # the event loop was blocked for 10 s: no tick, no heartbeat processed
    core.tick()
    assert core.state is ControllerState.NORMAL and not sent
    while now[0] < 14.0:  # the loop runs again (ticks every 50 ms) and the ranks stay silent
        now[0] += 0.05
        core.tick()
    # 4 s > 3 missed 1 s heartbeats: every rank is hung, nobody is left to save, the job exits.
    assert core.state is ControllerState.EXITED
    assert core.journal.records[-1].fault == "hang" and core.journal.records[-1].strategy == "exit"


def test_a_rank_silent_before_its_first_step_time_gets_the_first_step_limit():
    """A graph compile holds Python's GIL, and the heartbeat thread, for
    seconds: a rank that has reported no step time yet is not lost after 3
    missed heartbeats but after ``first_step_silence_s``; once it reported a
    step time, the usual limit applies again."""
    now, sent = [0.0], []
    core = ControllerCore(ControllerConfig(first_step_silence_s=60), 2, send=lambda r, c: sent.append((r, c)),
                          clock=lambda: now[0])
    for rank in range(2):
        core.on_hello(Hello(rank=rank, pid=1 + rank, status=status(0)))

    def silent(until: float, beating: tuple[int, ...] = ()) -> None:
        while now[0] < until:
            now[0] += 0.05
            for rank in beating:
                core.on_heartbeat(rank, RankStatus(step=2, run=RunStatus.TRAINING, data=DataStatus.UPDATED,
                                                   step_time_s=0.1))
            core.tick()

    silent(50.0)  # both compiling for 50 s: 16x the 3 missed heartbeats
    assert core.state is ControllerState.NORMAL and not sent
    silent(70.0, beating=(0,))  # rank 0 steps on; rank 1 is still silent at 60 s
    assert [(r, c.action.code) for r, c in sent if isinstance(c.action, Exit)] == [(1, EXIT_HUNG)]
    reason = next(c.action.reason for _, c in sent if isinstance(c.action, Exit))
    assert reason.startswith("no heartbeat for ") and 60 <= float(reason.split()[3]) <= 60.2, reason

    # Rank 0 has a step time now: 3 missed heartbeats are enough.
    before = len(sent)
    silent(75.0)
    assert [r for r, c in sent[before:] if isinstance(c.action, Exit)] == [0]


def test_a_rank_in_a_section_may_be_silent_for_the_section_s_limit():
    """A rank that announced an open section (an evaluation compiling holds
    the GIL) may stay silent for the section's limit, not 5 steps; once it
    reported the section closed, the usual limit is back."""
    now, sent = [0.0], []
    core = ControllerCore(ControllerConfig(), 1, send=lambda r, c: sent.append((r, c)), clock=lambda: now[0])
    core.on_hello(Hello(rank=0, pid=1, status=status(0)))

    def silent_until(t: float) -> None:
        while now[0] < t:
            now[0] += 0.1
            core.tick()

    core.on_heartbeat(0, RankStatus(step=3, run=RunStatus.TRAINING, data=DataStatus.UPDATED, step_time_s=0.2,
                                    silence_s=600))
    silent_until(500.0)
    assert core.state is ControllerState.NORMAL and not sent
    core.on_heartbeat(0, RankStatus(step=3, run=RunStatus.TRAINING, data=DataStatus.UPDATED, step_time_s=0.2))
    silent_until(504.0)  # max(3 heartbeats, 5 x 0.2 s + 2 heartbeats) = 3 s
    assert [(r, c.action.code) for r, c in sent if isinstance(c.action, Exit)] == [(0, EXIT_HUNG)]


def test_a_rank_that_does_not_stop_is_told_to_exit_and_the_others_dump():
    """A rank stuck in a collective with a peer that has left it (megatron's
    own groups cannot be aborted) keeps its heartbeat but never stops: at the
    prelock deadline it is counted hung and sent an exit (its processor then
    ends the process), and the dump goes on without it."""
    now, sent = [0.0], []
    core = ControllerCore(ControllerConfig(prelock_timeout_s=5), 4, send=lambda r, c: sent.append((r, c)),
                          clock=lambda: now[0])
    for rank in range(4):
        core.on_hello(Hello(rank=rank, pid=1 + rank, replicas=(ReplicaGroup.full(range(4)),), status=status(3)))
    core.on_process_exit(1, 2, -9)
    for rank in (0, 3):  # their collectives with rank 1 broke; rank 2 waits on rank 0 in another group
        core.on_stopped(rank, RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    def beat() -> None:  # every live process heartbeats, rank 2's too
        for rank in (0, 3):
            core.on_heartbeat(rank, RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
        core.on_heartbeat(2, RankStatus(step=3, run=RunStatus.TRAINING, data=DataStatus.UPDATED))
    while now[0] < 4.5:
        now[0] += 0.5
        beat()
        core.tick()
    assert core.state is ControllerState.ABNORMAL and not [c for r, c in sent if r == 2 and isinstance(c.action, Exit)]
    now[0] = 5.5
    beat()
    core.tick()
    exits = [c for r, c in sent if r == 2 and isinstance(c.action, Exit)]
    assert len(exits) == 1 and exits[0].action.code == 77 and "did not stop within 5 s" in exits[0].action.reason
    assert core.state is ControllerState.DUMPING
    saves = {r for r, c in sent if isinstance(c.action, Save)}
    assert saves and saves <= {0, 3}, saves


def test_two_lost_ranks_on_two_nodes_are_restarted_on_one_store():
    """recover-in-place with a rank lost on each of two nodes: the first
    agent makes the store, the second is ordered onto it; the survivors are
    told to join only when both new processes run; the new ranks register,
    get their state and resume with everyone."""
    world = 4
    core, sent, orders = training_job(world, "recover-in-place,dump", max_restarts=2)
    full = (ReplicaGroup.full(range(world)),)
    core.on_agent("a", AgentHello(ranks=(0, 1)))
    core.on_agent("b", AgentHello(ranks=(2, 3)))
    core.on_disconnect(1)
    core.on_disconnect(3)
    for rank in (0, 2):
        core.on_stopped(rank, RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    for rank in (0, 2):  # clean
        core.on_result(rank, answer(sent[rank][-1], 3, RunStatus.STOPPED))
    starts = [(n, o) for n, o in orders if isinstance(o.action, StartReplacement)]
    assert [(n, o.action.rank, o.action.join_store) for n, o in starts] == [("a", 1, "")]  # one at a time
    core.on_agent_event("a", AgentEvent(rank=1, order=starts[0][1].id, ok=True, pid=201, join_store="h:1"))
    starts = [(n, o) for n, o in orders if isinstance(o.action, StartReplacement)]
    assert [(n, o.action.rank, o.action.join_store) for n, o in starts] == [("a", 1, ""), ("b", 3, "h:1")]
    assert not isinstance(sent[0][-1].action, Rebuild), "the survivors wait until every new process runs"
    core.on_agent_event("b", AgentEvent(rank=3, order=starts[1][1].id, ok=True, pid=203, join_store="h:1"))
    assert sent[0][-1].action.join_store == "h:1" and sent[2][-1].action.join_store == "h:1"
    assert core.agents.restarts_left == 0
    for rank in (0, 2):
        core.on_result(rank, answer(sent[rank][-1], 3, RunStatus.STOPPED))
    assert core.episode.phases[0].name == "join", "still waiting for the new processes to register"
    for rank in (1, 3):
        core.on_hello(Hello(rank=rank, pid=200 + rank, replicas=full, joining=True,
                            status=status(0, RunStatus.STARTING)))
    for phase in ("repair", "rollback"):
        targets = [r for r, cmds in sent.items() if cmds[-1].name == phase]
        assert set(targets) >= {1, 3}, phase
        for r in targets:
            core.on_result(r, answer(sent[r][-1], 3, RunStatus.RECOVERING))
    assert all(isinstance(sent[r][-1].action, Resume) for r in range(world))
    assert core.state is ControllerState.NORMAL
    assert core.journal.records[-1].strategy == "recover-in-place"
    assert core.snapshot()["pids"] == {"0": [100], "1": [101, 201], "2": [102], "3": [103, 203]}


@pytest.mark.parametrize("strategies, restarts, outcome", [
    ("retry,recover-in-place,dump", 1, "recover-in-place"),
    ("retry,dump,exit", 0, "dump"),
])
def test_a_device_memory_error_a_rank_cannot_repair_in_its_process_ends_that_process(strategies, restarts, outcome):
    """CUDA cannot clean a device memory error in the process: the rank is
    told to exit at once (no retry is tried on it) and counted lost, so a
    restart strategy gives it a new process and the survivors keep theirs,
    or, without restarts, the others dump without it."""
    world = 3
    sent: dict[int, list[Command]] = {}
    orders: list = []
    core = ControllerCore(ControllerConfig(strategies=strategies, max_restarts=restarts), world,
                          send=lambda r, c: sent.setdefault(r, []).append(c),
                          send_agent=lambda n, o: orders.append((n, o)))
    full = (ReplicaGroup.full(range(world)),)
    for rank in range(world):
        core.on_hello(Hello(rank=rank, pid=100 + rank, replicas=full, status=status(3), device_repairable=rank != 1))
    core.on_agent("a", AgentHello(ranks=tuple(range(world))))
    core.on_fault(1, Fault(kind=FaultKind.UCE, rank=1, severity=Severity.HIGH, message="UCE ERROR"),
                  RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATING))
    (ended,) = sent[1]
    assert isinstance(ended.action, Exit) and ended.action.code == 76, ended
    assert "cannot be repaired in the process" in ended.action.reason
    assert not core.ranks[1].alive
    core.on_process_exit(1, 101, 76)  # its own exit is no second fault
    for rank in (0, 2):
        core.on_stopped(rank, RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    assert core.episode.plan.strategy.value == outcome, core.episode.reason
    assert "retry: rank 1: device memory error" in core.episode.reason and "cannot be repaired in-process" in core.episode.reason
    assert len(sent[1]) == 1, "nothing more is sent to the ended process"
    if outcome == "dump":
        assert core.state is ControllerState.DUMPING
        assert {r for r, cmds in sent.items() if isinstance(cmds[-1].action, Save)} == {0, 2}
        return
    for rank in (0, 2):  # clean
        core.on_result(rank, answer(sent[rank][-1], 3, RunStatus.STOPPED))
    (start,) = [o for _, o in orders if isinstance(o.action, StartReplacement)]
    assert (start.action.rank, start.action.step) == (1, 3)


def test_the_record_names_the_lost_rank_not_the_peer_whose_collective_broke(caplog):
    """A survivor's broken collective often reaches the controller before
    the lost process does; the record and the one warning line still name
    the cause first."""
    world = 3
    sent: dict[int, list[Command]] = {}
    core = ControllerCore(ControllerConfig(strategies="dump"), world,
                          send=lambda r, c: sent.setdefault(r, []).append(c))
    full = (ReplicaGroup.full(range(world)),)
    for rank in range(world):
        core.on_hello(Hello(rank=rank, pid=100 + rank, replicas=full, status=status(3)))
    core.on_fault(0, Fault(kind=FaultKind.COMM, rank=0, message="Connection closed by peer"),
                  RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    core.on_disconnect(1)
    core.on_stopped(2, RankStatus(step=3, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    saving = [r for r, cmds in sent.items() if isinstance(cmds[-1].action, Save)]
    assert sorted(saving) == [0, 2], "every survivor saves (its own part at least)"
    (saver,) = [r for r in saving if sent[r][-1].action.kinds]
    answered = {sent[rank][-1].id for rank in saving}
    for rank in saving:
        core.on_result(rank, answer(sent[rank][-1], 3, RunStatus.STOPPED))
    (record,) = core.journal.records
    assert (record.fault, record.rank, record.strategy, record.step) == ("process_lost", 1, "dump", 3)
    while core.state is not ControllerState.EXITED:  # finalise, exit: every command succeeds
        waiting = [r for r in saving if sent[r][-1].id not in answered]
        assert waiting, core.state
        for rank in waiting:
            answered.add(sent[rank][-1].id)
            core.on_result(rank, answer(sent[rank][-1], 3, RunStatus.STOPPED))
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert line.startswith("fault: rank 1: process lost") and "; rank 0: comm: Connection closed by peer" in line, line


def test_a_new_process_that_starts_after_the_job_finished_is_ended_not_waited_for():
    """elastic-training: the survivors finish before the agent reports the
    new process running (a slow start on a busy machine). The controller
    must end that process (it would wait to join for ever, and the launcher
    with it), not try to pause a finished job."""
    core, sent, orders, start = elastic_job_waiting_for_its_new_process()
    for rank in (0, 1):
        core.on_goodbye(rank, RankStatus(step=16, run=RunStatus.FINISHED, data=DataStatus.UPDATED))
    assert core.state is ControllerState.FINISHED
    commands = sum(len(cmds) for cmds in sent.values())
    core.on_agent_event("a", AgentEvent(rank=2, order=start.id, ok=True, pid=202, join_store="h:1"))
    assert core.state is ControllerState.FINISHED
    assert kills(orders) == [("a", 2)]
    assert sum(len(cmds) for cmds in sent.values()) == commands  # nobody is paused


def test_a_new_process_that_runs_when_a_rank_already_finished_is_ended_and_the_rest_finish():
    """The new process runs while one survivor has finished and the other is
    at its last step: too late to take it in; it is ended, and the last
    survivor is not stopped."""
    core, sent, orders, start = elastic_job_waiting_for_its_new_process()
    core.on_goodbye(0, RankStatus(step=16, run=RunStatus.FINISHED, data=DataStatus.UPDATED))
    stops = len([c for c in sent[1] if isinstance(c.action, Stop)])
    core.on_agent_event("a", AgentEvent(rank=2, order=start.id, ok=True, pid=202, join_store="h:1"))
    assert kills(orders) == [("a", 2)]
    assert len([c for c in sent[1] if isinstance(c.action, Stop)]) == stops
    core.on_goodbye(1, RankStatus(step=16, run=RunStatus.FINISHED, data=DataStatus.UPDATED))
    assert core.state is ControllerState.FINISHED


def test_a_survivor_that_finishes_instead_of_stopping_for_the_scale_up_ends_it():
    """The job paused to take the new process in, but a survivor had passed
    its last step and finishes: the new process (registered already) is
    ended, its end is no fault, the survivor that stopped resumes, and the
    job finishes."""
    core, sent, orders, start = elastic_job_waiting_for_its_new_process()
    core.on_agent_event("a", AgentEvent(rank=2, order=start.id, ok=True, pid=202, join_store="h:1"))
    assert core.state is ControllerState.ABNORMAL
    assert isinstance(sent[0][-1].action, Stop) and isinstance(sent[1][-1].action, Stop)
    core.on_hello(Hello(rank=2, pid=202, joining=True, replicas=(ReplicaGroup.full(range(3)),),
                        status=status(0, RunStatus.STARTING)))
    core.on_stopped(1, RankStatus(step=16, run=RunStatus.STOPPED, data=DataStatus.UPDATED))
    core.on_goodbye(0, RankStatus(step=16, run=RunStatus.FINISHED, data=DataStatus.UPDATED))
    for _ in range(5):
        if core.state is ControllerState.NORMAL:
            break
        core.on_result(1, answer(sent[1][-1], 16, RunStatus.STOPPED))
    assert core.state is ControllerState.NORMAL and isinstance(sent[1][-1].action, Resume)
    assert kills(orders) == [("a", 2)]
    core.on_disconnect(2)  # the agent ended it
    assert core.state is ControllerState.NORMAL and core.episode is None
    core.on_goodbye(1, RankStatus(step=16, run=RunStatus.FINISHED, data=DataStatus.UPDATED))
    assert core.state is ControllerState.FINISHED


def test_commands_and_their_results_cross_the_wire_field_for_field():
    """The core's commands become the protobuf messages of the same names at
    the edge, one message per command however many ranks it goes to; the
    ranks' answers come back as the core's results."""
    files = (FileInfo("shard_k0_r0.pt", 5, "c" * 64),)
    shard = SavedShard(kind=1, copies=(0, 2), full=True, rank=2, files=files)
    actions = [Stop("UCE ERROR", at_boundary=True), Clean(uce=True), Rebuild(3, excluded=(1, 2), join_store="h:1"),
               Repair(7, (Transfer(0, 1, kind=1),)), Rollback(7), Save(7, kinds=(0, 1), carry=(3,)),
               Finalize(7, (shard,), '{"records": []}', files), Resume(7, "{}", '{"1": [2]}', replicas=2),
               Exit(76, "bye")]
    assert {f.name for f in pb.Command.DESCRIPTOR.oneofs_by_name["action"].fields} == {
        Command(0, 0, a).name for a in actions}, "every action of the protocol, once"
    for i, action in enumerate(actions, 1):
        msg = command_to_pb(Command(i, 2, action))
        assert (msg.id, msg.epoch, msg.WhichOneof("action")) == (i, 2, type(action).__name__.lower())
        body = getattr(msg, msg.WhichOneof("action"))
        for f in fields(action):
            value, got = getattr(action, f.name), getattr(body, f.name)
            if f.name == "transfers":
                got = tuple(Transfer(t.src, t.dst, t.kind) for t in got)
            elif f.name == "shards":
                got = tuple(SavedShard(kind=s.kind, copies=tuple(s.copies), full=s.full, rank=s.rank,
                                       files=tuple(FileInfo(x.name, x.bytes, x.sha256) for x in s.files)) for s in got)
            elif f.name == "own":
                got = tuple(FileInfo(x.name, x.bytes, x.sha256) for x in got)
            assert (tuple(got) if isinstance(value, tuple) else got) == value, (action, f.name)
        assert command(msg) == Command(i, 2, action), "the rank's side reads what the controller's makes"
    wired, stop = Wired(), Command(1, 1, Stop("x"))
    assert wired(stop) is wired(stop) and wired(Command(2, 1, Stop("x"))) is not wired(stop)
    answer_ = pb.CommandResult(command_id=5, ok=False, code=3, message="no", own=[pb.FileInfo(name="o", bytes=1)],
                               status=pb.Status(step=7, run=pb.RECOVERING, data=pb.UPDATED),
                               shards=[pb.ShardFiles(kind=1, files=[pb.FileInfo(name="s", bytes=2, sha256="d")])])
    assert command_result(answer_) == CommandResult(
        command_id=5, ok=False, code=3, message="no", own=(FileInfo("o", 1, ""),),
        status=RankStatus(step=7, run=RunStatus.RECOVERING, data=DataStatus.UPDATED),
        shards=(SavedShard(kind=1, copies=(), full=False, rank=0, files=(FileInfo("s", 2, "d"),)),))
    mine = CommandResult(command_id=6, ok=True, code=2, message="m", shards=(shard,), own=files,
                         status=RankStatus(step=3, run=RunStatus.RECOVERING, data=DataStatus.COPYING, step_time_s=0.5,
                                           silence_s=9))
    assert command_result(result_to_pb(mine)) == mine, "the controller's side reads what the rank's makes"


def test_registrations_persist_health_and_agent_messages_cross_the_wire_field_for_field():
    """What ranks and node agents send reaches the core as its own plain
    data, a malformed replica group refused at the edge; the core's orders to
    node agents become the protobuf ``AgentOrder``, one field per action."""
    parse = Hellos(8)
    got = parse(pb.Hello(rank=3, world_size=8, pid=42, host="h", joining=True, device_repairable=True,
                         status=pb.Status(step=5, run=pb.STARTING, data=pb.UPDATED, step_time_s=0.5),
                         replicas=[pb.ReplicaGroup(range_start=1, range_step=2, range_count=4, replica_cnt=2),
                                   pb.ReplicaGroup(rank_list=[3, 4], replica_cnt=2)]))
    assert got == Hello(rank=3, pid=42, host="h", joining=True, device_repairable=True,
                        status=status(5, RunStatus.STARTING, step_time_s=0.5),
                        replicas=(ReplicaGroup((1, 3, 5, 7), 2), ReplicaGroup((3, 4), 2)))
    training = pb.Status(step=5, run=pb.TRAINING, data=pb.UPDATED)
    again = parse(pb.Hello(rank=4, status=training, replicas=[pb.ReplicaGroup(rank_list=[3, 4], replica_cnt=2)]))
    assert again.replicas[0] is got.replicas[1] and len(parse.parsed) == 2, "one object per group, however many send it"
    for bad in (pb.ReplicaGroup(range_step=0, range_count=4, replica_cnt=4),
                pb.ReplicaGroup(range_step=1, range_count=9, replica_cnt=1)):
        with pytest.raises(ProtocolError, match="needs a step and at most 8 ranks"):
            parse(pb.Hello(rank=0, status=training, replicas=[bad]))
    with pytest.raises(ProtocolError, match="run status has an unknown value"):
        parse(pb.Hello(rank=0, status=pb.Status(run=99, data=1)))

    assert persist_report(pb.PersistHealth(failing=True, since_step=8, reason="full", last_complete=-1)) == \
        PersistReport(failing=True, since_step=8, reason="full", last_complete=None)
    assert persist_report(pb.PersistHealth(failing=True, last_complete=6)).last_complete == 6
    assert persist_report(pb.PersistHealth()) == PersistReport(failing=False, last_complete=0)

    assert agent_hello(pb.AgentHello(ranks=[0, 1], spare=2, key=b"k", probe="h:1")) == \
        AgentHello(ranks=(0, 1), spare=2, probe="h:1")
    assert agent_event(pb.AgentEvent(rank=1, order=9, ok=True, pid=7, join_store="h:2", message="m",
                                     rates=[pb.LinkRate(node="b", bytes_per_s=1e9, error="e")])) == \
        AgentEvent(rank=1, order=9, ok=True, pid=7, join_store="h:2", message="m", rates=(LinkRate("b", 1e9, "e"),))
    answer = AgentEvent(rank=1, order=9, ok=True, pid=7, join_store="h:2", message="m", rates=(LinkRate("b", 1e9, "e"),))
    assert agent_event(agent_event_to_pb(answer)) == answer, "the agent's side makes what the controller's reads"
    actions = [StartReplacement(rank=2, generation=3, step=-1, join_store="h:1"), Kill(2), RestartsLeft(0),
               Moved(4), Dropped(5), LinkProbe(nodes=("b", "c"), addrs=("b:1", "c:1"), bytes=64)]
    assert {f.name for f in pb.AgentOrder.DESCRIPTOR.oneofs_by_name["action"].fields} == {
        AgentOrder(0, a).name for a in actions}, "every action of the protocol, once"
    for i, action in enumerate(actions, 1):
        msg = agent_order_to_pb(AgentOrder(i, action))
        assert (msg.id, msg.WhichOneof("action")) == (i, action.name), action
        body = getattr(msg, action.name)
        if len(fields(action)) == 1:  # the field is the value: kill, restarts_left, moved, dropped
            assert body == getattr(action, fields(action)[0].name), action
            continue
        for f in fields(action):
            value, got = getattr(action, f.name), getattr(body, f.name)
            assert (tuple(got) if isinstance(value, tuple) else got) == value, (action, f.name)
    assert [agent_order(agent_order_to_pb(AgentOrder(i, a))) for i, a in enumerate(actions, 1)] == \
        [AgentOrder(i, a) for i, a in enumerate(actions, 1)], "the agent's side reads what the controller's makes"
    with pytest.raises(ProtocolError, match="carries no action"):
        agent_order(pb.AgentOrder(id=3))


def test_the_state_machine_takes_and_makes_no_protobuf():
    """Protobuf is read and made at the controller's edge only (its server and service,
    routing, wire translation and client), never by the core's state machine,
    the plain data it takes and makes, or the link survey (both sides)."""
    from pathlib import Path

    control = Path(command_to_pb.__code__.co_filename).parent
    plain = [*control.glob("*.py"), *(control.parent / f for f in ("api.py", "reports.py", "commands.py",
                                                                     "agent_messages.py", "links.py"))]
    edge = {"server.py", "service.py", "routing.py", "wire.py", "client.py"}
    assert [f.name for f in plain if f.name not in edge and "trainguard_pb2" in f.read_text()] == []
