"""Unary calls to a running controller, for node agents and the CLI, and
:func:`find_controller`: an address read where anyone may write it (the
rendezvous store) taken only once the server there proved the job secret."""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

import grpc

from ..api import ControllerLostError, ProtocolError, TrainguardError
from ..handshake import Impostor, login, method_path
from ..proof import split_address
from ..protocol import trainguard_pb2 as pb
from ..rpc import client_channel
from ..secret import TLS

__all__ = ["ControllerClient", "find_controller"]

log = logging.getLogger("trainguard.client")

_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.RESOURCE_EXHAUSTED)


class ControllerClient:
    """Args: address ``host:port``, the job token, a per-call timeout, the
    TLS settings when the controller serves TLS (see :mod:`.secret`).

    Every call first makes the controller prove the secret (:mod:`..handshake`)."""

    def __init__(self, address: str, token: str, *, timeout_s: float = 10.0, tls: TLS | None = None) -> None:
        self._channel = client_channel(address, 1 << 20, tls)
        self._token = token
        self._timeout = timeout_s
        self._address = address

    def _unary(self, method: str, request, response_cls):
        call = self._channel.unary_unary(method_path(method), request_serializer=type(request).SerializeToString,
                                         response_deserializer=response_cls.FromString)
        try:
            metadata = login(self._channel, self._token, self._address, method_path(method), timeout_s=self._timeout)
            return call(request, metadata=metadata, timeout=self._timeout)
        except grpc.RpcError as e:
            if e.code() in _REFUSED:
                raise ProtocolError(f"controller at {self._address} refused {method}: {e.details()}") from None
            raise ControllerLostError(f"controller at {self._address} unreachable: {e.code().name}") from None

    def prove(self) -> None:
        """Make the server prove the secret, and send nothing else.

        Raises:
            Impostor: it could not; ProtocolError: it refused the address;
            ControllerLostError: unreachable.
        """
        try:
            login(self._channel, self._token, self._address, "", timeout_s=self._timeout)
        except grpc.RpcError as e:
            if e.code() in _REFUSED:
                raise ProtocolError(f"{self._address} refused the handshake: {e.details()}") from None
            raise ControllerLostError(f"controller at {self._address} unreachable: {e.code().name}") from None

    def report_process_exit(self, rank: int, pid: int, code: int, reason: str = "", last_running: float = 0.0) -> None:
        self._unary("ReportProcessExit", pb.ProcessExit(rank=rank, pid=pid, exit_code=code, reason=reason,
                                                        last_running=last_running), pb.Ack)

    def status(self) -> dict:
        return json.loads(self._unary("GetStatus", pb.StatusRequest(), pb.JobStatus).json)

    def close(self) -> None:
        self._channel.close()


def find_controller(hint: Callable[[], str], token: str, *, tls: TLS | None = None, timeout_s: float = 120.0,
                    retry_s: float = 0.5, clock=time.monotonic, sleep=time.sleep) -> str:
    """The controller's address, from ``hint`` (a read of the rendezvous
    store, which anyone who reaches it may overwrite): a value is taken only
    once the server there proved the job secret; another value is logged
    and the hint read again until one proves it (the controller's node
    writes it again while the job runs), so a forged value costs time, never
    the secret.

    Raises:
        TrainguardError: no value proved it within ``timeout_s``.
    """
    deadline, seen = clock() + timeout_s, set()
    while True:
        try:
            address = hint()
        except (OSError, RuntimeError, UnicodeError) as e:  # torch's store raises RuntimeError subclasses
            address, why = "", f"cannot read it ({e})"
        else:
            why = ""
        if address and split_address(address) is None:
            why = "not a host:port address"
        elif address:
            client = ControllerClient(address, token, tls=tls, timeout_s=min(5.0, timeout_s))
            try:
                client.prove()
                return address
            except (Impostor, ProtocolError, ControllerLostError) as e:
                why = str(e)
            finally:
                client.close()
        if address not in seen:
            seen.add(address)
            log.warning("the controller address in the rendezvous store (%r) is not this job's controller: %s; "
                        "reading it again", address[:100], why or "empty")
        if clock() >= deadline:
            raise TrainguardError(f"no address in the rendezvous store led to this job's controller within "
                                  f"{timeout_s:g} s (last: {address[:100]!r}: {why})")
        sleep(retry_s)
