"""gRPC plumbing shared by the controller and the processors.

* Authentication: every call carries ``authorization: Bearer <token>``; the
  server compares it in constant time and refuses anything else with
  ``UNAUTHENTICATED`` and a log line naming the peer.
* Size: requests larger than the configured limit are refused with
  ``RESOURCE_EXHAUSTED`` (logged) instead of being parsed.
* Shape: bytes that do not parse, or parse into a message with nothing in
  it, are refused with ``INVALID_ARGUMENT`` (logged).

The message classes come from ``protocol/trainguard.proto``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError

from .api import DataStatus, FaultKind, ProtocolError, RunStatus, Severity
from .protocol import trainguard_pb2 as pb

__all__ = [
    "SERVICE",
    "Refused",
    "auth_metadata",
    "check_token",
    "client_channel",
    "decoder",
    "from_pb_status",
    "new_token",
    "to_pb_status",
    "validate_rank_message",
]

log = logging.getLogger("trainguard.rpc")

SERVICE = "trainguard.v1.Control"
_AUTH_KEY = "authorization"


def new_token() -> str:
    """A fresh per-job secret (256 bits, hex)."""
    return secrets.token_hex(32)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((_AUTH_KEY, f"Bearer {token}"),)


def check_token(metadata: Any, token: str) -> bool:
    """Whether call metadata carries ``token`` (constant-time compare)."""
    for key, value in metadata or ():
        if key == _AUTH_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return hmac.compare_digest(value[7:].encode(), token.encode())
    return False


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


def client_channel(address: str, max_message_bytes: int) -> grpc.Channel:
    """An insecure channel to the controller with matching size limits."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max(max_message_bytes, 4 << 20)),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
    )


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


def to_pb_status(step: int, run: RunStatus, data: DataStatus) -> "pb.Status":
    return pb.Status(step=step, run=run.value, data=data.value)


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
