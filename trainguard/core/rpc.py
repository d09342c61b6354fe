"""gRPC plumbing shared by the controller and the processors.

* Authentication: every call carries a proof of the job secret made for
  it, never the secret (:mod:`.handshake`); the server checks it before the
  request's bytes are decoded and refuses anything else with
  ``UNAUTHENTICATED``.
* Logging: every refusal is logged with the peer, at most one line per peer
  host and kind of refusal a few seconds (:class:`Refusals`; the next line
  counts the ones left out), so a flood of bad calls cannot flood the log.
* Size: requests larger than the configured limit are refused with
  ``RESOURCE_EXHAUSTED`` (logged) instead of being parsed.
* Shape: bytes that do not parse, or parse into a message with nothing in
  it, are refused with ``INVALID_ARGUMENT`` (logged).

The message classes come from ``protocol/trainguard.proto``.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError

from .api import DataStatus, Fault, FaultKind, ProtocolError, RankStatus, RunStatus, Severity
from .protocol import trainguard_pb2 as pb
from .secret import TLS, new_token

__all__ = [
    "SERVICE",
    "Refusals",
    "Refused",
    "client_channel",
    "decoder",
    "empty_stream",
    "fault_from_pb",
    "from_pb_status",
    "new_token",
    "rank_status",
    "status_to_pb",
    "to_pb_status",
    "validate_rank_message",
]

log = logging.getLogger("trainguard.rpc")

SERVICE = "trainguard.v1.Control"


class Refusals:
    """The refusal log of a server: one line per peer host and kind of
    refusal (its code and its reason, numbers aside) per ``interval_s``; the next line for the same pair says how many
    were left out meanwhile."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0, clock=time.monotonic) -> None:
        self.log, self.what, self.interval_s, self.clock = logger, what, interval_s, clock
        self._seen: dict[tuple[str, str, str], list] = {}  # (host, code, kind) -> [last logged at, left out since]

    def __call__(self, peer: str, code: grpc.StatusCode, reason: str) -> None:
        host = peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer  # ipv4:1.2.3.4:5678 -> ipv4:1.2.3.4
        key, now = (host, code.name, re.sub(r"\d+", "#", reason)[:48]), self.clock()  # the kind, not its numbers
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return
        if len(self._seen) >= 4096:  # many peers: forget the old pairs rather than grow
            self._seen.clear()
        left_out = seen[1] if seen is not None else 0
        self._seen[key] = [now, 0]
        self.log.warning("%s refused %s from %s: %s%s", self.what, code.name, peer, reason,
                         f" (and {left_out} more from {host} since the last such line)" if left_out else "")


def empty_stream(limit: int) -> str:
    """The refusal reason of a stream that ended before its first message:
    gRPC drops a message over its own size limit before any handler sees
    it, and the stream then looks empty."""
    return f"a session that ended before its first message (empty, or over gRPC's {limit}-byte limit)"


@dataclass(frozen=True)
class Refused:
    """What a decoder returns instead of a message it would not accept."""

    code: grpc.StatusCode
    reason: str


def decoder(cls: type, limit: int) -> Callable[[bytes], Any]:
    """A request deserializer that refuses oversized and malformed input
    instead of raising inside gRPC (which would answer with an opaque
    ``INTERNAL`` error and log nothing useful)."""

    def decode(data: bytes) -> Any:
        if len(data) > limit:
            return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{cls.__name__} of {len(data)} bytes exceeds the {limit}-byte limit")
        message = cls()
        try:
            message.ParseFromString(data)
        except DecodeError as e:
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {e}")
        return message

    return decode


def client_channel(address: str, max_message_bytes: int, tls: TLS | None = None) -> grpc.Channel:
    """A channel to the controller (or a relay) with matching size limits;
    with ``tls``, mutual TLS (see :mod:`.secret`)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max(max_message_bytes, 4 << 20)),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if tls is not None:
        return grpc.secure_channel(address, tls.channel(), options=options)
    return grpc.insecure_channel(address, options=options)


# Enum values in the proto equal the core enums' values, so conversion is by value.
def _enum(cls: type, value: int, what: str):
    try:
        return cls(value)
    except ValueError:
        raise ProtocolError(f"{what} has an unknown value {value}") from None


def from_pb_status(status: "pb.Status") -> tuple[int, RunStatus, DataStatus]:
    if status.step < 0:
        raise ProtocolError(f"status step must be >= 0, got {status.step}")
    return status.step, _enum(RunStatus, status.run, "run status"), _enum(DataStatus, status.data, "data status")


def rank_status(status: "pb.Status") -> RankStatus:
    """A rank's status as the controller's core takes it.

    Raises:
        ProtocolError: a negative step, or a status of no known value.
    """
    step, run, data = from_pb_status(status)
    return RankStatus(step=step, run=run, data=data, step_time_s=status.step_time_s, silence_s=status.silence_s)


def fault_from_pb(rank: int, report: "pb.FaultReport") -> Fault:
    """A rank's fault report as the controller's core takes it; the core
    stamps when it detected it.

    Raises:
        ProtocolError: a kind or severity of no known value.
    """
    kind, severity = fault_fields(report)
    return Fault(kind=kind, rank=rank, severity=severity, message=report.message, phase=report.phase,
                 occurred_at=report.occurred_at or None)


def to_pb_status(step: int, run: RunStatus, data: DataStatus) -> "pb.Status":
    return pb.Status(step=step, run=run.value, data=data.value)


def status_to_pb(status: RankStatus) -> "pb.Status":
    """The protobuf ``Status`` of a rank's status (the inverse of :func:`rank_status`)."""
    return pb.Status(step=status.step, run=status.run.value, data=status.data.value,
                     step_time_s=status.step_time_s, silence_s=status.silence_s)


def fault_fields(report: "pb.FaultReport") -> tuple[FaultKind, Severity]:
    kind = _enum(FaultKind, report.kind, "fault kind")
    severity = _enum(Severity, report.severity, "severity") if report.severity else Severity.HIGH
    return kind, severity


def validate_rank_message(msg: "pb.RankMessage", *, world_size: int, first: bool) -> str:
    """Check a rank's message and return which body it carries.

    Raises:
        ProtocolError: an empty message, a first message that is not Hello,
            a second Hello, or fields out of range.
    """
    body = msg.WhichOneof("body")
    if body is None:
        raise ProtocolError("empty RankMessage (no body set)")
    if first != (body == "hello"):
        raise ProtocolError("the first message of a session must be Hello, and only the first"
                            if first else "Hello sent twice on one session")
    if body == "hello":
        h = msg.hello
        if h.world_size != world_size:
            raise ProtocolError(f"rank reports world size {h.world_size}, the job has {world_size}")
        if not 0 <= h.rank < world_size:
            raise ProtocolError(f"rank {h.rank} is outside a world of {world_size}")
        if h.pid <= 0:
            raise ProtocolError(f"pid must be positive, got {h.pid}")
        from_pb_status(h.status)
    elif body in ("heartbeat", "stopped"):
        from_pb_status(getattr(msg, body))
    elif body == "fault":
        fault_fields(msg.fault)
        if msg.fault.kind == pb.FAULT_KIND_UNSPECIFIED:
            raise ProtocolError("fault report without a kind")
        from_pb_status(msg.fault.status)
    elif body == "result":
        if msg.result.command_id == 0:
            raise ProtocolError("command result without a command id")
        from_pb_status(msg.result.status)
    return body
