"""The peer node's side of :mod:`.peer`: :class:`PeerServer` keeps the
newest copy of each rank's snapshot that a peer pushed, and serves it back
(the protocol is :mod:`.peer`'s)."""

from __future__ import annotations

import hmac
import json
import logging
import os
import shutil
import socket
import socketserver
import struct
import threading
import time
from typing import Any

from ..api import CheckpointError
from ..proof import Admission, Names, client_proof, derive, nonce, server_proof
from .own_peer import OPS as OWN_OPS
from .own_peer import serve_own
from .peer import HANDSHAKE_S, MAGIC, MAX_CONNECTIONS, MAX_HEADER, MAX_LINE, MAX_UNPROVEN, VERSION, _recv_exact, _store
from .shm import SnapshotDir

__all__ = ["PeerServer"]

log = logging.getLogger("trainguard.snapshot")


class _Refused(CheckpointError):
    """A request the server refuses; ``kind`` groups like refusals in the log."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _recv_line(sock: socket.socket, deadline: float) -> dict[str, Any]:
    """The client's greeting: one JSON object line of at most :data:`MAX_LINE` bytes, by ``deadline``."""
    buf = bytearray()
    while not buf.endswith(b"\n"):
        if len(buf) > MAX_LINE:
            raise _Refused("garbage", f"a greeting longer than {MAX_LINE} bytes")
        buf += _recv_exact(sock, 1, deadline)
    hello = json.loads(buf)
    if not isinstance(hello, dict):
        raise _Refused("garbage", "the greeting is not a JSON object")
    return hello


