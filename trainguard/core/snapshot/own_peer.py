"""A copy of each rank's own-part record on another host.

A rank's random streams and data position (its *own part*, :mod:`.own`)
are recorded in its node agent's memory at every update. A lost host takes
those records with it, and a rank started again on another host under
``recover`` would go on from its seed: no longer the job a fault-free run
trains. So each node agent keeps the next node's agent holding a copy of
its ranks' record files (:class:`OwnMirror`: it pushes a file whenever its
newest step changed, a few KB a step), and the agent that starts a lost
rank elsewhere fetches the copy from there before the new process runs
(:func:`fetch_own`). The copy travels over the peer snapshot protocol of
:mod:`.peer` (authenticated with the job token, one challenge per
connection) and is stored only when it parses as a record file.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..api import CheckpointError
from .own import _FILE, _HEAD, install_own, own_steps, read_own_file

__all__ = ["OwnMirror", "fetch_own", "push_own", "serve_own"]

log = logging.getLogger("trainguard.snapshot")

#: A record file is two records of at most 64 MiB each (see own.py).
MAX_OWN_FILE = 128 << 20
OPS = ("put-own", "fetch-own")


def _peer():  # .peer imports this module's serve_own
    from . import peer

    return peer


def push_own(address: str, raw: bytes, *, rank: int, token: str, timeout_s: float = 10.0) -> None:
    """Send ``rank``'s record file to the peer agent at ``address``.

    Raises:
        CheckpointError: the peer refused it or could not be reached.
    """
    peer, host, port = _peer(), *address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            answers = peer._open(sock, address, token, {"op": "put-own", "rank": rank, "bytes": len(raw)})
            sock.sendall(raw)
            answer = peer._line(answers)
    except (OSError, ValueError, CheckpointError) as e:
        raise CheckpointError(f"pushing rank {rank}'s own-part record to peer {address} failed: {e}") from None
    if not answer.get("ok"):
        raise CheckpointError(f"peer {address} refused rank {rank}'s own-part record: {answer.get('error')}")


def fetch_own(address: str, *, rank: int, token: str, timeout_s: float = 10.0) -> bytes | None:
    """The copy of ``rank``'s record file the peer at ``address`` holds
    (``None``: it holds none).

    Raises:
        CheckpointError: the peer could not be reached or refused.
    """
    peer, host, port = _peer(), *address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            stream = peer._open(sock, address, token, {"op": "fetch-own", "rank": rank})
            answer = peer._line(stream)
            if not answer.get("ok"):
                if answer.get("none"):
                    return None
                raise CheckpointError(f"peer {address} refused: {answer.get('error', 'no answer')}")
            size = answer.get("bytes")
            if not isinstance(size, int) or not 0 < size <= MAX_OWN_FILE:
                raise ValueError(f"peer offers a record file of {size!r} bytes")
            raw = stream.read(size)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"fetching rank {rank}'s own-part record from peer {address} failed: {e}") from None
    if len(raw) != size or not own_steps(raw):
        raise CheckpointError(f"peer {address} sent no sound record file for rank {rank}")
    return raw


def _copy_path(directory: Path, rank: int) -> Path:
    return directory / "peer" / f"own-r{rank}"


def serve_own(directory: Path, sock: socket.socket, meta: dict[str, Any]) -> bool:
    """The server's side of an own-record request (``meta``: authenticated).
    True when answered here (a fetch); a put returns False for the caller's
    ``ok`` line."""
    rank = int(meta["rank"])
    if meta["op"] == "fetch-own":
        raw = read_own_file(_copy_path(directory, rank))
        if raw is None:
            sock.sendall(b'{"ok": false, "none": true}\n')
        else:
            sock.sendall((json.dumps({"ok": True, "bytes": len(raw)}) + "\n").encode() + raw)
        return True
    size = int(meta["bytes"])
    if not 0 < size <= MAX_OWN_FILE:
        raise CheckpointError(f"an own-part record file of {size} bytes is refused")
    raw = _peer()._recv_exact(sock, size)
    if not own_steps(raw):
        raise CheckpointError(f"rank {rank}'s own-part record file holds no sound record")
    (directory / "peer").mkdir(exist_ok=True)
    install_own(directory / "peer", rank, raw)
    return False


def newest_step(path: Path) -> int | None:
    """The newest step a record file's headers name (checksums not read:
    what changed is all the mirror asks), or ``None``."""
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(_FILE.size)
            if len(head) < _FILE.size:
                return None
            _, capacity = _FILE.unpack(head)
            steps = []
            for i in range(2):
                f.seek(_FILE.size + i * (_HEAD.size + capacity))
                raw = f.read(_HEAD.size)
                if len(raw) == _HEAD.size:
                    steps.append(_HEAD.unpack(raw)[0])
            return max(steps) if steps else None
    except (OSError, struct.error):
        return None


class OwnMirror:
    """Keeps the next node's agent holding this node's ranks' record files.

    Args:
        directory: this node's snapshot directory.
        ranks: the ranks whose records to mirror (called each round).
        address: the next node's peer server (``host:port``), or a callable
            giving it (it changes with the rendezvous round).
        token: the job secret.
        interval_s: how often the files are looked at.
    """

    def __init__(self, directory: Path, ranks: Callable[[], list[int]], address: Callable[[], str | None],
                 token: Callable[[], str], interval_s: float = 0.02) -> None:
        self.directory, self._ranks, self._address, self._token = Path(directory), ranks, address, token
        self.interval_s = interval_s
        self._sent: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-own-mirror", daemon=True)
        self.pushed = 0
        self._warned = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            address = self._address()
            if not address:
                continue
            for rank in self._ranks():
                path = self.directory / f"own-r{rank}"
                step = newest_step(path)
                if step is None or step < 0 or self._sent.get(rank) == step:
                    continue
                raw = read_own_file(path)
                if not raw or not own_steps(raw):
                    continue  # being written or resized: the next look
                try:
                    push_own(address, raw, rank=rank, token=self._token())
                except CheckpointError as e:
                    if time.monotonic() - self._warned > 60:  # a peer down is said once a minute, not per step
                        self._warned = time.monotonic()
                        log.warning("%s (its random streams and data position have no copy on another host "
                                    "until it works again)", e)
                    continue
                self._sent[rank] = step
                self.pushed += 1
