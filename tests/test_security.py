"""The control plane against someone who can reach it (issue: "safe on
shared and multi-node hosts").

* the job secret never passes through the rendezvous store, which has no
  authentication: a job of several nodes needs one from a file or the
  environment, or it refuses to start; every key of the store read back
  lets no client in;
* mutual TLS on the controller (certificates made here with openssl);
* only the node agent that runs a rank reports its process's exit, and a
  node agent's name cannot be taken over;
* a call without the secret is refused before its body is decoded, and a
  flood of refusals is logged once a few seconds per peer, at the relay as
  at the controller.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from attackers import forged
from conftest import WORKERS

from trainguard.core import Controller, ControllerConfig, Processor, ProcessorConfig, ProtocolError, ReplicaGroup
from trainguard.core.api import ConfigError, ControllerLostError
from trainguard.core.control.client import ControllerClient
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.relay import Relay
from trainguard.core.rpc import SERVICE
from trainguard.core.secret import TLS, job_secret

FAST = dict(heartbeat_interval_s=0.2, heartbeat_misses=3, prelock_timeout_s=2.0, handler_timeout_s=5.0)
SECRET = "s3cret-" + "ab" * 20


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.05)


# ------------------------------------------------------------ the job secret
def test_a_job_of_several_nodes_without_a_shared_secret_is_refused_before_it_starts(tmp_path):
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", str(WORKERS / "tiny_train.py"), "2",
           str(tmp_path / "r.json"), str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "needs a shared secret" in out.stderr and "TRAINGUARD_TOKEN_FILE" in out.stderr, out.stderr[-3000:]


def test_secrets_from_a_file_or_the_environment_and_what_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(f"  {SECRET}\n")
    secret.chmod(0o600)
    assert job_secret({"TRAINGUARD_TOKEN_FILE": str(secret), "TRAINGUARD_TOKEN": "x" * 40}, nodes=8) == SECRET
    assert job_secret({"TRAINGUARD_TOKEN": SECRET}, nodes=8) == SECRET
    assert len(job_secret({}, nodes=1)) == 64, "one node: a fresh secret"
    for env, match in (({}, "needs a shared secret"), ({"TRAINGUARD_TOKEN": "short"}, "at least 16"),
                       ({"TRAINGUARD_TOKEN_FILE": str(tmp_path / "none")}, "cannot read the job secret"),
                       ({"TRAINGUARD_TOKEN": "with a blank inside it"}, "without blanks")):
        with pytest.raises(ConfigError, match=match):
            job_secret(env, nodes=2)


def test_the_rendezvous_store_holds_nothing_that_lets_a_client_in(tmp_path):
    """Every key of the job's rendezvous store, read while the job runs (as
    anyone who reaches the store can): no value is the secret, none is let
    in by the controller."""
    import torch.distributed as dist

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"sec-{uuid.uuid4().hex[:6]}",
           "--monitor-interval", "0.1", str(WORKERS / "tiny_train.py"), "400", str(tmp_path / "r.json"),
           str(tmp_path / "ckpt")]
    job = subprocess.Popen(cmd, env=_env(TRAINGUARD_TOKEN=SECRET, TINY_STEP_SLEEP="0.05"), cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(lambda: any(k.endswith("trainguard/controller") for k in store.list_keys()), 60)
        time.sleep(1.0)  # the workers' own keys too
        values = {key: store.get(key) for key in store.list_keys()}
        address = next(v.decode() for k, v in values.items() if k.endswith("trainguard/controller"))
        assert not any(SECRET.encode() in v for v in values.values()), sorted(values)
        assert not any(k.endswith("trainguard/token") for k in values), sorted(values)
        tried = 0
        for value in values.values():
            text = value.decode(errors="replace").strip()
            if not text or any(c.isspace() or not c.isprintable() for c in text):
                continue
            client = ControllerClient(address, text, timeout_s=5)
            with pytest.raises(ProtocolError, match="did not prove it knows the job secret"):
                client.status()  # the controller's proof fails under that value: nothing is sent
            client.close()
            with pytest.raises(grpc.RpcError) as refused:  # and a proof made with it is refused
                _unary_raw(address, "GetStatus", b"", text)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            tried += 1
        assert tried >= 3, values
        assert ControllerClient(address, SECRET).status()["world_size"] == 2, "the secret itself gets in"
    finally:
        workers = _descendants(job.pid)  # torchrun starts each in a session of its own
        os.killpg(job.pid, 9)  # the launcher
        for pid in workers:  # else one still joining waits for the dead launcher's store for 30 min
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        job.wait(timeout=30)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from ``/proc/<pid>/task/*/children``."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ mutual TLS
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """A certificate authority, a node certificate for 127.0.0.1 it signed,
    and a node certificate of another authority."""
    d = tmp_path_factory.mktemp("pki")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                 "-days", "2", "-subj", f"/CN=trainguard test {ca}", cwd=d)
        node = "node" if ca == "ca" else "stranger"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{node}.key", "-out", f"{node}.csr",
                 "-subj", "/CN=127.0.0.1", cwd=d)
        _openssl("x509", "-req", "-in", f"{node}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                 "-out", f"{node}.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return {"dir": d, "node": {"TRAINGUARD_TLS_CERT": str(d / "node.pem"), "TRAINGUARD_TLS_KEY": str(d / "node.key"),
                               "TRAINGUARD_TLS_CA": str(d / "ca.pem")},
            "stranger": {"TRAINGUARD_TLS_CERT": str(d / "stranger.pem"),
                         "TRAINGUARD_TLS_KEY": str(d / "stranger.key"), "TRAINGUARD_TLS_CA": str(d / "ca.pem")}}


def test_a_tls_controller_serves_its_nodes_and_no_one_else(pki):
    tls = TLS.from_env(pki["node"])
    with Controller(ControllerConfig(**FAST), 2, token=SECRET, tls=tls) as c:
        assert ControllerClient(c.address, SECRET, tls=tls).status()["world_size"] == 2
        with pytest.raises(ControllerLostError):  # plain gRPC to a TLS port: no connection
            ControllerClient(c.address, SECRET, timeout_s=3).status()
        with pytest.raises(ControllerLostError):  # a certificate of another authority: the handshake fails
            ControllerClient(c.address, SECRET, tls=TLS.from_env(pki["stranger"]), timeout_s=3).status()
        with pytest.raises(ProtocolError, match="did not prove"):  # a certificate, not the secret
            ControllerClient(c.address, "not-the-secret-" + "0" * 20, tls=tls).status()
    with pytest.raises(ConfigError, match="TRAINGUARD_TLS_CA not set"):
        TLS.from_env({k: v for k, v in pki["node"].items() if k != "TRAINGUARD_TLS_CA"})


def test_failed_tls_handshakes_do_not_fill_the_log(pki):
    """Before, gRPC printed one line for every connection that failed the
    TLS handshake: anyone who reached the port filled the log."""
    code = (f"import socket, time, trainguard\n"
            f"from trainguard.core import Controller, ControllerConfig\n"
            f"from trainguard.core.secret import TLS\n"
            f"c = Controller(ControllerConfig(), 2, token={SECRET!r}, tls=TLS.from_env({pki['node']!r}))\n"
            f"host, port = c.start().rsplit(':', 1)\n"
            f"for _ in range(20):\n"
            f"    with socket.create_connection((host, int(port))) as s:\n"
            f"        s.sendall(b'GET / HTTP/1.1\\r\\n\\r\\n')\n"
            f"        s.recv(100)\n"
            f"c.stop()\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Handshake failed" not in out.stderr, out.stderr[-3000:]


def test_a_job_runs_over_mutual_tls(tmp_path, pki):
    d = pki["node"]
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "0", "--tls-cert", d["TRAINGUARD_TLS_CERT"], "--tls-key", d["TRAINGUARD_TLS_KEY"], "--tls-ca",
           d["TRAINGUARD_TLS_CA"], str(WORKERS / "tiny_train.py"), "6", str(tmp_path / "r.json"),
           str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, env=_env(TRAINGUARD_FAULT="comm:rank=1,step=3"), cwd=tmp_path, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps_completed"] == 6 and [r["strategy"] for r in report["recoveries"]] == ["retry"], report


# ------------------------------------------------------------ who may report what
def _relay(c: Controller, node: str, ranks: list[int], key: bytes) -> Relay:
    return Relay(c.address, c.token, node=node, agent=pb.AgentHello(ranks=ranks, key=key))


def test_only_the_agent_that_runs_a_rank_reports_its_exit(caplog):
    """A forged exit report for a live rank -- by call, or over another
    agent's stream, both with the secret and the rank's true pid -- is
    refused and logged, and the rank stays; its own agent's report counts."""
    with Controller(ControllerConfig(**FAST), 2, token=SECRET) as c:
        a, b = _relay(c, "node-a", [0], b"a" * 16), _relay(c, "node-b", [1], b"b" * 16)
        rank0 = Processor(ProcessorConfig(controller=a.start(), token=SECRET, rank=0, world_size=2,
                                          connect_timeout_s=5), force_exit=lambda code: None)
        b.start()
        try:
            rank0.connect(step=0, replicas=[ReplicaGroup.full(range(2))])
            _wait(lambda: c._call(lambda: c._core.agents.home(1)) == "node-b" and c.snapshot()["ranks"])
            alive = lambda: c.snapshot()["ranks"]["0"]["alive"]  # noqa: E731
            pid = os.getpid()
            with caplog.at_level(logging.WARNING):
                with pytest.raises(ProtocolError, match="reported by its node agent node-a"):
                    ControllerClient(c.address, SECRET).report_process_exit(0, pid, -9)  # by call
                b.report_process_exit(0, pid, -9)  # over another agent's stream
                time.sleep(0.5)
            assert alive(), "a forged report took the rank"
            assert "an exit report for rank 0: rank 0 runs under node-a" in caplog.text
            a.report_process_exit(0, pid, -9)  # its own agent: the controller acts on it
            _wait(lambda: not alive())
        finally:
            rank0.close(finished=False)
            a.stop(), b.stop()


