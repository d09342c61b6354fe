"""A second copy of each snapshot in a peer node's memory.

Every node agent runs a :class:`PeerServer`; a persist worker that sealed
a snapshot pushes the whole slot file to the next node's server
(:func:`push`), which keeps the newest copy per rank as ``peer/r{rank}`` in
its own snapshot directory. A process restarted on that node finds the copy
there (:meth:`SnapshotDir.candidates`); one restarted on a new node that
replaced a lost one has no snapshot of its own and fetches its copy back
from the node it pushed to (:func:`fetch`).

The stream is plain TCP, protocol 2:

1. the client sends ``TGPEER02``;
2. the server answers one JSON line ``{"version": 2, "challenge": <hex>}``
   with a fresh random challenge (or, for another magic, why not, so a
   peer of another trainguard version gets a clear error and no hang);
3. the client sends a length-prefixed JSON header (``put``: rank, step,
   size; ``fetch``: rank) that repeats the challenge, then an HMAC-SHA256
   of the header under the job token.

The challenge makes each header good for one connection only: a captured
put or fetch replayed later carries a valid MAC but an old challenge and
is refused (no clock trust, no cache of seen nonces). For a put the server
answers ``go`` (or why not) and only then reads the slot's bytes, then
answers once more; for a fetch it answers one JSON line followed by the
copy's bytes. A header that is malformed, too large, unauthenticated or
replayed is refused before any payload is read or sent; every read is
bounded in size and time. The payload is checked against the slot's own
checksum before the copy replaces the previous one (bulk data is not
HMACed: that would cost a SHA-256 pass over every snapshot).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import socket
import socketserver
import struct
import threading
import time
from typing import Any, BinaryIO

from ..api import CheckpointError
from .own_peer import OPS as OWN_OPS
from .own_peer import serve_own
from .segment import Slot
from .shm import SnapshotDir

__all__ = ["PeerServer", "fetch", "push"]

log = logging.getLogger("trainguard.snapshot")

VERSION = 2
MAGIC = b"TGPEER%02d" % VERSION
MAX_HEADER = 64 << 10
MAX_LINE = 4 << 10  # greetings and answers are short JSON lines
HANDSHAKE_S = 10.0  # for a client to send its request (before it is authenticated)
MAX_CONNECTIONS = 32  # served at once; more are closed unanswered
_CHUNK = 8 << 20


class _Refused(CheckpointError):
    """A request the server refuses; ``kind`` groups like refusals in the log."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _mac(token: str, header: bytes) -> bytes:
    return hmac.new(token.encode(), MAGIC + header, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; by ``deadline`` (monotonic) when given, so a client
    trickling bytes cannot hold a connection past it."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request not complete within {HANDSHAKE_S:g} s")
            sock.settimeout(left)
        try:
            got = sock.recv(min(n - len(buf), _CHUNK))
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"request not complete within {HANDSHAKE_S:g} s") from None
        if not got:
            raise ConnectionError("peer closed the stream")
        buf += got
    return bytes(buf)


def _line(stream: BinaryIO) -> dict[str, Any]:
    """One JSON object line of at most :data:`MAX_LINE` bytes."""
    raw = stream.readline(MAX_LINE + 1)
    if not raw:
        raise ConnectionError("peer closed the stream without answering")
    if not raw.endswith(b"\n"):
        raise ValueError("peer's answer is not a line of at most %d bytes" % MAX_LINE)
    answer = json.loads(raw)
    if not isinstance(answer, dict):
        raise ValueError(f"peer's answer is not an object: {raw[:80]!r}")
    return answer


def _open(sock: socket.socket, address: str, token: str, request: dict[str, Any]) -> BinaryIO:
    """Send ``request`` bound to the server's challenge; the stream its
    answers come on."""
    sock.sendall(MAGIC)
    stream = sock.makefile("rb")
    hello = _line(stream)
    challenge = hello.get("challenge")
    if hello.get("version") != VERSION or not isinstance(challenge, str):
        said = hello.get("error") or f"version {hello.get('version')}"
        raise CheckpointError(f"peer {address} speaks another snapshot protocol ({said}); this node speaks version "
                              f"{VERSION} (different trainguard versions?)")
    header = json.dumps({**request, "challenge": challenge}).encode()
    sock.sendall(struct.pack("<I", len(header)) + header + _mac(token, header))
    return stream


