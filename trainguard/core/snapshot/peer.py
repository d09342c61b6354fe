"""A second copy of each snapshot in a peer node's memory.

Every node agent runs a :class:`PeerServer`; a persist worker that sealed
a snapshot pushes the whole slot file to the next node's server
(:func:`push`), which keeps the newest copy per rank as ``peer/r{rank}`` in
its own snapshot directory. A process restarted on that node finds the copy
there (:meth:`SnapshotDir.candidates`); one restarted on a new node that
replaced a lost one has no snapshot of its own and fetches its copy back
from the node it pushed to (:func:`fetch`).

The stream is plain TCP, protocol 3, which opens with the mutual proof of
:mod:`..proof` (under a key derived from the job secret for this channel):

1. the client sends ``TGPEER03`` and one JSON line with its fresh nonce and
   the address it dialed;
2. the server refuses an address that is not its own; else it answers one
   JSON line ``{"version": 3, "challenge": <hex>, "proof": <hex>}`` (for
   another magic, why not, so a peer of another trainguard version gets a
   clear error and no hang);
3. the client checks the proof -- a server that does not know the secret
   (an address read from the rendezvous store is only a hint) gets no
   request, and no snapshot -- then sends a length-prefixed JSON header
   (``put``: rank, step, size; ``fetch``: rank) and its HMAC over both
   nonces, the address and the header (``put-own``/``fetch-own`` carry a
   rank's own-part record file the same way, :mod:`.own_peer`).

Both nonces make each header good for one connection to one server: a
captured put or fetch replayed later, or at another node, is refused (no
clock trust, no cache of seen nonces). For a put the server answers ``go``
(or why not) and only then reads the slot's bytes, then answers once more;
for a fetch it answers one JSON line followed by the copy's bytes. A header
that is malformed, too large, unauthenticated or replayed is refused before
any payload is read or sent; every read is bounded in size and time, and a
connection that has not proved the secret holds one of a few places (two
per peer address) for at most :data:`HANDSHAKE_S`, never one of an
authenticated request's. The payload is checked against the slot's own
checksum before the copy replaces the previous one (bulk data is not
HMACed: that would cost a SHA-256 pass over every snapshot; a network
path that could alter it unseen needs a private network).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import shutil
import socket
import struct
import time
from typing import Any, BinaryIO

from ..api import CheckpointError
from ..proof import client_proof, derive, nonce, server_proof, split_address
from .segment import Slot
from .shm import SnapshotDir

__all__ = ["fetch", "push"]

log = logging.getLogger("trainguard.snapshot")

VERSION = 3
MAGIC = b"TGPEER%02d" % VERSION
MAX_HEADER = 64 << 10
MAX_LINE = 4 << 10  # greetings and answers are short JSON lines
HANDSHAKE_S = 5.0  # for a client to prove the secret and send its request
MAX_CONNECTIONS = 32  # authenticated requests served at once; more are refused
MAX_UNPROVEN = 16  # connections still proving the secret, at most 2 from one address
_CHUNK = 8 << 20


def _connect(address: str, timeout_s: float) -> socket.socket:
    parsed = split_address(address)
    if parsed is None:
        raise ValueError(f"{address[:80]!r} is not a host:port address")
    return socket.create_connection(parsed, timeout=timeout_s)


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
    """Make the server prove the secret, then send ``request`` bound to this
    exchange; the stream its answers come on.

    Raises:
        CheckpointError: the server speaks another version, refused the
            address, or could not prove the secret (nothing was sent).
    """
    key, cn = derive(token, "peer"), nonce()
    sock.sendall(MAGIC + (json.dumps({"nonce": cn.hex(), "dialed": address}) + "\n").encode())
    stream = sock.makefile("rb")
    hello = _line(stream)
    if hello.get("version") != VERSION or "error" in hello:
        said = hello.get("error") or f"version {hello.get('version')}"
        if hello.get("version") == VERSION:
            raise CheckpointError(f"peer {address} refused the connection: {said}")
        raise CheckpointError(f"peer {address} speaks another snapshot protocol ({said}); this node speaks version "
                              f"{VERSION} (different trainguard versions?)")
    try:
        sn, proof = bytes.fromhex(hello["challenge"]), bytes.fromhex(hello["proof"])
    except (KeyError, TypeError, ValueError):
        sn, proof = b"", b""
    if len(sn) != 16 or not hmac.compare_digest(proof, server_proof(key, cn, sn, address)):
        raise CheckpointError(f"peer {address} did not prove it knows the job secret (wrong job token, or not this "
                              "job's node): nothing was sent to it")
    header = json.dumps(request).encode()
    sock.sendall(struct.pack("<I", len(header)) + header + client_proof(key, sn, cn, address, MAGIC + header))
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
    try:
        with _connect(address, timeout_s) as sock:
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
    try:
        with _connect(address, timeout_s) as sock:
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
