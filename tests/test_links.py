"""The link survey (``trainguard/core/links.py``): the agents' sinks and
probes over real sockets, the verdict, the controller's orders and answers,
and the step series that starts a survey when only communication slowed."""

from __future__ import annotations

import logging
import socket
import struct

import pytest

from trainguard.core.agent_messages import AgentOrder, LinkProbe
from trainguard.core.control.wire import agent_event, agent_event_to_pb, agent_order, agent_order_to_pb
from trainguard.core.links import MAX_BYTES, LinkSink, LinkSurvey, Surveyor, answer_probe, measure, probe_peers
from trainguard.core.profiling.detect import Detector, DetectorConfig
from trainguard.core.profiling.records import StepRow

SECRET = "job-secret"


@pytest.fixture
def sink():
    s = LinkSink("127.0.0.1", SECRET)
    addr = s.start()
    yield addr
    s.stop()


def test_a_probe_measures_the_link_to_a_sink(sink):
    bps = measure(sink, SECRET, 1 << 20)
    assert bps > 0
    assert measure(sink, SECRET, 1 << 40, seconds=0.2) > 0  # a TiB asked for: capped, and stopped in time
    (node, rate, error), = probe_peers(["b"], [sink], SECRET, 1 << 20)
    assert (node, error) == ("b", "") and rate > 0


def test_an_agent_answers_a_survey_order_as_it_came_over_the_wire(sink):
    """The agent's side, as the node agent runs it: the order read from
    protobuf, each link probed, the answer made protobuf again."""
    order = LinkProbe(nodes=("b", "gone"), addrs=(sink, "127.0.0.1:1"), bytes=1 << 20)
    answer = answer_probe(agent_order(agent_order_to_pb(AgentOrder(7, order))), SECRET)
    assert agent_event(agent_event_to_pb(answer)) == answer
    (b, b_rate, b_error), (gone, gone_rate, gone_error) = answer.rates
    assert (answer.order, answer.ok, b, b_error, gone, gone_rate) == (7, True, "b", "", "gone", 0.0), answer
    assert b_rate > 0 and gone_error.startswith("ConnectionRefusedError"), answer