def test_a_rank_given_up_for_lost_is_ended_within_seconds_of_the_jobs_end(tmp_path):
    """Rank 1 freezes (no thread of it runs again; the process lives): the
    controller gives it up, the others dump, the job ends. Its agent stops
    it seconds after the end, not after every grace period summed (37 min)."""
    from conftest import run_job

    start = time.monotonic()
    job = run_job(tmp_path, "frozen", nproc=2, steps=12, fault="freeze:rank=1,step=3", strategies="dump",
                  timeout=180)
    assert job.rc == 75, job
    assert "still running" in job.log and "after the job ended; stopping them" in job.log, job
    assert time.monotonic() - start < 170


def test_a_node_agents_name_cannot_be_taken_over():
    with Controller(ControllerConfig(**FAST), 2, token=SECRET) as c:
        real = _relay(c, "node-a", [0, 1], b"k" * 16)
        real.start()
        try:
            _wait(lambda: c._call(lambda: c._core.agents.home(0)) == "node-a")
            thief = _relay(c, "node-a", [0, 1], b"x" * 16)
            thief.start()
            _wait(lambda: not thief._upstream_alive, 10)  # refused: PERMISSION_DENIED on its stream
            thief.stop()
            time.sleep(0.3)
            assert c._call(lambda: c._core.agents.home(0)) == "node-a"
            assert c._call(lambda: c._service.agents.get("node-a")) is not None, "the real agent is still there"
            again = _relay(c, "node-a", [0, 1], b"k" * 16)  # the real agent's relay of a new round: its key
            again.start()
            time.sleep(0.3)
            assert again._upstream_alive
            again.stop()
        finally:
            real.stop()



