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
    try:
        result = call(f"127.0.0.1:{listener.getsockname()[1]}")
    finally:
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
    (n,) = struct.unpack("<I", request[8:12])
    answer = _send(server, request[:12 + n + 32])
    assert b"replayed snapshot request refused" in answer
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
    assert _send(server, b"GET / HTTP/1.1\r\n\r\n").endswith(b"not a trainguard snapshot stream\"}\n")
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
    from trainguard.core.snapshot import peer

    server, _ = nodes
    monkeypatch.setattr(peer, "HANDSHAKE_S", 0.5)
    assert b"not complete" in _send(server, b"TGPE")  # then silence: refused, not held for ever
    assert server.refused == 1