def _opening(sink: str, secret: str, size: int, source: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
    """A probe's opening as a prober holding ``secret`` makes it, without checking the sink's proof: the
    connection and every byte sent."""
    from trainguard.core.proof import client_proof, derive, nonce

    host, _, port = sink.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
    cn = nonce()
    first = b"TGLINK2\n" + cn + struct.pack("!H", len(sink)) + sink.encode()
    conn.sendall(first)
    sn = conn.recv(48)[:16]
    rest = struct.pack("!Q", size)
    rest += client_proof(derive(secret, "link"), sn, cn, sink, b"probe" + rest)
    conn.sendall(rest)
    return conn, first + rest


@pytest.mark.parametrize("what", ["another job's secret", "not a probe", "too many bytes", "replayed"])
def test_a_sink_refuses_and_logs_a_connection_that_is_no_probe_of_this_job(sink, caplog, what):
    """Before, the probe's key was one HMAC of the secret, the same in every
    probe: a captured probe could be sent again and again (256 MiB each)."""
    host, _, port = sink.rpartition(":")
    with caplog.at_level(logging.WARNING, logger="trainguard.links"):
        if what == "not a probe":
            conn = socket.create_connection((host, int(port)), timeout=5)
            conn.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(40))
        elif what == "replayed":
            first, sent = _opening(sink, SECRET, 1024)
            first.sendall(bytes(1024))
            first.shutdown(socket.SHUT_WR)
            assert len(first.recv(64)) == 40  # the real probe was counted
            first.close()
            conn = socket.create_connection((host, int(port)), timeout=5)
            conn.sendall(sent + bytes(1024))  # the same bytes again
        else:
            conn, _ = _opening(sink, "another job" if what.startswith("another") else SECRET,
                               MAX_BYTES + 1 if what == "too many bytes" else 1024)
        with conn:
            got = b""
            try:
                while chunk := conn.recv(64):
                    got += chunk
            except ConnectionResetError:  # closed with our bytes unread
                pass
            assert len(got) <= 48, got  # at most the sink's opening: no count
    assert any("link probe from 127.0.0.1 refused" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(OSError, match="did not prove it knows the job secret"):
        measure(sink, "another job", 1024)


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_silent_connections_do_not_keep_real_probes_out(sink, caplog):
    """Before, 8 connections that never sent a byte held all of the sink's
    places for 30 s each: no probe got in for 75 s and more. Now a stranger
    holds at most two places for a few seconds, and never a probe's."""
    host, _, port = sink.rpartition(":")
    silent = [socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
              for _ in range(12)]
    try:
        with caplog.at_level(logging.WARNING, logger="trainguard.links"):
            assert measure(sink, SECRET, 1 << 20) > 0  # at once, from another address
        assert "too many connections still proving the secret" in caplog.text
        assert sum(_closed(c) for c in silent[2:]) == 10  # the ones past two were closed unread
    finally:
        for c in silent:
            c.close()


def test_an_unreachable_sink_is_an_error_in_the_answer_not_a_crash():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    (node, rate, error), = probe_peers(["gone"], [f"127.0.0.1:{port}"], SECRET, 1024)
    assert node == "gone" and rate == 0.0 and "ConnectionRefusedError" in error


def _survey(rates: dict[tuple[str, str], float]) -> LinkSurvey:
    survey = LinkSurvey({n: f"{n}:1" for pair in rates for n in pair})
    for node, peers in survey.plan().items():
        survey.add(node, [(p, rates[(node, p)], "") for p in peers])
    return survey


def test_the_survey_names_the_host_every_link_of_which_is_slow():
    fast, slow = 900e6, 2.4e6
    survey = _survey({("a", "b"): fast, ("a", "c"): slow, ("b", "c"): slow, ("b", "a"): fast,
                      ("c", "a"): slow, ("c", "b"): slow})
    assert survey.plan() == {"a": ["b", "c"], "b": ["c", "a"], "c": ["a", "b"]}
    assert survey.done
    node, why = survey.verdict()
    assert node == "c" and "the link of c is slow" in why and "2.4 MB/s" in why


def test_the_survey_names_no_host_when_the_links_are_alike_or_there_are_two():
    survey = _survey({(a, b): 900e6 * (1 + 0.1 * i) for i, (a, b) in enumerate(
        [("a", "b"), ("a", "c"), ("b", "c"), ("b", "a"), ("c", "a"), ("c", "b")])})
    assert survey.verdict()[0] is None
    two = _survey({("a", "b"): 900e6, ("b", "a"): 1e6})
    node, why = two.verdict()
    assert node is None and "cannot be told from its other end" in why


def test_the_controller_orders_a_survey_and_names_the_slow_host_from_the_answers():
    from trainguard.core.control.agents import AgentTable

    table, sent, verdicts, now = AgentTable(0), [], [], [0.0]
    surveyor = Surveyor(table.order, lambda node, order: sent.append((node, order)), clock=lambda: now[0],
                        on_verdict=verdicts.append)
    sinks = {"a": "10.0.0.1:5", "b": "10.0.0.2:5", "c": "10.0.0.3:5"}
    assert surveyor.start(sinks, "a job-wide slowdown")
    assert not surveyor.start(sinks, "again")  # one at a time
    assert {n: (list(o.action.nodes), list(o.action.addrs)) for n, o in sent} == {
        "a": (["b", "c"], ["10.0.0.2:5", "10.0.0.3:5"]), "b": (["c", "a"], ["10.0.0.3:5", "10.0.0.1:5"]),
        "c": (["a", "b"], ["10.0.0.1:5", "10.0.0.2:5"])}
    orders = {n: o.id for n, o in sent}
    assert not surveyor.answer(orders["a"], "b", [])  # another node's order: not taken
    rate = {"a": {"b": 900e6, "c": 3e6}, "b": {"c": 3e6, "a": 900e6}, "c": {"a": 3e6, "b": 3e6}}
    for node in ("a", "b"):
        assert surveyor.answer(orders[node], node, [(p, r, "") for p, r in rate[node].items()])
    assert verdicts == []
    assert surveyor.answer(orders["c"], "c", [(p, r, "") for p, r in rate["c"].items()])
    (verdict,) = verdicts
    assert verdict["slow_node"] == "c" and surveyor.survey is None


def test_a_survey_an_agent_never_answers_ends_with_what_it_has():
    from trainguard.core.control.agents import AgentTable

    table, sent, verdicts, now = AgentTable(0), [], [], [0.0]
    surveyor = Surveyor(table.order, lambda node, order: sent.append((node, order)), clock=lambda: now[0],
                        timeout_s=60, on_verdict=verdicts.append)
    surveyor.start({"a": "x:1", "b": "y:1", "c": "z:1"}, "test")
    orders = {n: o.id for n, o in sent}
    surveyor.answer(orders["a"], "a", [("b", 900e6, ""), ("c", 0.0, "timed out")])
    now[0] = 59
    surveyor.tick()
    assert verdicts == []
    now[0] = 61
    surveyor.tick()
    (verdict,) = verdicts
    assert "no answer from ['b', 'c']" in verdict["reason"] and verdict["errors"] == {"a->c": "timed out"}


def _row(step: int, step_s: float, comm_s: float) -> StepRow:
    return StepRow(step, step_s=step_s, fp_s=0.01, data_s=0.001, comm_spans=[(0.0, comm_s)], has_step=True)


def test_a_slowdown_of_communication_alone_is_a_job_wide_finding():
    """With Communication markers on, a slow link leaves every rank's
    compute as it was and lengthens every rank's wait alike: no rank is
    named, and the step series says the job slowed down (which starts the
    link survey)."""
    c = DetectorConfig(warmup_steps=2, baseline_steps=10, consecutive=3)
    det = Detector([0, 1, 2], c)
    found = []
    for step in range(80):
        wait = 0.02 if step < 40 else 0.5
        found += det.feed(step, {r: _row(step, 0.1 + wait, wait) for r in range(3)})
    (finding,) = found
    assert (finding.rank, finding.how, finding.metric) == (None, "job-wide", "step")
    assert "communication did" in finding.reason and finding.step >= 40


def test_a_job_wide_slowdown_that_comes_back_is_reported_again():
    """A passing slowdown (a busy machine early on) must not hide the next
    one: once the steps stayed normal for a short window, a new job-wide
    slowdown is a new finding (and a new link survey)."""
    c = DetectorConfig(warmup_steps=2, baseline_steps=10, consecutive=3)
    det = Detector([0, 1, 2], c)
    found = []
    for step in range(200):
        wait = 0.5 if 40 <= step < 50 or step >= 150 else 0.02
        found += det.feed(step, {r: _row(step, 0.1 + wait, wait) for r in range(3)})
    assert [(f.how, f.metric) for f in found] == [("job-wide", "step")] * 2
    assert 40 <= found[0].step < 60 and found[1].step >= 150


def test_an_agent_s_answer_or_hello_cannot_bend_the_survey():
    """Rates for links it was not asked about, non-finite or negative ones
    are no evidence; a hello naming a sink that is no host:port leaves that
    agent out of the survey (and says so)."""
    survey = LinkSurvey({"a": "a:1", "b": "b:1", "c": "c:1"})
    survey.add("a", [("b", float("nan"), ""), ("c", -5.0, ""), ("z", 1e12, ""), ("a", 1e12, "")])
    assert survey.rates == {} and set(survey.errors) == {("a", "b"), ("a", "c")}
    from trainguard.core.agent_messages import AgentHello
    from trainguard.core.control.agents import AgentTable

    table = AgentTable(0)
    table.hello("good", AgentHello(ranks=(0,), probe="10.0.0.1:4000"))
    table.hello("v6", AgentHello(ranks=(1,), probe="[fd00::1]:4000"))
    table.hello("bad", AgentHello(ranks=(2,), probe="10.0.0.3:4000/../x"))
    table.hello("none", AgentHello(ranks=(3,)))
    assert table.sinks() == {"good": "10.0.0.1:4000", "v6": "[fd00::1]:4000"}


def test_a_slowdown_of_compute_does_not_hide_one_of_communication_that_follows():
    """CI saw a job-wide slowdown of compute (a busy machine) just before
    the link slowed: one shared "going on" flag then kept the communication
    slowdown from being reported, and no link survey ran."""
    c = DetectorConfig(warmup_steps=2, baseline_steps=10, consecutive=3)
    det = Detector([0, 1, 2], c)
    found = []
    for step in range(120):
        busy = 0.035 if step >= 40 else 0.0  # compute 35% slower for good (a busy machine; steps 29%) ...
        wait = 0.5 if step >= 60 else 0.02  # ... then communication much slower
        found += det.feed(step, {r: _row(step, 0.1 + busy + wait, wait) for r in range(3)})
    assert [(f.how, f.metric) for f in found] == [("job-wide", "compute"), ("job-wide", "step")]
    assert 40 <= found[0].step < 60 <= found[1].step
