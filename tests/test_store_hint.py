"""The controller's address in the rendezvous store is a hint (issue 41, item 1).

Anyone who reaches torch's store may write it. Before, relays and clients
sent ``authorization: Bearer <secret>`` to whatever address they read
there, and the secret then opened the real controller. Now every client
makes the server prove the secret first, and what it sends is a proof good
for one call, to that server, at the address it dialed:

* a server that does not know the secret gets nothing that opens the
  controller, whether it answers on its own or relays the handshake to the
  real controller (a live man in the middle);
* a proof is good once, at one server: replayed, or taken to another
  controller with the same secret, it is refused;
* a node that reads a forged address logs it and reads again until a
  server proves the secret; a two-node job whose store key is flooded with
  an impostor's address finishes once the flood stops, and the impostor
  never saw a proof.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest

from attackers import Impostor, forged
from conftest import WORKERS
from trainguard.core import Controller, ControllerConfig, Processor, ProcessorConfig, ProtocolError, ReplicaGroup
from trainguard.core.api import TrainguardError
from trainguard.core.control.client import ControllerClient
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.relay import Relay
from trainguard.core.rpc import SERVICE

SECRET = "hint-" + "cd" * 20
FAST = dict(heartbeat_interval_s=0.2, heartbeat_misses=3, prelock_timeout_s=2.0, handler_timeout_s=5.0)


@pytest.fixture
def controller():
    with Controller(ControllerConfig(**FAST), 2, token=SECRET) as c:
        yield c


def _clients(address: str):
    """Every kind of client, pointed at ``address``: a relay, a rank, `trainguard status`, an agent's report."""
    yield "relay", lambda: Relay(address, SECRET, node="n1", agent=pb.AgentHello(ranks=[1], key=b"k" * 16)).start()
    rank = Processor(ProcessorConfig(controller=address, token=SECRET, rank=0, world_size=2, connect_timeout_s=3),
                     force_exit=lambda code: None)
    yield "rank", lambda: rank.connect(replicas=[ReplicaGroup.full(range(2))])
    yield "status", lambda: ControllerClient(address, SECRET, timeout_s=3).status()
    yield "exit report", lambda: ControllerClient(address, SECRET, timeout_s=3).report_process_exit(1, 77, -9)


def _nothing_opens(impostor: Impostor, controller: Controller) -> None:
    """The impostor saw no secret and no proof, and nothing it saw opens the controller."""
    seen = [body for _, _, body in impostor.seen] + [v.encode() for _, md, _ in impostor.seen for _, v in md]
    assert not any(SECRET.encode() in b for b in seen)
    assert impostor.proofs() == [], impostor.proofs()
    assert {m for m, _, _ in impostor.seen} <= {"Handshake"}, {m for m, _, _ in impostor.seen}


def test_a_server_without_the_secret_gets_nothing_that_opens_the_controller(controller):
    with Impostor() as impostor:
        for name, start in _clients(impostor.address):
            with pytest.raises((ProtocolError, TrainguardError), match="did not prove it knows the job secret"):
                start()
        _nothing_opens(impostor, controller)
        assert len(impostor.seen) == 4, "each client asked for the proof, and stopped there"


@pytest.mark.parametrize("rewrite", [False, True], ids=["as-dialed", "rewritten"])
def test_a_live_man_in_the_middle_gets_nothing_either(controller, rewrite, caplog):
    """The impostor hands each handshake to the real controller: bound to
    the impostor's address, the controller refuses it (and logs); rewritten
    to its own address, its answer does not match what the client dialed."""
    with Impostor(relay_to=controller.address, rewrite=rewrite) as impostor, \
            caplog.at_level(logging.WARNING, logger="trainguard.controller"):
        for name, start in _clients(impostor.address):
            with pytest.raises((ProtocolError, TrainguardError),
                               match="did not prove it knows the job secret" if rewrite else "Handshake: dialed"):
                start()
        _nothing_opens(impostor, controller)
    if not rewrite:
        assert "refused PERMISSION_DENIED" in caplog.text and "Handshake: dialed" in caplog.text
    assert controller.snapshot()["ranks"] == {}


