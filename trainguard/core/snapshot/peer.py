"""A second copy of each snapshot in a peer node's memory.

Every node agent runs a :class:`PeerServer`; a persist worker that sealed
a snapshot pushes the whole slot file to the next node's server
(:func:`push`), which keeps the newest copy per rank as ``peer/r{rank}`` in
its own snapshot directory. A process restarted on that node finds the copy
there (:meth:`SnapshotDir.candidates`); one restarted on a new node that
replaced a lost one has no snapshot of its own and fetches its copy back
from the node it pushed to (:func:`fetch`).

The stream is plain TCP: ``TGPEER01``, a length-prefixed JSON header
(``put``: rank, step, size; ``fetch``: rank) with an HMAC-SHA256 of it under
the job token. For a put the server answers ``go`` (or why not) and only
then reads the slot's bytes, then answers once more; for a fetch it answers
one JSON line followed by the copy's bytes. A header that is malformed,
too large or unauthenticated is refused before any payload is read; the
payload is checked against the slot's own checksum before the copy replaces the
previous one (bulk data is not HMACed: that would cost a SHA-256 pass over
every snapshot).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import shutil
import socket
import socketserver
import struct
import threading
from typing import Any

from ..api import CheckpointError
from .segment import Slot
from .shm import SnapshotDir

__all__ = ["PeerServer", "fetch", "push"]

log = logging.getLogger("trainguard.snapshot")

MAGIC = b"TGPEER01"
MAX_HEADER = 64 << 10
_CHUNK = 8 << 20


def _mac(token: str, header: bytes) -> bytes:
    return hmac.new(token.encode(), header, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(min(n - len(buf), _CHUNK))
        if not got:
            raise ConnectionError("peer closed the stream")
        buf += got
    return bytes(buf)


def push(address: str, slot: Slot, *, rank: int, token: str, timeout_s: float = 60.0) -> None:
    """Send ``slot`` (locked by the caller) to the peer agent at ``address``.

    Raises:
        CheckpointError: the peer refused it or could not be reached.
    """
    info = slot.info()
    if info is None:
        raise CheckpointError(f"{slot.path} holds no snapshot to push")
    size = slot.path.stat().st_size
    header = json.dumps({"op": "put", "rank": rank, "step": info.step, "bytes": size}).encode()
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(MAGIC + struct.pack("<I", len(header)) + header + _mac(token, header))
            answers = sock.makefile("r")
            answer = json.loads(answers.readline() or "{}")  # the header is accepted before any payload is sent
            if answer.get("go"):
                with open(slot.path, "rb") as f:
                    sock.sendfile(f, 0, size)
                answer = json.loads(answers.readline() or "{}")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"pushing rank {rank}'s snapshot to peer {address} failed: {e}") from None
    if not answer.get("ok"):
        raise CheckpointError(f"peer {address} refused rank {rank}'s snapshot: {answer.get('error', 'no answer')}")


def fetch(address: str, directory: SnapshotDir, *, rank: int, token: str, timeout_s: float = 60.0) -> Slot | None:
    """Fetch the copy of ``rank``'s snapshot the peer at ``address`` holds
    into ``directory``'s ``peer/`` folder; ``None`` when it holds none.

    Raises:
        CheckpointError: the peer could not be reached or refused.
    """
    header = json.dumps({"op": "fetch", "rank": rank}).encode()
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(MAGIC + struct.pack("<I", len(header)) + header + _mac(token, header))
            stream = sock.makefile("rb")
            answer = json.loads(stream.readline() or b"{}")
            if not answer.get("ok"):
                if answer.get("none"):
                    return None
                raise CheckpointError(f"peer {address} refused: {answer.get('error', 'no answer')}")
            return _store(directory, rank, answer["step"], answer["bytes"], stream.read)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"fetching rank {rank}'s snapshot from peer {address} failed: {e}") from None


def _store(directory: SnapshotDir, rank: int, step: int, size: int, read) -> Slot:
    """Receive a slot file of ``size`` bytes into ``peer/r{rank}``, verify it
    (checksum, step) and only then let it replace the previous copy."""
    final = directory.path / "peer" / f"r{rank}"
    tmp = final.with_name(final.name + ".tmp")
    try:
        with open(tmp, "wb") as out:
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


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(60)
        try:
            self.server.owner.receive(sock)
            reply = {"ok": True}
        except _Answered:
            return
        except (CheckpointError, ConnectionError, OSError, ValueError, KeyError) as e:
            log.warning("refused a snapshot from %s: %s", self.client_address[0], e)
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
        self.received = 0

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
            with open(slot.path, "rb") as f:
                sock.sendfile(f, 0, size)
            log.info("sent rank %d's copy of step %d back", rank, info.step)
        finally:
            slot.close()

    def receive(self, sock: socket.socket) -> None:
        if _recv_exact(sock, len(MAGIC)) != MAGIC:
            raise CheckpointError("not a trainguard snapshot stream")
        (n,) = struct.unpack("<I", _recv_exact(sock, 4))
        if n > MAX_HEADER:
            raise CheckpointError(f"header of {n} bytes is too large")
        header = _recv_exact(sock, n)
        if not hmac.compare_digest(_recv_exact(sock, 32), _mac(self.token, header)):
            raise CheckpointError("unauthenticated snapshot (wrong job token)")
        meta: dict[str, Any] = json.loads(header)
        rank = int(meta["rank"])
        if meta.get("op") == "fetch":
            self._send(sock, rank)
            raise _Answered()
        size = int(meta["bytes"])
        free = shutil.disk_usage(self.directory.path).free
        if not 0 < size < free:
            raise CheckpointError(f"a snapshot of {size} bytes does not fit ({free} bytes free)")
        sock.sendall(b'{"go": true}\n')
        slot = _store(self.directory, rank, meta["step"], size, lambda n: sock.recv(n))
        got = slot.info()
        slot.close()
        self.received += 1
        log.debug("holding rank %d's snapshot of step %d for its node", rank, got.step)