def test_a_hello_without_a_key_reserves_no_name():
    """An announcement with no key is refused and leaves the name free: the
    agent that comes next with its key takes it (an empty key once kept it)."""
    with Controller(ControllerConfig(**FAST), 2, token=SECRET) as c:
        keyless = _relay(c, "node-a", [0, 1], b"")
        keyless.start()
        try:
            _wait(lambda: not keyless._upstream_alive, 10)  # refused: no key
        finally:
            keyless.stop()
        real = _relay(c, "node-a", [0, 1], b"k" * 16)
        real.start()
        try:
            _wait(lambda: c._call(lambda: c._core.agents.home(0)) == "node-a", 10)
            assert real._upstream_alive
        finally:
            real.stop()


# ------------------------------------------------------------ refusals: cheap and quiet
def _unary_raw(address: str, method: str, body: bytes, token: str):
    channel = grpc.insecure_channel(address)
    path = f"/{SERVICE}/{method}"
    call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        return call(body, metadata=forged(channel, address, token, path), timeout=10)
    finally:
        channel.close()


def test_a_call_without_the_secret_is_refused_before_its_body_is_decoded(monkeypatch, caplog):
    from trainguard.core.control import server

    decoded: list[int] = []
    real = server.decoder

    def counting(cls, limit):
        decode = real(cls, limit)
        return lambda data: (decoded.append(len(data)), decode(data))[1]

    monkeypatch.setattr(server, "decoder", counting)
    with Controller(ControllerConfig(**FAST), 2, token=SECRET) as c:
        with caplog.at_level(logging.WARNING, logger="trainguard.controller"):
            for _ in range(40):
                with pytest.raises(grpc.RpcError) as e:
                    _unary_raw(c.address, "ReportProcessExit", b"\x08" * (256 << 10), "wrong-" + "0" * 20)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert decoded == [], "a refused body was decoded"
        lines = [r for r in caplog.records if "refused UNAUTHENTICATED" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]  # once per peer and kind, then counted
        ControllerClient(c.address, SECRET).status()
        assert decoded, "an authenticated call is decoded"


