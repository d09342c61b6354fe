"""The gRPC control plane with a real controller and real processors in one
process (the training side is replaced by recording handlers)."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest

from trainguard.core import (
    EXIT_AFTER_DUMP,
    Classifier,
    Controller,
    ControllerConfig,
    ControllerState,
    Handlers,
    Processor,
    ProcessorConfig,
    ProtocolError,
    ReplicaGroup,
    recover,
    report_left_step,
)
from trainguard.core.checkpoint import FileInfo
from trainguard.core.control.client import ControllerClient
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.handshake import login
from trainguard.core.rpc import SERVICE

FAST = dict(heartbeat_interval_s=0.2, prelock_timeout_s=3.0, handler_timeout_s=3.0)


class Recording(Handlers):
    def __init__(self, rank: int, fail: str | None = None) -> None:
        self.rank, self.fail, self.calls = rank, fail, []

    def _note(self, *call):
        self.calls.append(call)
        if self.fail == call[0]:
            raise RuntimeError(f"{call[0]} broke on rank {self.rank}")

    def clean(self, uce):
        self._note("clean", uce)
        return 0

    def rebuild(self, generation, ranks, join_store=""):
        self._note("rebuild", generation)

    def repair(self, step, transfers):
        self._note("repair", step, [(t.src, t.dst) for t in transfers])

    def rollback(self, step):
        self._note("rollback", step)

    def save(self, step, kind):
        self._note("save", step, kind)
        return [FileInfo(f"shard_k{kind}_r{self.rank}.pt", 10, "ab" * 32)]

    def finalize(self, step, shards, history):
        self._note("finalize", step, [(s.rank, [f.name for f in s.files]) for s in shards], history)


@pytest.fixture
def controller():
    with Controller(ControllerConfig(**FAST), 3) as c:
        yield c


def connect(c: Controller, rank: int, world: int = 3, token: str | None = None, step: int = 0) -> Processor:
    p = Processor(ProcessorConfig(controller=c.address, token=token or c.token, rank=rank, world_size=world,
                                  connect_timeout_s=5), force_exit=lambda code: None)
    p.connect(step=step, replicas=[ReplicaGroup.full(range(world))])
    return p


def train_to(procs, step):
    for p in procs:
        while p.step < step:
            p.start_update()
            p.end_update(p.step + 1)


def run_ranks(procs, handlers, faulty: dict[int, Exception]):
    """Each rank leaves its step (own fault, or the STOP) and recovers."""
    outcomes = {}

    def rank_main(p, h):
        if p.rank in faulty:
            report_left_step(p, faulty[p.rank], Classifier())
        else:
            assert p.stop_event.wait(10), "no STOP arrived"
        outcomes[p.rank] = recover(p, h)

    threads = [threading.Thread(target=rank_main, args=(p, h)) for p, h in zip(procs, handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return outcomes


def close_all(procs):
    for p in procs:
        p.close(finished=False)


def wait_for(predicate, timeout=10):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


# --------------------------------------------------------------- security
def test_binds_loopback_by_default(controller):
    assert controller.address.startswith("127.0.0.1:")


def test_wrong_token_is_refused_and_logged(controller, caplog):
    """A client with another secret finds the server cannot prove its own
    and sends nothing; a proof made with another secret is refused, logged."""
    from attackers import forged

    with pytest.raises(ProtocolError, match="did not prove it knows the job secret"):
        connect(controller, 0, token="f" * 64)
    with pytest.raises(ProtocolError, match="did not prove it knows the job secret"):
        ControllerClient(controller.address, "nope").status()
    channel = grpc.insecure_channel(controller.address)
    with caplog.at_level(logging.WARNING, logger="trainguard.controller"):
        with pytest.raises(grpc.RpcError) as e:
            path = f"/{SERVICE}/GetStatus"
            channel.unary_unary(path)(b"", metadata=forged(channel, controller.address, "f" * 64, path), timeout=10)
    channel.close()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "missing or wrong job token" in e.value.details()
    assert controller.snapshot()["ranks"] == {}
    assert "refused UNAUTHENTICATED from ipv4:127.0.0.1" in caplog.text


def _raw_session(c: Controller, payloads: list[bytes], token: str | None = None):
    channel = grpc.insecure_channel(c.address)
    call = channel.stream_stream(f"/{SERVICE}/Session", request_serializer=lambda b: b,
                                 response_deserializer=pb.ControllerMessage.FromString)
    try:
        path = f"/{SERVICE}/Session"
        return list(call(iter(payloads), metadata=login(channel, token or c.token, c.address, path), timeout=10))
    finally:
        channel.close()


@pytest.mark.parametrize("payload, code, text", [
    (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed RankMessage"),
    (b"", grpc.StatusCode.INVALID_ARGUMENT, "empty RankMessage"),
    (pb.RankMessage(heartbeat=pb.Status(step=1, run=2, data=1)).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT, "first message of a session must be Hello"),
    (pb.RankMessage(hello=pb.Hello(rank=7, world_size=3, pid=1, status=pb.Status(run=1, data=1)))
     .SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "rank 7 is outside a world of 3"),
    (pb.RankMessage(hello=pb.Hello(rank=0, world_size=3, pid=1, status=pb.Status(run=99, data=1)))
     .SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "run status has an unknown value 99"),
    (b"\x0a" + b"\xff" * 5 + b"x" * (2 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the 1048576-byte limit"),
])
def test_malformed_and_oversized_messages_are_refused(controller, caplog, payload, code, text):
    with caplog.at_level(logging.WARNING, logger="trainguard.rpc"):
        with pytest.raises(grpc.RpcError) as err:
            _raw_session(controller, [payload])
    assert err.value.code() == code
    assert text in err.value.details()
    assert text in caplog.text
    assert controller.snapshot()["ranks"] == {}


def test_a_rank_cannot_register_twice(controller):
    first = connect(controller, 0)
    try:
        with pytest.raises(ProtocolError, match="rank 0 is already registered by pid"):
            connect(controller, 0)
    finally:
        first.close()


# --------------------------------------------------------------- episodes
def test_retry_episode_end_to_end(controller, caplog):
    procs = [connect(controller, r) for r in range(3)]
    wait_for(lambda: controller.state is ControllerState.NORMAL)
    train_to(procs, 4)
    handlers = [Recording(r) for r in range(3)]
    outcomes = run_ranks(procs, handlers, {1: RuntimeError("UCE ERROR: bad HBM page")})
    assert all(o.resume and o.step == 4 for o in outcomes.values())
    assert handlers[1].calls == [("clean", True), ("rebuild", 1), ("repair", 4, [(2, 1)]), ("rollback", 4)]
    assert handlers[2].calls == [("clean", False), ("rebuild", 1), ("repair", 4, [(2, 1)]), ("rollback", 4)]
    assert handlers[0].calls == [("clean", False), ("rebuild", 1), ("rollback", 4)]
    record = outcomes[0].record
    assert record["strategy"] == "retry" and record["fault"] == "uce" and record["lost_steps"] == 0
    assert controller.state is ControllerState.NORMAL
    with caplog.at_level(logging.WARNING, logger="trainguard.processor"):
        for p in procs:
            p.close()
    assert "did not end the session" not in caplog.text  # Goodbye ends the session promptly
    wait_for(lambda: controller.state is ControllerState.FINISHED)


def test_lost_process_is_dumped_by_one_saver_and_one_finaliser(controller):
    procs = [connect(controller, r) for r in range(3)]
    train_to(procs, 6)
    procs[2].close(finished=False)  # the session breaks without Goodbye: process lost
    handlers = [Recording(r) for r in range(2)]
    outcomes = run_ranks(procs[:2], handlers, {})
    assert all(not o.resume and o.exit_code == EXIT_AFTER_DUMP for o in outcomes.values())
    assert handlers[0].calls[0] == ("save", 6, 0)
    finalize = handlers[0].calls[1]
    assert finalize[:3] == ("finalize", 6, [(0, ["shard_k0_r0.pt"])])
    assert finalize[3]["records"][0]["strategy"] == "dump"
    assert handlers[1].calls == []
    assert controller.state is ControllerState.EXITED
    close_all(procs[:2])


def test_second_fault_during_retry_falls_back_to_dump(controller):
    procs = [connect(controller, r) for r in range(3)]
    train_to(procs, 5)
    handlers = [Recording(0), Recording(1), Recording(2, fail="rebuild")]
    outcomes = run_ranks(procs, handlers, {1: RuntimeError("UCE ERROR")})
    assert all(o.exit_code == EXIT_AFTER_DUMP for o in outcomes.values())
    assert ("save", 5, 0) in handlers[0].calls
    snap = controller.snapshot()
    assert "rebuild failed on rank 2: RuntimeError: rebuild broke on rank 2" in snap["recoveries"][-1]["reason"]
    close_all(procs)


def test_fault_at_step_zero_exits(controller):
    procs = [connect(controller, r) for r in range(3)]
    outcomes = run_ranks(procs, [Recording(r) for r in range(3)], {0: RuntimeError("UCE ERROR")})
    assert {o.exit_code for o in outcomes.values()} == {76}
    assert "the fault came at step 0" in outcomes[1].reason
    close_all(procs)


def test_silent_rank_is_declared_hung_and_the_rest_dump(controller):
    procs = [connect(controller, r) for r in range(3)]
    train_to(procs, 3)
    # Rank 2, with a step time learned, stops heartbeating (as a SIGSTOPped
    # process would): simulate by cancelling its call without the controller
    # seeing a clean end.
    procs[2]._outbox.put(pb.RankMessage(heartbeat=pb.Status(step=3, run=2, data=1, step_time_s=0.01)))
    procs[2]._heartbeat_s = 3600
    outcomes = {}

    def rank(p, h):
        assert p.stop_event.wait(10)
        outcomes[p.rank] = recover(p, h)

    handlers = [Recording(0), Recording(1)]
    threads = [threading.Thread(target=rank, args=(p, h)) for p, h in zip(procs[:2], handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert outcomes[0].exit_code == EXIT_AFTER_DUMP
    assert "rank 2: hang: no heartbeat" in outcomes[0].reason
    close_all(procs)


def test_status_is_served_to_authenticated_clients(controller):
    p = connect(controller, 0)
    client = ControllerClient(controller.address, controller.token)
    try:
        status = client.status()
        assert status["state"] == "INIT" and status["ranks"]["0"]["pid"] > 0
    finally:
        client.close()
        p.close()


# --------------------------------------------------------------- node relays
@pytest.fixture
def relay(controller):
    from trainguard.core.relay import Relay

    r = Relay(controller.address, controller.token, batch_window_s=0.005, heartbeat_window_s=0.05)
    r.start()
    yield r
    r.stop()


def connect_via(relay, controller, rank, world=3, token=None):
    p = Processor(ProcessorConfig(controller=relay.address, token=token or controller.token, rank=rank,
                                  world_size=world, connect_timeout_s=5), force_exit=lambda code: None)
    p.connect(replicas=[ReplicaGroup.full(range(world))])
    return p


def test_retry_through_a_node_relay(controller, relay):
    procs = [connect_via(relay, controller, r) for r in range(3)]
    wait_for(lambda: controller.state is ControllerState.NORMAL)
    train_to(procs, 3)
    handlers = [Recording(r) for r in range(3)]
    outcomes = run_ranks(procs, handlers, {2: RuntimeError("UCE ERROR")})
    assert all(o.resume and o.step == 3 for o in outcomes.values())
    assert handlers[2].calls[2] == ("repair", 3, [(0, 2)])
    for p in procs:
        p.close()
    wait_for(lambda: controller.state is ControllerState.FINISHED)


def test_a_rank_lost_behind_a_relay_is_detected_and_dumped(controller, relay):
    procs = [connect_via(relay, controller, r) for r in range(3)]
    train_to(procs, 4)
    procs[1].close(finished=False)  # its local session ends without Goodbye
    handlers = [Recording(0), Recording(2)]
    outcomes = run_ranks([procs[0], procs[2]], handlers, {})
    assert {o.exit_code for o in outcomes.values()} == {EXIT_AFTER_DUMP}
    assert "rank 1: process lost" in outcomes[0].reason
    close_all([procs[0], procs[2]])


def test_refusals_and_authentication_pass_through_the_relay(controller, relay):
    with pytest.raises(ProtocolError, match="world size 5, the job has 3"):
        connect_via(relay, controller, 0, world=5)
    with pytest.raises(ProtocolError, match="did not prove it knows the job secret"):  # nor proves its own
        connect_via(relay, controller, 0, token="0" * 64)


def test_ranks_learn_when_their_relay_dies(controller, relay):
    procs = [connect_via(relay, controller, r) for r in range(3)]
    relay.stop()
    from trainguard.core import ControllerLostError

    with pytest.raises(ControllerLostError):
        procs[0].next_command(timeout=10)
    wait_for(lambda: controller.state is ControllerState.EXITED or controller.snapshot()["episode"])
    close_all(procs)


def test_a_node_gets_one_message_per_phase(controller):
    """On the relay protocol itself: three ranks in one stream, one STOP delivery for two of them."""
    import queue as q

    channel = grpc.insecure_channel(controller.address)
    call = channel.stream_stream(f"/{SERVICE}/NodeSession", request_serializer=pb.NodeMessage.SerializeToString,
                                 response_deserializer=pb.NodeCommands.FromString)
    outbox: q.Queue = q.Queue()

    def requests():
        while (m := outbox.get()) is not None:
            yield m

    status = pb.Status(step=2, run=pb.TRAINING, data=pb.UPDATED)
    hellos = [pb.RankEnvelope(rank=r, message=pb.RankMessage(hello=pb.Hello(
        rank=r, world_size=3, pid=10 + r, status=status, device_repairable=True,
        replicas=[pb.ReplicaGroup(range_start=0, range_step=1, range_count=3, replica_cnt=3)]))) for r in range(3)]
    outbox.put(pb.NodeMessage(node="n0", items=hellos))
    replies = call(requests(), metadata=login(channel, controller.token, controller.address, f"/{SERVICE}/NodeSession"),
                   timeout=20)
    welcome = next(replies)
    assert sorted(welcome.items[0].ranks) == [0, 1, 2] and welcome.items[0].message.HasField("welcome")
    outbox.put(pb.NodeMessage(node="n0", items=[pb.RankEnvelope(rank=1, message=pb.RankMessage(
        fault=pb.FaultReport(kind=pb.UCE, severity=pb.HIGH, message="UCE ERROR",
                             status=pb.Status(step=2, run=pb.STOPPED, data=pb.UPDATED))))]))
    stops = next(replies)
    assert len(stops.items) == 1 and sorted(stops.items[0].ranks) == [0, 2]
    assert stops.items[0].message.command.HasField("stop")
    outbox.put(None)
    channel.close()


def test_a_rank_that_starts_before_its_controller_connects_when_it_comes_up():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "ab" * 32
    late = Controller(ControllerConfig(port=port, **FAST), 1, token=token)
    timer = threading.Timer(1.0, late.start)
    timer.start()
    p = Processor(ProcessorConfig(controller=f"127.0.0.1:{port}", token=token, rank=0, world_size=1,
                                  connect_timeout_s=20), force_exit=lambda code: None)
    try:
        p.connect()  # refused (UNAVAILABLE) at first, retried
        assert p.connected
        assert p.next_command(timeout=0.3) is None  # no stale "lost" left by the refused attempts
    finally:
        timer.join()
        p.close()
        late.stop()
