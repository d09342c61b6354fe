"""Fuzz every message the controller and a node relay parse.

A real :class:`Controller` and a :class:`Relay` in front of it are driven,
with the job token (so parsing and the controller's handlers are reached),
by random bytes and by random protobuf messages of the right type built
from the field descriptors (out-of-range ranks, huge and negative numbers,
NaNs, empty oneofs, long repeated fields), alone or after a valid Hello.

What must hold, whatever arrives: every call ends within its deadline (the
deadline is a hang guard, not a timing), it ends OK or with a refusal code,
never ``UNKNOWN``/``INTERNAL`` (an exception escaped a handler), nothing
is logged at ERROR (an exception caught by a handler's last-resort guard,
or a relay that lost its controller), and afterwards the controller and
the relay still serve: ``GetStatus`` answers and a rank's Hello gets its
Welcome. The checks are on codes and behaviour, never on message texts.

Few examples by default (seconds); ``-m slow`` runs many more.
"""

from __future__ import annotations

import logging
import math
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from google.protobuf.descriptor import FieldDescriptor as F

from trainguard.core import Controller, ControllerConfig
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.relay import Relay
from trainguard.core.handshake import login
from trainguard.core.rpc import SERVICE

TOKEN = "fuzz-" + "ab" * 16
WORLD = 64
LIMIT = 16 << 10  # a small message limit, so random sizes reach it
RESERVED = (WORLD - 1, WORLD - 2)  # kept out of the fuzz: the closing checks register them
CALL_S = 20.0  # hang guard for one call

# Codes a refusal may carry. UNKNOWN and INTERNAL mean an exception escaped
# a handler; DEADLINE_EXCEEDED a hang; UNAVAILABLE or CANCELLED a server
# (or a relay's controller stream) that went away.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}

QUICK = settings(max_examples=25, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                        HealthCheck.function_scoped_fixture])
LONG = settings(QUICK, max_examples=400)
DEPTHS = [pytest.param(QUICK, id="quick"), pytest.param(LONG, id="long", marks=pytest.mark.slow)]


# --------------------------------------------------------------- strategies
_INTS = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
         F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
         F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
         F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
         F.TYPE_ENUM: (-2**31, 2**31 - 1)}  # proto3 enums are open: unknown values parse

# A range group's ranks are expanded before they are checked against the
# world, so a huge range_count costs memory in proportion (a separate issue,
# reported): the fuzz keeps it to a few thousand.
_OVERRIDES = {("ReplicaGroup", "range_count"): st.integers(-2**31, 4096)}


def _scalar(field) -> st.SearchStrategy:
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        return st.one_of(st.integers(max(lo, -3), WORLD + 3), st.integers(lo, hi))
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_FLOAT:
        return st.floats(width=32)
    if field.type == F.TYPE_DOUBLE:
        return st.floats()
    if field.type == F.TYPE_STRING:
        return st.text(max_size=40)
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=40)
    raise AssertionError(f"no strategy for {field.full_name}")


def _is_repeated(field) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.29; ``label`` before
    return repeated if repeated is not None else field.label == F.LABEL_REPEATED


@st.composite
def messages(draw, descriptor, depth: int = 3):
    """A message of ``descriptor``'s type with random fields: each set or
    not, at most one member of each oneof, repeated fields up to a few."""
    cls = getattr(pb, descriptor.name)
    msg = cls()
    chosen = {o.name: draw(st.sampled_from([None, *o.fields])) for o in descriptor.oneofs}
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and chosen[oneof.name] is not field:
            continue
        if oneof is None and not draw(st.booleans()):
            continue
        nested = field.type == F.TYPE_MESSAGE
        if nested and depth <= 0:
            continue
        values = _OVERRIDES.get((descriptor.name, field.name))
        if values is None:
            values = messages(field.message_type, depth - 1) if nested else _scalar(field)
        if _is_repeated(field):
            items = draw(st.lists(values, max_size=3 if nested else 20))
            target = getattr(msg, field.name)
            for item in items:
                target.add().CopyFrom(item) if nested else target.append(item)
        elif nested:
            getattr(msg, field.name).CopyFrom(draw(values))
        else:
            setattr(msg, field.name, draw(values))
    return msg