def test_the_relay_logs_every_kind_of_refusal_as_the_controller_does(caplog):
    with Controller(ControllerConfig(**FAST), 1, token=SECRET) as c:
        relay = Relay(c.address, SECRET, node="node-r")
        address = relay.start()
        try:
            channel = grpc.insecure_channel(address)
            session = channel.stream_stream(f"/{SERVICE}/Session", request_serializer=None,
                                            response_deserializer=None)
            with caplog.at_level(logging.WARNING, logger="trainguard.relay"):
                for body, token in ((pb.RankMessage(heartbeat=pb.Status()).SerializeToString(), SECRET),
                                    (b"\xff\xff\xff", SECRET), (b"", "wrong-" + "0" * 20),
                                    (b"\x0a" + b"\xff" * (5 << 20), SECRET)):  # over gRPC's own limit
                    with pytest.raises(grpc.RpcError):
                        list(session(iter([body]), metadata=forged(channel, address, token, f"/{SERVICE}/Session"),
                                     timeout=10))
            channel.close()
            text = caplog.text
            for kind in ("refused INVALID_ARGUMENT", "refused UNAUTHENTICATED"):
                assert f"relay node-r {kind} from ipv4:127.0.0.1" in text, text
            assert "must be Hello" in text and "malformed RankMessage" in text, text
            assert "ended before its first message (empty, or over gRPC's 4194304-byte limit)" in text, text
        finally:
            relay.stop()


def test_a_flood_of_unauthenticated_calls_costs_the_controller_little_memory():
    """100 concurrent unauthenticated 4 MiB calls against a controller in a
    process of its own (bench/preauth.py's flood): each is received only up
    to gRPC's fixed 64 KiB window before it is refused. With gRPC's growing
    (BDP) windows it cost 60-140 MiB; now a few."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("preauth", Path(__file__).parent.parent / "bench" / "preauth.py")
    preauth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preauth)
    r = preauth.flood(preauth.ROOT, 100, 4.0)
    assert r["refused"] == 100 and r["other_codes"] == [], r
    assert r["grown_MiB"] < 24, r  # 60-140 with BDP probing on (bench/results/preauth.json)
