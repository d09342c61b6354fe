"""Peer copies: a captured put or fetch sent again later is refused.

Each test records the bytes a legitimate client sends through a small TCP
proxy, then replays them straight to the server: the server must refuse
(nothing served, nothing written), say so once in its log, and go on
serving legitimate peers. Peers of another protocol version get a clear
error and no hang.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from pathlib import Path

import pytest

from trainguard.core import CheckpointError
from trainguard.core.snapshot import PeerServer, SnapshotDir, fetch, push
from trainguard.core.snapshot import peer, peer_server
from trainguard.core.snapshot.own import OwnRecords, install_own, read_own, read_own_file
from trainguard.core.snapshot.own_peer import fetch_own, push_own
from trainguard.core.snapshot.segment import Slot

TOKEN = "secret"


@pytest.fixture
def nodes(tmp_path):
    """A peer node serving copies, and the node that pushes to it."""
    there, here = SnapshotDir.create("job-n1", tmp_path), SnapshotDir.create("job-n0", tmp_path)
    server = PeerServer(there, token=TOKEN)
    server.start()
    try:
        yield server, here
    finally:
        server.stop()
        there.remove()
        here.remove()


@pytest.fixture
def warnings():
    """Warnings of the snapshot logger (trainguard's loggers may not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("trainguard.snapshot")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _sealed(directory: SnapshotDir, step: int, index: int = 0) -> Slot:
    """A sealed slot of rank 3 holding ``step`` (locked, as push wants it)."""
    slot = directory.slot(3, index)
    assert slot.lock(True, block=True)
    data = _payload(step)
    slot.begin(len(data))[:] = data
    slot.commit(step, len(data))
    assert slot.seal() is not None
    return slot


def _payload(step: int) -> bytes:
    return (b"step-%06d|" % step) * 500


def _held_step(server: PeerServer) -> int:
    slot = server.directory.peer_copy(3)
    try:
        return slot.verified().step
    finally:
        slot.close()


def _recorded(server: PeerServer, call):
    """Run ``call(address)`` through a one-connection TCP proxy to ``server``;
    return its result and the bytes the client sent."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    sent = bytearray()

    def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if record:
                    sent.extend(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def relay() -> None:
        client, _ = listener.accept()
        host, port = server.address.rsplit(":", 1)
        with client, socket.create_connection((host, int(port)), timeout=10) as upstream:
            client.settimeout(10)
            back = threading.Thread(target=pump, args=(upstream, client, False), daemon=True)
            back.start()
            pump(client, upstream, True)
            back.join(10)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    real = peer._connect  # the client dials the server's address; its bytes pass the recorder on the way
    peer._connect = lambda address, timeout_s: socket.create_connection(listener.getsockname(), timeout=timeout_s)
    try:
        result = call(server.address)
    finally:
        peer._connect = real
        thread.join(10)
        listener.close()
    assert not thread.is_alive(), "the recording proxy hung"
    return result, bytes(sent)


def _send(server: PeerServer, data: bytes) -> bytes:
    """Send ``data`` to the server as one client and return all it answered."""
    host, port = server.address.rsplit(":", 1)
    got = bytearray()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(1 << 16):
                got += chunk
        except ConnectionResetError:  # closed with bytes of ours unread: what it said is already here
            pass
    return bytes(got)


def _refusals(records: list[logging.LogRecord], word: str) -> list[str]:
    return [r.getMessage() for r in records if word in r.getMessage()]


def test_a_replayed_fetch_is_refused_and_serves_nothing(nodes, tmp_path, warnings):
    server, here = nodes
    push(server.address, _sealed(here, 5), rank=3, token=TOKEN)
    new_node = SnapshotDir.create("job-n0-new", tmp_path)
    try:
        copy, request = _recorded(server, lambda address: fetch(address, new_node, rank=3, token=TOKEN))
        assert copy.verified().step == 5  # the recorded fetch was a good one
        copy.close()
        assert request
        for _ in range(5):
            answer = _send(server, request)
            assert b'"ok": true' not in answer and _payload(5)[:40] not in answer, answer[:300]  # nothing served
            assert b"replayed" in answer, answer[-300:]
        assert server.refused == 5
        assert len(_refusals(warnings, "replayed")) == 1  # logged once, not once per replay
        # Legitimate peers are still served.
        again = fetch(server.address, new_node, rank=3, token=TOKEN)
        assert again.verified().step == 5
        again.close()
    finally:
        new_node.remove()


def test_a_replayed_push_is_refused_and_does_not_roll_the_copy_back(nodes, warnings):
    server, here = nodes
    _, request = _recorded(server, lambda address: push(address, _sealed(here, 5), rank=3, token=TOKEN))
    assert _held_step(server) == 5 and server.received == 1
    push(server.address, _sealed(here, 6, index=1), rank=3, token=TOKEN)
    assert _held_step(server) == 6
    for _ in range(3):
        answer = _send(server, request)
        assert b'"go": true' not in answer and b'"ok": true' not in answer
    assert _held_step(server) == 6 and server.received == 2  # nothing written: no roll back to step 5
    assert not list((server.directory.path / "peer").glob("*.tmp"))
    assert len(_refusals(warnings, "replayed")) == 1
    push(server.address, _sealed(here, 7, index=2), rank=3, token=TOKEN)
    assert _held_step(server) == 7


def test_a_replayed_request_tells_the_replayer_why(nodes):
    """The header part alone (no payload behind it to reset the stream) gets
    the refusal's reason back."""
    server, here = nodes
    _, request = _recorded(server, lambda address: push(address, _sealed(here, 5), rank=3, token=TOKEN))
    at = request.index(b"\n") + 1  # magic, greeting line, then the header's length
    (n,) = struct.unpack("<I", request[at:at + 4])
    answer = _send(server, request[:at + 4 + n + 32])
    assert b"replayed" in answer and b"refused" in answer
    assert _held_step(server) == 5


def test_a_wrong_token_is_still_named(nodes):
    server, here = nodes
    with pytest.raises(CheckpointError, match="wrong job token"):
        push(server.address, _sealed(here, 5), rank=3, token="guess")
    with pytest.raises(CheckpointError, match="wrong job token"):
        fetch(server.address, here, rank=3, token="guess")


def test_a_peer_of_another_protocol_version_gets_a_clear_error(nodes, warnings):
    server, _ = nodes
    # An older client: magic, header and MAC at once, then it waits for an answer.
    answer = _send(server, b"TGPEER01" + struct.pack("<I", 2) + b"{}" + bytes(32))
    assert b"TGPEER01" in answer and b"different trainguard versions" in answer
    answer = _send(server, b"TGPEER02")  # last version's: it waits for the challenge
    assert b"TGPEER02" in answer and b"different trainguard versions" in answer
    assert b"not a trainguard snapshot stream" in _send(server, b"GET / HTTP/1.1\r\n\r\n")
    assert len(_refusals(warnings, "TGPEER01")) == 1


def _fake_server(answer: bytes | None):
    """A one-connection server that reads the magic and answers ``answer``
    (``None``: never answers, holding the connection)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(8)
            if answer is not None:
                conn.sendall(answer)
            done.wait(10)

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}", listener, done


@pytest.mark.parametrize("answer, match", [
    (b'{"ok": false, "error": "not a trainguard snapshot stream"}\n', "another snapshot protocol"),  # an older server
    (b"x" * (64 << 10), "at most"),  # an endless line
    (None, "timed out"),  # silence
])
def test_a_client_never_hangs_on_an_odd_server(tmp_path, answer, match):
    directory = SnapshotDir(Path(tmp_path))
    (tmp_path / "peer").mkdir()
    address, listener, done = _fake_server(answer)
    try:
        with pytest.raises(CheckpointError, match=match):
            fetch(address, directory, rank=3, token=TOKEN, timeout_s=1)
    finally:
        done.set()
        listener.close()


def test_a_silent_or_trickling_client_is_dropped_at_the_handshake_deadline(nodes, monkeypatch):
    server, _ = nodes
    monkeypatch.setattr(peer_server, "HANDSHAKE_S", 0.5)
    assert b"not complete" in _send(server, b"TGPE")  # then silence: refused, not held for ever
    assert server.refused == 1


# ------------------------------------------------------------ a peer that is no node of the job
class _ImpostorPeer:
    """A server at an address planted in the rendezvous store: it answers
    the greeting with a challenge and a made-up proof, says ``go`` to any
    request, records every byte, and to a fetch offers ``offer`` (a valid
    slot file of its own making)."""

    def __init__(self, offer: bytes = b"") -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.received = bytearray()
        self.offer = offer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            try:
                magic = conn.recv(8)
                self.received += magic
                if magic == b"TGPEER03":
                    while not self.received.endswith(b"\n"):
                        self.received += conn.recv(1)
                conn.sendall(b'{"version": %d, "challenge": "%s", "proof": "%s"}\n'
                             % (int(magic[-2:] or 0), b"ab" * 16, b"cd" * 32))
                head = conn.recv(4)
                self.received += head
                (n,) = struct.unpack("<I", head)
                header = b""
                while len(header) < n + 32:
                    header += conn.recv(n + 32 - len(header))
                self.received += header
                if b'"fetch"' in header:
                    conn.sendall(b'{"ok": true, "step": 9, "bytes": %d}\n' % len(self.offer) + self.offer)
                    return
                conn.sendall(b'{"go": true}\n')
                while chunk := conn.recv(1 << 16):
                    self.received += chunk
                conn.sendall(b'{"ok": true}\n')
            except (OSError, struct.error):  # the client hung up: what it sent is recorded
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


def test_a_peer_that_cannot_prove_the_secret_gets_no_snapshot_and_gives_none(tmp_path):
    """Before, a push sent the whole slot (model, optimizer, random streams)
    to whatever address the store named once it answered a challenge, and a
    fetch stored whatever such a server sent back as this rank's copy."""
    here, forger = SnapshotDir.create("job-n0", tmp_path), SnapshotDir.create("job-evil", tmp_path)
    try:
        slot = _sealed(here, 5)
        impostor = _ImpostorPeer()
        with pytest.raises(CheckpointError, match="did not prove it knows the job secret"):
            push(impostor.address, slot, rank=3, token=TOKEN)
        impostor.close()
        assert _payload(5)[:40] not in bytes(impostor.received) and len(impostor.received) < 200, \
            bytes(impostor.received)[:200]
        evil = _sealed(forger, 9)
        offer = evil.path.read_bytes()
        evil.close()
        impostor = _ImpostorPeer(offer)
        with pytest.raises(CheckpointError, match="did not prove it knows the job secret"):
            fetch(impostor.address, here, rank=3, token=TOKEN)
        impostor.close()
        assert not (here.path / "peer" / "r3").exists(), "the impostor's slot was stored as this rank's copy"
    finally:
        here.remove()
        forger.remove()


def test_own_part_records_go_only_to_a_peer_that_proves_the_secret(nodes, tmp_path):
    """A rank's own-part record file (its random streams and data position, which each node agent mirrors
    to the next node) rides the same exchange: it comes back whole from a real peer, and a server at a
    forged address gets none of it and gives none."""
    server, here = nodes
    OwnRecords(here.path, 3).write(7, b"streams and position " * 20)
    raw = read_own_file(here.path / "own-r3")
    push_own(server.address, raw, rank=3, token=TOKEN)
    back = fetch_own(server.address, rank=3, token=TOKEN)
    install_own(tmp_path, 3, back)
    assert read_own(tmp_path, 3, 7) == b"streams and position " * 20
    impostor = _ImpostorPeer()
    with pytest.raises(CheckpointError, match="did not prove it knows the job secret"):
        push_own(impostor.address, raw, rank=3, token=TOKEN)
    impostor.close()
    assert b"streams and position" not in bytes(impostor.received) and len(impostor.received) < 200
    impostor = _ImpostorPeer(raw)
    with pytest.raises(CheckpointError, match="did not prove it knows the job secret"):
        fetch_own(impostor.address, rank=3, token=TOKEN)
    impostor.close()


def test_a_request_for_another_address_is_refused(nodes, warnings):
    """A client steered to another server dials that server's address: a
    request the other server relays here, bound to it, is refused."""
    server, here = nodes
    real = peer._connect
    peer._connect = lambda address, timeout_s: real(server.address, timeout_s)  # what a relaying server does
    try:
        with pytest.raises(CheckpointError, match="refused the connection: dialed"):
            push("127.0.0.1:1", _sealed(here, 5), rank=3, token=TOKEN)
    finally:
        peer._connect = real
    assert server.received == 0 and _refusals(warnings, "dialed")


def test_silent_connections_do_not_keep_real_peers_out(nodes):
    """Before, 32 connections that never sent a byte held every place for
    10 s; now a stranger holds at most two places for a few seconds, never
    an authenticated request's."""
    server, here = nodes
    host, port = server.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
              for _ in range(40)]
    try:
        push(server.address, _sealed(here, 5), rank=3, token=TOKEN)  # served at once
        assert _held_step(server) == 5
    finally:
        for c in silent:
            c.close()
