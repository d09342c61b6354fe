"""What the security tests play: a client that skips the server's proof and
signs with whatever secret it holds, a server that does not know the job
secret (an address planted in the rendezvous store), and a second local
user (a uid no account has: root switches to it for one command)."""

from __future__ import annotations

import pwd
import subprocess
import threading
from concurrent import futures

import grpc

from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.rpc import SERVICE


def forged(channel: grpc.Channel, dialed: str, secret: str, path: str) -> tuple:
    """Metadata for one call of ``path``, proved with ``secret`` without
    checking the server's proof (what a client holding a wrong or stolen
    secret sends)."""
    from trainguard.core.proof import client_proof, derive, nonce

    cn = nonce()
    answer = channel.unary_unary(f"/{SERVICE}/Handshake", request_serializer=pb.Challenge.SerializeToString,
                                 response_deserializer=pb.ChallengeAnswer.FromString)(
        pb.Challenge(nonce=cn, dialed=dialed), timeout=10)
    sn = bytes(answer.nonce)
    return (("authorization", f"TG-HMAC {sn.hex()} {client_proof(derive(secret, 'control'), sn, cn, dialed, path.encode()).hex()}"),)


class Impostor:
    """A gRPC server on 127.0.0.1 that plays the controller without its
    secret. It records every call's metadata and body and, with
    ``relay_to``, forwards each handshake to that (real) server and hands
    the answer back, as a live man in the middle would."""

    def __init__(self, relay_to: str | None = None, *, rewrite: bool = False) -> None:
        self.seen: list[tuple[str, tuple, bytes]] = []
        self.relay_to, self.rewrite = relay_to, rewrite
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Handshake": grpc.unary_unary_rpc_method_handler(self._handshake),
            "GetStatus": grpc.unary_unary_rpc_method_handler(self._unary("GetStatus")),
            "ReportProcessExit": grpc.unary_unary_rpc_method_handler(self._unary("ReportProcessExit")),
            "Session": grpc.stream_stream_rpc_method_handler(self._stream("Session")),
            "NodeSession": grpc.stream_stream_rpc_method_handler(self._stream("NodeSession")),
        })
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def _record(self, method: str, context, body: bytes) -> None:
        with self._lock:
            self.seen.append((method, tuple(context.invocation_metadata()), body))

    def _handshake(self, body: bytes, context) -> bytes:
        self._record("Handshake", context, body)
        if self.relay_to is None:
            from trainguard.core.proof import nonce

            return pb.ChallengeAnswer(nonce=nonce(), proof=bytes(32)).SerializeToString()
        if self.rewrite:  # as if the client had dialed the real server
            body = pb.Challenge(nonce=pb.Challenge.FromString(body).nonce, dialed=self.relay_to).SerializeToString()
        with grpc.insecure_channel(self.relay_to) as channel:
            try:
                return channel.unary_unary(f"/{SERVICE}/Handshake")(body, timeout=10)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

    def _unary(self, method: str):
        def handle(body: bytes, context) -> bytes:
            self._record(method, context, body)
            context.abort(grpc.StatusCode.UNAVAILABLE, "impostor")
        return handle

    def _stream(self, method: str):
        def handle(requests, context):
            self._record(method, context, b"")
            for body in requests:
                self._record(method, context, body)
                break
            context.abort(grpc.StatusCode.UNAVAILABLE, "impostor")
            yield b""
        return handle

    def proofs(self) -> list[str]:
        """Every ``authorization`` value sent to it (a call that was opened with a proof)."""
        return [v for _, md, _ in self.seen for k, v in md if k == "authorization"]

    def __enter__(self) -> "Impostor":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(0)


def free_uid() -> int:
    """A uid no account has."""
    def taken(uid: int) -> bool:
        try:
            pwd.getpwuid(uid)
            return True
        except KeyError:
            return False
    return next(u for u in range(61_000, 65_000) if not taken(u))


def as_user(uid: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a shell command as ``uid`` (no group but its own); needs root."""
    return subprocess.run(["/bin/sh", "-c", command], user=uid, group=uid, extra_groups=[], cwd="/",
                          env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=timeout)