def test_a_proof_is_good_for_one_call_at_one_server(controller):
    """A proof captured on the wire (here: made, then used) opens nothing a
    second time, nor at another controller of the same secret."""
    from trainguard.core.handshake import login

    path = f"/{SERVICE}/GetStatus"
    channel = grpc.insecure_channel(controller.address)
    md = login(channel, SECRET, controller.address, path)
    assert pb.JobStatus.FromString(channel.unary_unary(path)(b"", metadata=md, timeout=10)).state
    with pytest.raises(grpc.RpcError) as replay:
        channel.unary_unary(path)(b"", metadata=md, timeout=10)
    assert replay.value.code() == grpc.StatusCode.UNAUTHENTICATED
    fresh = login(channel, SECRET, controller.address, path)
    with Controller(ControllerConfig(**FAST), 2, token=SECRET) as other:
        with grpc.insecure_channel(other.address) as elsewhere:
            with pytest.raises(grpc.RpcError) as moved:
                elsewhere.unary_unary(path)(b"", metadata=fresh, timeout=10)
            assert moved.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as other_call:  # made for GetStatus: no good for another method
        channel.unary_unary(f"/{SERVICE}/ReportProcessExit")(b"", metadata=fresh, timeout=10)
    assert other_call.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_a_forged_address_is_read_again_until_a_server_proves_the_secret(controller, caplog):
    from trainguard.core.control.client import find_controller

    with Impostor() as impostor:
        reads = iter([impostor.address, "garbage\x1b[2J", impostor.address, controller.address])
        with caplog.at_level(logging.WARNING, logger="trainguard.client"):
            assert find_controller(lambda: next(reads), SECRET, retry_s=0.01) == controller.address
        _nothing_opens(impostor, controller)
    assert caplog.text.count("is not this job's controller") == 2, caplog.text  # once per value
    assert "\x1b" not in caplog.text
    with pytest.raises(TrainguardError, match="no address in the rendezvous store"):
        find_controller(lambda: "127.0.0.1:1", SECRET, timeout_s=0.5, retry_s=0.1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_two_node_job_whose_store_key_is_flooded_finishes_and_leaks_nothing(tmp_path):
    """Two node agents on this host meet on the test's store; from before
    they start, a thread writes an impostor's address to the first round's
    controller key as fast as it can, until node 1 came to the impostor and
    2 s more. Node 1 reads the forged value, refuses it and reads again;
    node 0 writes the true one again each second. The job finishes; the
    impostor never saw a proof."""
    import torch.distributed as dist

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    token = tmp_path / "token"
    token.write_text(SECRET)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(PYTHONUNBUFFERED="1", TRAINGUARD_TOKEN_FILE=str(token), TRAINGUARD_HEARTBEAT_INTERVAL_S="0.5")
    run_id = f"hint-{uuid.uuid4().hex[:6]}"
    stop = threading.Event()
    with Impostor() as impostor:
        def flood() -> None:
            # The key as the agents see it: torch's rendezvous hands them a PrefixStore of the run id and the
            # round (0, the only one here). Flooded from the start: waiting for the round's keys to learn the
            # prefix lost the race under load (node 1 read the true value before the first forged write).
            key = f"torch.rendezvous.{run_id}.0/trainguard/controller"
            end = time.monotonic() + 60
            while time.monotonic() < end and not stop.is_set():  # until node 1 came to the impostor, and 2 s more
                store.set(key, impostor.address)
                if impostor.seen and end > time.monotonic() + 2:
                    end = time.monotonic() + 2

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        procs = []
        for node in range(2):
            cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                   "--monitor-interval", "0.1", str(WORKERS / "tiny_train.py"), "6", str(tmp_path / f"r{node}.json"),
                   str(tmp_path / "ckpt")]
            procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        try:
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            stop.set()
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
        assert "is not this job's controller" in "".join(outs), "the flood was never read: nothing was tested"
        assert impostor.seen and impostor.proofs() == [], impostor.proofs()
        assert not any(SECRET.encode() in body for _, _, body in impostor.seen)
    report = next(json.loads(r.read_text()) for r in (tmp_path / "r0.json", tmp_path / "r1.json") if r.exists())
    assert report["steps_completed"] == 6, report