def push(address: str, slot: Slot, *, rank: int, token: str, timeout_s: float = 60.0) -> None:
    """Send ``slot`` (locked by the caller) to the peer agent at ``address``.

    Raises:
        CheckpointError: the peer refused it or could not be reached.
    """
    info = slot.info()
    if info is None:
        raise CheckpointError(f"{slot.path} holds no snapshot to push")
    size = slot.path.stat().st_size
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            answers = _open(sock, address, token, {"op": "put", "rank": rank, "step": info.step, "bytes": size})
            answer = _line(answers)  # the header is accepted before any payload is sent
            if answer.get("go"):
                with os.fdopen(os.open(slot.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                    sock.sendfile(f, 0, size)
                answer = _line(answers)
    except (OSError, ValueError, CheckpointError) as e:
        raise CheckpointError(f"pushing rank {rank}'s snapshot to peer {address} failed: {e}") from None
    if not answer.get("ok"):
        raise CheckpointError(f"peer {address} refused rank {rank}'s snapshot: {answer.get('error', 'no answer')}")


def fetch(address: str, directory: SnapshotDir, *, rank: int, token: str, timeout_s: float = 60.0) -> Slot | None:
    """Fetch the copy of ``rank``'s snapshot the peer at ``address`` holds
    into ``directory``'s ``peer/`` folder; ``None`` when it holds none.

    Raises:
        CheckpointError: the peer could not be reached or refused.
    """
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            stream = _open(sock, address, token, {"op": "fetch", "rank": rank})
            answer = _line(stream)
            if not answer.get("ok"):
                if answer.get("none"):
                    return None
                raise CheckpointError(f"peer {address} refused: {answer.get('error', 'no answer')}")
            step, size = answer.get("step"), answer.get("bytes")
            free = shutil.disk_usage(directory.path).free
            if not (isinstance(step, int) and isinstance(size, int) and 0 < size < free):
                raise ValueError(f"peer offers a copy of {size!r} bytes at step {step!r} ({free} bytes free here)")
            return _store(directory, rank, step, size, stream.read)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"fetching rank {rank}'s snapshot from peer {address} failed: {e}") from None


def _store(directory: SnapshotDir, rank: int, step: int, size: int, read) -> Slot:
    """Receive a slot file of ``size`` bytes into ``peer/r{rank}``, verify it
    (checksum, step) and only then let it replace the previous copy."""
    final = directory.path / "peer" / f"r{rank}"
    tmp = final.with_name(final.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # never through a link planted at its name
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                       "wb") as out:
            left = size
            while left:
                chunk = read(min(left, _CHUNK))
                if not chunk:
                    raise ConnectionError(f"stream ended {left} bytes short")
                out.write(chunk)
                left -= len(chunk)
        slot = Slot(tmp)
        try:
            got = slot.verified()
        finally:
            slot.close()
        if got.step != step:
            raise CheckpointError(f"header says step {step}, slot holds {got.step}")
        tmp.replace(final)
    finally:
        tmp.unlink(missing_ok=True)
    return Slot(final)


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
        owner = self.server.owner
        if not owner._slots.acquire(blocking=False):
            owner._quiet.warning("busy", "refused a peer connection from %s: %d already open",
                                 self.client_address[0], MAX_CONNECTIONS)
            return
        try:
            self._serve(owner)
        finally:
            owner._slots.release()

    def _serve(self, owner: "PeerServer") -> None:
        sock: socket.socket = self.request
        try:
            owner.receive(sock)
            reply = {"ok": True}
        except _Answered:
            return
        except (CheckpointError, ConnectionError, OSError, ValueError, KeyError, TypeError) as e:
            owner.refused += 1
            kind = e.kind if isinstance(e, _Refused) else type(e).__name__
            owner._quiet.warning(kind, "refused a peer request from %s: %s", self.client_address[0], e)
            reply = {"ok": False, "error": str(e)}
        try:
            sock.sendall((json.dumps(reply) + "\n").encode())
        except OSError:
            pass


class _Answered(Exception):
    """A fetch was answered with the copy itself."""


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
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
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
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
        """Greet with a fresh challenge and read the request bound to it:
        authenticated, for this connection, well formed."""
        deadline = time.monotonic() + HANDSHAKE_S
        magic = _recv_exact(sock, len(MAGIC), deadline)
        if magic != MAGIC:
            if magic.startswith(MAGIC[:-2]):
                raise _Refused("version", f"peer speaks snapshot protocol {magic.decode(errors='replace')}, this "
                                          f"node {MAGIC.decode()} (different trainguard versions?)")
            raise _Refused("garbage", "not a trainguard snapshot stream")
        challenge = secrets.token_hex(16)
        sock.sendall((json.dumps({"version": VERSION, "challenge": challenge}) + "\n").encode())
        (n,) = struct.unpack("<I", _recv_exact(sock, 4, deadline))
        if n > MAX_HEADER:
            raise _Refused("garbage", f"header of {n} bytes is too large")
        header = _recv_exact(sock, n, deadline)
        if not hmac.compare_digest(_recv_exact(sock, 32, deadline), _mac(self.token, header)):
            raise _Refused("token", "unauthenticated snapshot request (wrong job token)")
        meta = json.loads(header)
        if not isinstance(meta, dict) or not hmac.compare_digest(str(meta.get("challenge")), challenge):
            # Signed with the token but for another connection: captured and sent again.
            raise _Refused("replay", "replayed snapshot request refused (signed for another connection's challenge)")
        return meta

    def receive(self, sock: socket.socket) -> None:
        meta = self._request(sock)
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
