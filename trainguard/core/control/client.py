"""Unary calls to a running controller, for node agents and the CLI."""

from __future__ import annotations

import json

import grpc

from ..api import ControllerLostError, ProtocolError
from ..protocol import trainguard_pb2 as pb
from ..rpc import SERVICE, auth_metadata, client_channel
from ..secret import TLS

__all__ = ["ControllerClient"]


class ControllerClient:
    """Args: address ``host:port``, the job token, a per-call timeout, the
    TLS settings when the controller serves TLS (see :mod:`.secret`)."""

    def __init__(self, address: str, token: str, *, timeout_s: float = 10.0, tls: TLS | None = None) -> None:
        self._channel = client_channel(address, 1 << 20, tls)
        self._metadata = auth_metadata(token)
        self._timeout = timeout_s
        self._address = address

    def _unary(self, method: str, request, response_cls):
        call = self._channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=type(request).SerializeToString,
                                         response_deserializer=response_cls.FromString)
        try:
            return call(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise ProtocolError(f"controller at {self._address} refused {method}: {e.details()}") from None
            raise ControllerLostError(f"controller at {self._address} unreachable: {e.code().name}") from None

    def report_process_exit(self, rank: int, pid: int, code: int, reason: str = "", last_running: float = 0.0) -> None:
        self._unary("ReportProcessExit", pb.ProcessExit(rank=rank, pid=pid, exit_code=code, reason=reason,
                                                        last_running=last_running), pb.Ack)

    def status(self) -> dict:
        return json.loads(self._unary("GetStatus", pb.StatusRequest(), pb.JobStatus).json)

    def close(self) -> None:
        self._channel.close()
