"""A process forked from a training process (a ``DataLoader`` worker under
Linux's default start method) beside trainguard's threads (issue 37;
:mod:`trainguard.core.forks`): it collects none of the parent's garbage,
holds no end of the persist worker's request pipe, and gRPC prints nothing
at the fork, and it keeps no connection to the rank's relay open past the
rank. Before: ``Guard.close()`` waited a minute for the persist
worker when loader workers were alive, every fork printed "Other threads
are currently calling into gRPC, skipping fork() handlers", and a forked
worker could destroy the parent's unreachable process group (it hung in
``pthread_cond_destroy``) or gRPC objects (an abort), and a rank killed
with its loader workers alive stayed connected to its relay until they
noticed: its replacement was refused."""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from trainguard.core import forks
from trainguard.core.snapshot.persist_client import PersistWorker

FORK = multiprocessing.get_context("fork")


class _Finalised:
    """Writes the PID of the process that finalises it to a pipe."""

    def __init__(self, fd: int) -> None:
        self.fd, self.cycle = fd, self  # unreachable once dropped: only the cyclic collector frees it

    def __del__(self) -> None:
        os.write(self.fd, f"{os.getpid()}\n".encode())


def test_a_forked_child_does_not_collect_what_its_parent_left():
    r, w = os.pipe()
    gc.disable()  # the garbage must still be there at the fork
    try:
        _Finalised(w)
        child = FORK.Process(target=gc.collect)
        child.start()
        child.join(30)
    finally:
        gc.enable()
    gc.collect()  # the parent's own collection frees it
    os.close(w)
    with os.fdopen(r) as pipe:
        finalised_in = [int(line) for line in pipe.read().split()]
    assert child.exitcode == 0
    assert finalised_in == [os.getpid()], f"finalised in {finalised_in}; the child was {child.pid}"


def test_the_persist_worker_sees_the_end_of_its_input_while_forked_children_live():
    worker = PersistWorker()
    proc = worker._ensure()
    child = FORK.Process(target=time.sleep, args=(60,), daemon=True)  # a loader worker, alive at close()
    child.start()
    try:
        worker.close(wait=False)
        try:
            proc.wait(timeout=20)  # it ends at the end of its input: at once
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the persist worker is still waiting for the end of its input: a forked child holds it")
        assert child.is_alive()
    finally:
        child.kill()
        child.join()


GRPC_JOB = """
import os, threading, time
import trainguard.core  # what a training process imports before gRPC is used
import grpc
from concurrent import futures

server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
echo = grpc.stream_stream_rpc_method_handler(lambda requests, context: (r for r in requests))
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"S": echo}),))
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")

def requests():
    while True:
        time.sleep(0.05)
        yield b"x"

replies = channel.stream_stream("/t.S/S")(requests())  # a thread inside gRPC from now on, as the processor's
threading.Thread(target=lambda: [None for _ in replies], daemon=True).start()
time.sleep(0.5)
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print("forked", flush=True)
os._exit(0)
"""


def test_grpc_says_nothing_at_a_fork_beside_a_stream_in_flight():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", GRPC_JOB], env=env, capture_output=True, text=True, timeout=120)
    assert "forked" in out.stdout, out.stderr
    assert "fork" not in out.stderr, out.stderr


def test_a_forked_child_keeps_no_connection_to_the_relay_open():
    """The rank dies with its loader worker alive: the relay must see the
    connection close at once, not when the worker notices."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    forks.keep_peer_from_children(f"127.0.0.1:{port}")  # what Processor.connect says of its relay
    rank = FORK.Process(target=_rank_with_a_loader_worker, args=(port,))
    rank.start()
    conn, _ = server.accept()
    conn.settimeout(20)
    worker = None
    try:
        hello = conn.recv(64).split()
        assert hello[0] == b"up", hello
        worker = int(hello[1])
        assert conn.recv(16) == b"", "the connection ended with the rank: no child holds it"
        os.kill(worker, 0)  # while the worker lives on
    finally:
        conn.close()
        server.close()
        if worker is not None:  # first: it holds the end of the rank's sentinel pipe, which join() waits on
            os.kill(worker, 9)
        rank.join(30)


def _rank_with_a_loader_worker(port: int) -> None:
    relay = socket.create_connection(("127.0.0.1", port))
    worker = FORK.Process(target=time.sleep, args=(60,))  # outlives this process
    worker.start()
    relay.sendall(f"up {worker.pid}".encode())
    os.kill(os.getpid(), 9)  # the rank is lost; its worker lives on