def _group_ranks(group: pb.ReplicaGroup) -> set[int]:
    if group.range_count > 0 and group.range_step:
        return {r for r in RESERVED if (r - group.range_start) % group.range_step == 0
                and 0 <= (r - group.range_start) // group.range_step < group.range_count}
    return set(group.rank_list)


def _touches_reserved(msg) -> bool:
    """Whether a message names a rank the closing checks need untouched."""
    if isinstance(msg, pb.RankMessage):
        if msg.WhichOneof("body") != "hello":
            return False
        return msg.hello.rank in RESERVED or any(_group_ranks(g) & set(RESERVED) for g in msg.hello.replicas)
    if isinstance(msg, pb.NodeMessage):
        return (any(e.rank in RESERVED or _touches_reserved(e.message) for e in msg.items)
                or bool(set(msg.agent.ranks) & set(RESERVED)) or any(x.rank in RESERVED for x in msg.exits))
    if isinstance(msg, pb.ProcessExit):
        return msg.rank in RESERVED
    return False


def _known_issue(group: pb.ReplicaGroup) -> bool:
    """Nothing is left out of the random fuzz any more (a range step of 0
    crashed the controller until it was refused)."""
    return False


def _groups_of(msg) -> list[pb.ReplicaGroup]:
    if isinstance(msg, pb.RankMessage):
        return list(msg.hello.replicas) if msg.WhichOneof("body") == "hello" else []
    if isinstance(msg, pb.NodeMessage):
        return [g for e in msg.items for g in _groups_of(e.message)]
    return []


def _usable(msg) -> bool:
    return not _touches_reserved(msg) and not any(_known_issue(g) for g in _groups_of(msg))


def fuzzed(cls) -> st.SearchStrategy:
    return messages(cls.DESCRIPTOR).filter(_usable)


_STATUS = pb.Status(step=3, run=pb.TRAINING, data=pb.UPDATED)
_small = st.integers(-2, WORLD + 2)
_groups = st.builds(pb.ReplicaGroup, rank_list=st.lists(_small, max_size=8), replica_cnt=_small,
                    replica_shift=_small, range_start=_small, range_step=_small,
                    range_count=st.integers(-2, WORLD + 2)).filter(
    lambda g: not _group_ranks(g) & set(RESERVED) and not _known_issue(g))


@st.composite
def hellos(draw) -> pb.RankMessage:
    """A Hello the controller accepts as far as its fields go, with random
    replica groups: what follows it reaches the controller's handlers."""
    rank = draw(st.integers(0, WORLD - 1 - len(RESERVED)))
    return pb.RankMessage(hello=pb.Hello(rank=rank, world_size=WORLD, pid=draw(st.integers(1, 2**40)),
                                         host="fuzz", status=_STATUS, replicas=draw(st.lists(_groups, max_size=2)),
                                         joining=draw(st.booleans())))


# --------------------------------------------------------------- the plane
class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def _module_plane():
    yield from _serve()


@pytest.fixture
def plane(_module_plane):
    """The module's controller and relay, with no ERROR records yet."""
    _module_plane[1].records.clear()
    return _module_plane


@pytest.fixture
def fresh_plane():
    """A controller and relay of the test's own (one it may break)."""
    yield from _serve()


def _serve():
    """A controller, a relay in front of it, raw channels to both, and the
    ERROR records logged meanwhile (trainguard's loggers may not propagate)."""
    errors = _Errors()
    loggers = [logging.getLogger(n) for n in ("trainguard", "grpc", "asyncio")]
    for logger in loggers:
        logger.addHandler(errors)
    controller = Controller(ControllerConfig(heartbeat_interval_s=0.5, max_message_bytes=LIMIT,
                                             strategies="retry,dump,exit"), WORLD, token=TOKEN)
    controller.start()
    relay = Relay(controller.address, TOKEN, max_message_bytes=LIMIT, batch_window_s=0.002, heartbeat_window_s=0.01)
    relay.start()
    channels = {"controller": grpc.insecure_channel(controller.address),
                "relay": grpc.insecure_channel(relay.address)}
    channels["controller"].dialed, channels["relay"].dialed = controller.address, relay.address
    try:
        yield channels, errors
    finally:
        for channel in channels.values():
            channel.close()
        relay.stop()
        controller.stop()
        for logger in loggers:
            logger.removeHandler(errors)


def _proof(channel: grpc.Channel, path: str) -> tuple:
    """The metadata of one call: the job's proof, made after the server proved the secret."""
    return login(channel, TOKEN, channel.dialed, path, timeout_s=CALL_S)


def _call(channel: grpc.Channel, method: str, requests: list[bytes], stream: bool) -> None:
    """One raw call (bytes in, bytes out); fails on a code that is no refusal."""
    path = f"/{SERVICE}/{method}"
    try:
        if stream:
            call = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
            for _ in call(iter(requests), metadata=_proof(channel, path), timeout=CALL_S):
                pass
        else:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            call(requests[0], metadata=_proof(channel, path), timeout=CALL_S)
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, f"{method} ended with {e.code().name}: {e.details()}"


def _no_errors(errors: _Errors) -> None:
    found = [f"{r.name}: {r.getMessage()}" + (f" ({r.exc_info[1]!r})" if r.exc_info else "") for r in errors.records]
    errors.records.clear()
    assert not found, "logged at ERROR:\n" + "\n".join(found)


def _welcomed(channel: grpc.Channel, rank: int) -> None:
    """A well-behaved rank opens a session, gets its Welcome and leaves
    (Goodbye only once welcomed: a relay ends a session at its Goodbye)."""
    welcomed = threading.Event()

    def requests():
        yield pb.RankMessage(hello=pb.Hello(rank=rank, world_size=WORLD, pid=4242, host="check", status=_STATUS))
        welcomed.wait(CALL_S)
        yield pb.RankMessage(goodbye=pb.Goodbye(status=_STATUS))

    call = channel.stream_stream(f"/{SERVICE}/Session", request_serializer=pb.RankMessage.SerializeToString,
                                 response_deserializer=pb.ControllerMessage.FromString)
    replies = call(requests(), metadata=_proof(channel, f"/{SERVICE}/Session"), timeout=CALL_S)
    try:
        first = next(replies)
    except (grpc.RpcError, StopIteration) as e:
        welcomed.set()
        raise AssertionError(f"rank {rank} got no Welcome: {e!r}") from None
    welcomed.set()
    assert first.HasField("welcome")
    for _ in replies:  # the session ends after Goodbye
        pass


def _still_serving(plane) -> None:
    channels, errors = plane
    status = channels["controller"].unary_unary(f"/{SERVICE}/GetStatus",
                                                request_serializer=pb.StatusRequest.SerializeToString,
                                                response_deserializer=pb.JobStatus.FromString)
    assert status(pb.StatusRequest(), metadata=_proof(channels["controller"], f"/{SERVICE}/GetStatus"),
                  timeout=CALL_S).job_id
    _welcomed(channels["controller"], RESERVED[0])
    _welcomed(channels["relay"], RESERVED[1])
    _no_errors(errors)


def _bytes_of(items) -> list[bytes]:
    return [i if isinstance(i, bytes) else i.SerializeToString() for i in items]


# Unary RPCs and the request type each parses.
UNARY = {"ReportProcessExit": pb.ProcessExit, "GetStatus": pb.StatusRequest, "Handshake": pb.Challenge}
# Stream RPCs: (server, method, the request type each message parses as).
STREAMS = [("controller", "Session", pb.RankMessage), ("controller", "NodeSession", pb.NodeMessage),
           ("relay", "Session", pb.RankMessage)]

# Short random bytes, or a pattern repeated to about the size limit (cheap to draw).
_near_limit = st.tuples(st.integers(LIMIT - 8, LIMIT + 8), st.binary(min_size=1, max_size=8)).map(
    lambda t: (t[1] * (t[0] // len(t[1]) + 1))[:t[0]])
_random_bytes = st.binary(max_size=256) | _near_limit


# --------------------------------------------------------------- the tests
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("method", sorted(UNARY))
def test_unary_calls_survive_random_input(plane, method, depth):
    channel = plane[0]["controller"]

    @depth
    @given(st.one_of(_random_bytes, fuzzed(UNARY[method])))
    def run(request):
        _call(channel, method, _bytes_of([request]), stream=False)

    run()
    _still_serving(plane)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("server, method, cls", STREAMS, ids=[f"{s}-{m}" for s, m, _ in STREAMS])
def test_streams_survive_random_bytes(plane, server, method, cls, depth):
    channel = plane[0][server]

    @depth
    @given(st.lists(_random_bytes, min_size=1, max_size=4))
    def run(requests):
        _call(channel, method, requests, stream=True)

    run()
    _still_serving(plane)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("server, method, cls", STREAMS, ids=[f"{s}-{m}" for s, m, _ in STREAMS])
def test_streams_survive_random_messages(plane, server, method, cls, depth):
    """Random messages of the right type, first alone, then (for rank
    sessions) after a Hello good enough to reach the controller's handlers."""
    channel = plane[0][server]
    start = hellos() if cls is pb.RankMessage else st.builds(
        lambda h, node: pb.NodeMessage(node=node, items=[pb.RankEnvelope(rank=h.hello.rank, message=h)]),
        hellos(), st.sampled_from(["n0", "n1", ""]))
    sequences = st.one_of(
        st.lists(fuzzed(cls), min_size=1, max_size=4),
        st.tuples(start, st.lists(fuzzed(cls), max_size=6)).map(lambda t: [t[0], *t[1]]))

    @depth
    @given(sequences)
    def run(requests):
        _call(channel, method, _bytes_of(requests), stream=True)

    run()
    _still_serving(plane)


def test_a_message_at_the_size_limit_does_not_cut_off_its_node(fresh_plane):
    """A rank's message just under the limit: the relay either carries it
    or refuses it itself; it never makes it a batch its controller refuses
    (which would end the node's stream and every rank on it)."""
    plane = fresh_plane
    channel = plane[0]["relay"]
    hello = pb.RankMessage(hello=pb.Hello(rank=3, world_size=WORLD, pid=7, host="big", status=_STATUS))
    fault = pb.RankMessage(fault=pb.FaultReport(kind=pb.UNKNOWN, severity=pb.LOW, status=_STATUS, message="x"))
    fault.fault.message = "x" * (LIMIT - fault.ByteSize() - 8)
    assert fault.ByteSize() <= LIMIT
    _call(channel, "Session", _bytes_of([hello, fault]), stream=True)
    _still_serving(plane)


@pytest.mark.parametrize("group", [
    pytest.param(pb.ReplicaGroup(range_start=0, range_step=0, range_count=4, replica_cnt=4), id="step-0"),
    pytest.param(pb.ReplicaGroup(range_start=0, range_step=1, range_count=2**31 - 1, replica_cnt=4), id="huge-range"),
    pytest.param(pb.ReplicaGroup(range_start=5, range_step=-1, range_count=3, replica_cnt=3), id="falling"),
    pytest.param(pb.ReplicaGroup(rank_list=[0, 0], replica_cnt=2), id="repeated-rank"),
    pytest.param(pb.ReplicaGroup(rank_list=[0, 2**31 - 1], replica_cnt=0), id="no-copies-past-the-world"),
])
def test_odd_replica_groups_are_refused_not_crashed_on(plane, group):
    channels = plane[0]
    hello = pb.RankMessage(hello=pb.Hello(rank=0, world_size=WORLD, pid=9, host="odd", status=_STATUS,
                                          replicas=[group]))
    _call(channels["controller"], "Session", _bytes_of([hello]), stream=True)
    node = pb.NodeMessage(node="odd", items=[pb.RankEnvelope(rank=0, message=hello)])
    _call(channels["controller"], "NodeSession", _bytes_of([node]), stream=True)
    _still_serving(plane)


def test_special_floats_reach_the_controller_harmlessly(plane):
    channel = plane[0]["controller"]
    for value in (math.nan, math.inf, -math.inf, 1e308):
        status = pb.Status(step=3, run=pb.TRAINING, data=pb.UPDATED, step_time_s=value, silence_s=value)
        hello = pb.RankMessage(hello=pb.Hello(rank=1, world_size=WORLD, pid=11, host="nan", status=status))
        fault = pb.RankMessage(fault=pb.FaultReport(kind=pb.COMM, severity=pb.LOW, occurred_at=value, status=status))
        _call(channel, "Session", _bytes_of([hello, pb.RankMessage(heartbeat=status), fault]), stream=True)
        _call(channel, "ReportProcessExit", _bytes_of([pb.ProcessExit(rank=1, pid=11, exit_code=-9,
                                                                        last_running=value)]), stream=False)
    _still_serving(plane)