class _QuietLog:
    """At most one warning per kind of refusal a minute: a peer of another
    version retrying, or someone replaying captured requests in a loop,
    must not fill the agent's log."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when logged, refusals since)
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            when, hidden = self._last.get(kind, (-self.interval_s, 0))
            if now - when < self.interval_s:
                self._last[kind] = (when, hidden + 1)
                return
            self._last[kind] = (now, 0)
        if hidden:
            msg, args = msg + " (and %d more like it since)", (*args, hidden)
        log.warning(msg, *args)


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        owner, sock, host = self.server.owner, self.request, self.client_address[0]
        if not owner._unproven.enter(host):  # before anything is read: no place for one more stranger
            owner._quiet.warning("busy", "refused a peer connection from %s: too many still proving the secret",
                                 host)
            return
        try:
            meta = self._answer(owner, sock, owner._request, greeting=True)
        finally:
            owner._unproven.leave(host)
        if meta is None:
            return
        if not owner._slots.acquire(blocking=False):
            owner._quiet.warning("busy", "refused a peer request from %s: %d already served", host, MAX_CONNECTIONS)
            self._reply(sock, {"ok": False, "error": f"busy: {MAX_CONNECTIONS} requests already served"})
            return
        try:
            if self._answer(owner, sock, lambda s: owner.receive(s, meta)) is not None:
                self._reply(sock, {"ok": True})
        finally:
            owner._slots.release()

    def _answer(self, owner: "PeerServer", sock: socket.socket, step, greeting: bool = False):
        """``step(sock)``'s result (``True`` when it returns nothing); ``None`` when it answered or was refused
        (``greeting``: in place of the server's greeting, which names its version)."""
        try:
            return step(sock) or True
        except _Answered:
            return None
        except (CheckpointError, ConnectionError, OSError, ValueError, KeyError, TypeError) as e:
            owner.refused += 1
            kind = e.kind if isinstance(e, _Refused) else type(e).__name__
            owner._quiet.warning(kind, "refused a peer request from %s: %s", self.client_address[0], e)
            self._reply(sock, {"ok": False, "error": str(e), **({"version": VERSION} if greeting else {})})
            return None

    @staticmethod
    def _reply(sock: socket.socket, reply: dict) -> None:
        try:
            sock.sendall((json.dumps(reply) + "\n").encode())
        except OSError:
            pass


class _Answered(Exception):
    """A fetch was answered with the copy itself."""


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 let a burst of strangers' connections delay real peers' by seconds
    owner: "PeerServer"


class PeerServer:
    """Keeps peers' snapshots in ``directory``'s ``peer/`` folder.

    Args:
        directory: this node's snapshot directory (the agent owns it).
        token: the job secret peers must prove.
        host: address to bind (loopback by default).
    """

    def __init__(self, directory: SnapshotDir, token: str, host: str = "127.0.0.1") -> None:
        self.directory = directory
        self.token = token
        self._server = _Server((host, 0), _Handler)
        self._server.owner = self
        self.names = Names(host, self._server.server_address[1])  # the addresses a client may have dialed
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._unproven = Admission(per_host=2, total=MAX_UNPROVEN)
        self._quiet = _QuietLog()
        self.received = 0  # copies stored
        self.refused = 0  # requests refused (any reason)

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> str:
        self._thread = threading.Thread(target=self._server.serve_forever, name="trainguard-peer", daemon=True)
        self._thread.start()
        return self.address

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _send(self, sock: socket.socket, rank: int) -> None:
        slot = self.directory.peer_copy(rank)
        try:
            if not slot.lock(False, block=True):
                sock.sendall(b'{"ok": false, "none": true}\n')
                return
            info = slot.verified()
            size = slot.path.stat().st_size
            sock.sendall((json.dumps({"ok": True, "step": info.step, "bytes": size}) + "\n").encode())
            with os.fdopen(os.open(slot.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                sock.sendfile(f, 0, size)
            log.info("sent rank %d's copy of step %d back", rank, info.step)
        finally:
            slot.close()

    def _request(self, sock: socket.socket) -> dict[str, Any]:
        """Prove the secret for the address the client dialed, with a fresh
        challenge, and read the request bound to both: authenticated, for
        this connection, well formed."""
        deadline = time.monotonic() + HANDSHAKE_S
        magic = _recv_exact(sock, len(MAGIC), deadline)
        if magic != MAGIC:
            if magic.startswith(MAGIC[:-2]):
                raise _Refused("version", f"peer speaks snapshot protocol {magic.decode(errors='replace')}, this "
                                          f"node {MAGIC.decode()} (different trainguard versions?)")
            raise _Refused("garbage", "not a trainguard snapshot stream")
        hello = _recv_line(sock, deadline)
        cn, dialed = bytes.fromhex(str(hello.get("nonce"))), hello.get("dialed")
        if not 16 <= len(cn) <= 64 or not isinstance(dialed, str):
            raise _Refused("garbage", "a greeting without a nonce and the address dialed")
        why = self.names.problem(dialed)
        if why is not None:  # a client steered elsewhere, whose request would be relayed here
            raise _Refused("address", f"dialed {why}")
        key, sn = derive(self.token, "peer"), nonce()
        sock.sendall((json.dumps({"version": VERSION, "challenge": sn.hex(),
                                  "proof": server_proof(key, cn, sn, dialed).hex()}) + "\n").encode())
        (n,) = struct.unpack("<I", _recv_exact(sock, 4, deadline))
        if n > MAX_HEADER:
            raise _Refused("garbage", f"header of {n} bytes is too large")
        header = _recv_exact(sock, n, deadline)
        if not hmac.compare_digest(_recv_exact(sock, 32, deadline), client_proof(key, sn, cn, dialed, MAGIC + header)):
            raise _Refused("proof", "snapshot request refused: its proof is not for this connection (a wrong job "
                                    "token, or replayed)")
        meta = json.loads(header)
        if not isinstance(meta, dict):
            raise _Refused("garbage", "the request is not a JSON object")
        return meta

    def receive(self, sock: socket.socket, meta: dict[str, Any]) -> None:
        sock.settimeout(60)  # authenticated: the payload may be large
        if meta.get("op") in OWN_OPS:  # a rank's own-part record file (own_peer.py)
            if serve_own(self.directory.path, sock, meta):
                raise _Answered()
            return
        rank = int(meta["rank"])
        if meta.get("op") == "fetch":
            self._send(sock, rank)
            raise _Answered()
        size, step = int(meta["bytes"]), int(meta["step"])
        free = shutil.disk_usage(self.directory.path).free
        if not 0 < size < free:
            raise CheckpointError(f"a snapshot of {size} bytes does not fit ({free} bytes free)")
        sock.sendall(b'{"go": true}\n')
        slot = _store(self.directory, rank, step, size, lambda n: sock.recv(n))
        got = slot.info()
        slot.close()
        self.received += 1
        log.debug("holding rank %d's snapshot of step %d for its node", rank, got.step)
