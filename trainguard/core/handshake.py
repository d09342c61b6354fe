"""The control plane's mutual proof of the job secret (:mod:`.proof`) over gRPC.

Server side (the controller and a node's relay): :class:`ServerAuth`
answers the ``Handshake`` call, the one call served without a proof, and
:class:`Authenticate` (an interceptor) lets any other call through only
with a proof made for it -- before a byte of its body is read; a refused
stream is never read at all.

Client side: :func:`login` (and :func:`alogin` on an asyncio channel) makes
the handshake, checks that the server proved the secret, and returns the
call's metadata; it raises :class:`Impostor`, having sent nothing that
could open a server, when the server could not prove it.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import grpc

from .api import ProtocolError
from .proof import NONCE_BYTES, Names, Nonces, client_proof, derive, nonce, server_proof
from .protocol import trainguard_pb2 as pb
from .rpc import SERVICE, Refusals, Refused, decoder

__all__ = ["HANDSHAKE", "Authenticate", "Impostor", "ServerAuth", "alogin", "login", "method_path"]

HANDSHAKE = f"/{SERVICE}/Handshake"
_AUTH_KEY = "authorization"
_SCHEME = "TG-HMAC"
_LIMIT = 1024  # a Challenge: a nonce and an address
NO_PROOF = "missing or wrong job token (no proof of the job secret made for this call)"


class Impostor(ProtocolError):
    """The server reached could not prove it knows the job secret: nothing was sent to it."""


def method_path(method: str) -> str:
    return f"/{SERVICE}/{method}"


def _ignore(data: bytes) -> None:  # the body of a refused call is never decoded
    return None


class ServerAuth:
    """A server's side of the handshake.

    Args:
        secret: the job secret.
        names: the addresses this server answers to; ``None`` under mutual
            TLS (the certificates prove the server, whatever name was dialed).
        refusals: the server's refusal log.
        cap: handshakes answered and not yet used that are remembered.
    """

    def __init__(self, secret: str, names: Names | None, refusals: Refusals, *, cap: int = 4096) -> None:
        self.key, self.names, self.refusals = derive(secret, "control"), names, refusals
        self.nonces = Nonces(cap=cap)

    async def handshake(self, request, context) -> pb.ChallengeAnswer:
        if isinstance(request, Refused):
            await self._refuse(context, request.code, f"Handshake: {request.reason}")
        if not NONCE_BYTES <= len(request.nonce) <= 64:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "Handshake: a nonce of 16 to 64 bytes")
        if self.names is not None:
            why = self.names.problem(request.dialed) if self.names.cached(request.dialed) else \
                await asyncio.get_running_loop().run_in_executor(None, self.names.problem, request.dialed)
            if why is not None:  # a client steered to another address, whose proof would be relayed here
                await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, f"Handshake: dialed {why}")
        sn = self.nonces.issue(bytes(request.nonce), request.dialed)
        return pb.ChallengeAnswer(nonce=sn, proof=server_proof(self.key, bytes(request.nonce), sn, request.dialed))

    def check(self, metadata: Any, method: str) -> bool:
        """Whether ``metadata`` carries a proof made for this call of ``method`` (its nonce is used up)."""
        for key, value in metadata or ():
            if key != _AUTH_KEY or not isinstance(value, str):
                continue
            scheme, _, rest = value.partition(" ")
            sn_hex, _, mac_hex = rest.partition(" ")
            if scheme != _SCHEME or len(sn_hex) > 128 or len(mac_hex) != 64:
                return False
            try:
                sn, mac = bytes.fromhex(sn_hex), bytes.fromhex(mac_hex)
            except ValueError:
                return False
            issued = self.nonces.take(sn)
            if issued is None:  # never issued, used already (a replay), or expired
                return False
            cn, dialed = issued
            return hmac.compare_digest(mac, client_proof(self.key, sn, cn, dialed, method.encode()))
        return False

    async def _refuse(self, context, code: grpc.StatusCode, reason: str) -> None:
        self.refusals(context.peer(), code, reason)
        await context.abort(code, f"trainguard: {reason}")

    def handler(self) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(self.handshake, request_deserializer=decoder(pb.Challenge, _LIMIT),
                                                   response_serializer=pb.ChallengeAnswer.SerializeToString)


class Authenticate(grpc.aio.ServerInterceptor):
    """Refuse a call without a proof made for it before its request is
    read: the refusal is served as a streaming handler that never asks for
    a message (a unary call's body is one message on the same wire), so no
    refused body is received into Python, let alone parsed."""

    def __init__(self, auth: ServerAuth, streams: frozenset[str]) -> None:
        self.auth, self.streams = auth, streams

    async def intercept_service(self, continuation, details):
        if details.method == HANDSHAKE or self.auth.check(details.invocation_metadata, details.method):
            return await continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        refusals = self.auth.refusals

        async def refuse(_requests, context):
            refusals(context.peer(), grpc.StatusCode.UNAUTHENTICATED, f"{method}: {NO_PROOF}")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"trainguard: {NO_PROOF}")

        if method in self.streams:
            return grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=_ignore)
        return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=_ignore)


def _metadata(key: bytes, cn: bytes, dialed: str, method: str, answer: pb.ChallengeAnswer) -> tuple:
    sn = bytes(answer.nonce)
    if not NONCE_BYTES <= len(sn) <= 64 or not hmac.compare_digest(bytes(answer.proof),
                                                                    server_proof(key, cn, sn, dialed)):
        raise Impostor(f"the server at {dialed} did not prove it knows the job secret: it is not this job's "
                       "(nothing was sent to it)")
    return ((_AUTH_KEY, f"{_SCHEME} {sn.hex()} {client_proof(key, sn, cn, dialed, method.encode()).hex()}"),)


def login(channel: grpc.Channel, secret: str, dialed: str, method: str, *, timeout_s: float = 10.0) -> tuple:
    """The metadata of one call of ``method`` (its path) to the server at
    ``dialed`` (the address ``channel`` was made for).

    Raises:
        Impostor: the server did not prove the secret.
        grpc.RpcError: the handshake failed (unreachable, refused).
    """
    cn = nonce()
    call = channel.unary_unary(HANDSHAKE, request_serializer=pb.Challenge.SerializeToString,
                               response_deserializer=pb.ChallengeAnswer.FromString)
    answer = call(pb.Challenge(nonce=cn, dialed=dialed), timeout=timeout_s)
    return _metadata(derive(secret, "control"), cn, dialed, method, answer)


async def alogin(channel: grpc.aio.Channel, secret: str, dialed: str, method: str, *, timeout_s: float = 10.0) -> tuple:
    """:func:`login` on an asyncio channel."""
    cn = nonce()
    call = channel.unary_unary(HANDSHAKE, request_serializer=pb.Challenge.SerializeToString,
                               response_deserializer=pb.ChallengeAnswer.FromString)
    answer = await call(pb.Challenge(nonce=cn, dialed=dialed), timeout=timeout_s)
    return _metadata(derive(secret, "control"), cn, dialed, method, answer)
