"""Which host's network link is slow: a probe between the node agents.

A slow link slows every rank of a synchronous job alike -- each waits for
the same all-reduce -- so the step records (:mod:`.profiling`) can say only
that the whole job slowed down. When they do, the controller asks the node
agents to measure their links to each other:

* every agent serves a :class:`LinkSink` on its own address. A probe opens
  with the mutual proof of :mod:`.proof`: the prober sends a fresh nonce
  and the address it dialed, the sink answers its own nonce and its proof
  of the job's secret, the prober answers with its proof bound to both
  nonces and the size it will send (good for this one probe: a captured
  probe cannot be sent again). Anything else is refused, logged, and closed
  before a byte more is read; a connection that has not proved the secret
  holds one of a few places (two per address) for at most
  :data:`HANDSHAKE_S`, never a real probe's. The sink then reads what comes
  until the sender closes its side (at most the size announced, itself at
  most :data:`MAX_BYTES`, within :data:`_TIMEOUT_S`) and answers how many
  bytes arrived, with its proof of that count;
* a :class:`LinkSurvey` orders each agent to probe the next two agents (all
  pairs of three hosts, a ring beyond); :func:`measure` sends for
  :data:`PROBE_S` (or :data:`PROBE_BYTES`, whichever comes first: a slow
  link costs half a second, a fast one a few milliseconds), and the agents
  answer with the rates that arrived;
* the verdict names the host whose *best* link is several times slower than
  the other hosts' best: every link that touches a slow host is slow, and
  every other host has at least one fast link. Two hosts cannot be told
  apart (their one link is both's); the survey says so.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from .agent_messages import AgentEvent, AgentOrder, LinkProbe, LinkRate
from .proof import Admission, Names, client_proof, derive, nonce, server_proof, split_address

__all__ = ["LinkSink", "LinkSurvey", "Surveyor", "answer_probe", "measure", "probe_peers", "PROBE_BYTES",
           "MAX_BYTES", "HANDSHAKE_S"]

log = logging.getLogger("trainguard.links")

PROBE_S = 0.5  # a probe sends for this long at most ...
PROBE_BYTES = 64 << 20  # ... or this much: 6 ms at 10 GB/s
MAX_BYTES = 256 << 20  # a sink reads no more than this from one connection
_SEND_BUFFER = 64 << 10  # small: what sits in the sender's buffer when it stops must drain within the timing
SLOWER = 4.0  # a host's best link this many times slower than the others' median best is named
_MAGIC = b"TGLINK2\n"
_TIMEOUT_S = 30.0  # an authenticated probe's bytes, at most this long
HANDSHAKE_S = 3.0  # a connection that has not proved the secret, at most this long
_MAX_CONNECTIONS = 8  # authenticated probes at once
_CHUNK = 1 << 16


_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):\d{1,5}$")


def sink_address(text: str) -> str:
    """``text`` when it is a plain ``host:port`` (an agent's hello names its sink), else ""."""
    return text if len(text) <= 300 and _ADDRESS.match(text) else ""


def _count_proof(key: bytes, sn: bytes, cn: bytes, count: int) -> bytes:
    return hmac.new(key, b"count\0" + sn + cn + struct.pack("!Q", count), hashlib.sha256).digest()


class LinkSink:
    """A node agent's end of the link probe.

    Args:
        host: the address to listen on (the agent's own, ``--local-addr``).
        secret: the job's secret (``TRAINGUARD_TOKEN``).
    """

    def __init__(self, host: str, secret: str) -> None:
        self._key = derive(secret, "link")
        self._sock = socket.create_server((host, 0))
        self._host = host
        self._names = Names(host, self._sock.getsockname()[1])
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._unproven = Admission(per_host=2, total=16)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="trainguard-link-sink", daemon=True)

    def start(self) -> str:
        """Serve; returns ``host:port`` for probers."""
        self._thread.start()
        return f"{self._host}:{self._sock.getsockname()[1]}"

    def stop(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not self._unproven.enter(peer[0]):
                log.warning("link probe from %s refused: too many connections still proving the secret", peer[0])
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="trainguard-link-probe",
                             daemon=True).start()

    def _prove(self, conn: socket.socket, peer: tuple) -> tuple[bytes, bytes, int] | None:
        """The exchange of proofs, by :data:`HANDSHAKE_S`: ``(sn, cn, size)`` of a probe of this job, else ``None``
        (logged)."""
        deadline = time.monotonic() + HANDSHAKE_S
        head = _read(conn, len(_MAGIC) + 16 + 2, deadline)
        why = "not a link probe (or another trainguard version's)"
        if head is not None and head[:len(_MAGIC)] == _MAGIC:
            cn, (n,) = head[len(_MAGIC):-2], struct.unpack("!H", head[-2:])
            dialed = (_read(conn, n, deadline) or b"").decode(errors="replace") if n <= 300 else ""
            why = self._names.problem(dialed) or ""
            if not why:
                sn = nonce()
                conn.sendall(sn + server_proof(self._key, cn, sn, dialed))
                answer = _read(conn, 8 + 32, deadline)
                size = struct.unpack("!Q", answer[:8])[0] if answer is not None else 0
                if answer is None or not hmac.compare_digest(
                        answer[8:], client_proof(self._key, sn, cn, dialed, b"probe" + answer[:8])):
                    why = "no proof of this job's secret for this probe (another job's, or replayed)"
                elif size > MAX_BYTES:
                    why = f"{size} bytes is over {MAX_BYTES}"
                else:
                    return sn, cn, size
        log.warning("link probe from %s refused: %s", peer[0], why)
        return None

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        proved = None
        with conn:
            try:
                proved = self._prove(conn, peer)
            except (OSError, ValueError) as e:
                log.debug("link probe from %s ended: %s", peer[0], e)
            finally:
                self._unproven.leave(peer[0])
            if proved is None:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("link probe from %s refused: %d probes already running", peer[0], _MAX_CONNECTIONS)
                return
            try:
                sn, cn, size = proved
                conn.settimeout(_TIMEOUT_S)
                got, deadline = 0, time.monotonic() + _TIMEOUT_S
                while time.monotonic() < deadline:
                    chunk = conn.recv(_CHUNK)
                    if not chunk:
                        break
                    got += len(chunk)
                    if got > size:
                        log.warning("link probe from %s refused: more than the %d bytes announced", peer[0], size)
                        return
                conn.sendall(struct.pack("!Q", got) + _count_proof(self._key, sn, cn, got))
            except OSError as e:
                log.debug("link probe from %s ended: %s", peer[0], e)
            finally:
                self._slots.release()


def _read(conn: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """``n`` bytes, ``None`` when the peer closes first; by ``deadline`` (monotonic) when given."""
    data = b""
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not complete within {HANDSHAKE_S:g} s")
            conn.settimeout(left)
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def measure(addr: str, secret: str, nbytes: int = PROBE_BYTES, seconds: float = PROBE_S,
            timeout: float = _TIMEOUT_S) -> float:
    """Send to the sink at ``addr`` (``host:port``) for ``seconds`` or
    ``nbytes``, whichever comes first, once the sink proved the job's
    secret; returns the bytes that arrived per second, from the first byte
    sent to the sink's count.

    Raises:
        OSError: the sink cannot be reached, refused, timed out, or could not prove the secret.
    """
    parsed = split_address(addr)
    if parsed is None:
        raise ConnectionError(f"{addr[:80]!r} is not a host:port address")
    nbytes, key, cn = min(nbytes, MAX_BYTES), derive(secret, "link"), nonce()
    payload = bytes(_CHUNK)
    with socket.create_connection(parsed, timeout=timeout) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        conn.sendall(_MAGIC + cn + struct.pack("!H", len(addr.encode())) + addr.encode())
        answer = _read(conn, 16 + 32)
        if answer is None:
            raise ConnectionError(f"the link-probe sink at {addr} refused the probe")
        sn = answer[:16]
        if not hmac.compare_digest(answer[16:], server_proof(key, cn, sn, addr)):
            raise ConnectionError(f"the link-probe sink at {addr} did not prove it knows the job secret")
        size = struct.pack("!Q", nbytes)
        conn.sendall(size + client_proof(key, sn, cn, addr, b"probe" + size))
        start = time.perf_counter()
        left = nbytes
        while left and time.perf_counter() - start < seconds:
            n = min(left, _CHUNK)
            conn.sendall(payload[:n])
            left -= n
        conn.shutdown(socket.SHUT_WR)
        answer = _read(conn, 8 + 32)
        if answer is None:
            raise ConnectionError(f"the link-probe sink at {addr} refused the probe")
        got = struct.unpack("!Q", answer[:8])[0]
        if not hmac.compare_digest(answer[8:], _count_proof(key, sn, cn, got)):
            raise ConnectionError(f"the link-probe sink at {addr} answered a count it did not prove")
    return got / max(time.perf_counter() - start, 1e-9)


@dataclass
class LinkSurvey:
    """One probe round among the node agents (controller side; no I/O).

    Args:
        sinks: node name -> its sink's ``host:port``, for every agent taking part.
    """

    sinks: dict[str, str]
    started: float = field(default_factory=time.time)
    rates: dict[tuple[str, str], float] = field(default_factory=dict)  # (from, to) -> bytes/s
    errors: dict[tuple[str, str], str] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)

    def plan(self) -> dict[str, list[str]]:
        """Who probes whom: each node the next two (one with two nodes), in name order."""
        nodes = sorted(self.sinks)
        n = len(nodes)
        return {a: [nodes[(i + k) % n] for k in (1, 2) if k < n] for i, a in enumerate(nodes)} if n > 1 else {}

    def add(self, node: str, rates: list[tuple[str, float, str]]) -> None:
        """``node``'s answer: (peer, bytes/s, error) per peer probed."""
        for peer, bps, error in rates:
            if peer not in self.sinks or peer == node:
                continue  # not asked of it: an answer cannot add links
            if error or not math.isfinite(bps) or bps < 0:
                self.errors[(node, peer)] = error[:200] or f"not a rate: {bps}"
            else:
                self.rates[(node, peer)] = bps
        self.answered.add(node)

    @property
    def done(self) -> bool:
        return set(self.plan()) <= self.answered

    def best(self) -> dict[str, float]:
        """Each node's fastest link, either way (0 when all its probes failed)."""
        out = dict.fromkeys(self.sinks, 0.0)
        for (a, b), bps in self.rates.items():
            for node in (a, b):
                out[node] = max(out[node], bps)
        return out

    def verdict(self) -> tuple[str | None, str]:
        """The node whose link is slow (or None), and one line saying why."""
        best = self.best()
        if len(best) < 3:
            return None, (f"{len(best)} node agent(s): a slow link cannot be told from its other end "
                          f"({_rates(best)})")
        slow = min(best, key=best.get)
        others = statistics.median(v for k, v in best.items() if k != slow)
        if best[slow] * SLOWER <= others:
            return slow, (f"the link of {slow} is slow: its fastest link moves {_mb(best[slow])}, the other "
                          f"hosts' fastest {_mb(others)} (median; {_rates(best)})")
        return None, f"no host's link stands out ({_rates(best)})"


def _mb(bps: float) -> str:
    return f"{bps / 1e6:.1f} MB/s"


def _rates(best: dict[str, float]) -> str:
    return ", ".join(f"{k} {_mb(v)}" for k, v in sorted(best.items()))


def probe_peers(nodes: list[str], addrs: list[str], secret: str, nbytes: int) -> list[tuple[str, float, str]]:
    """An agent's part of a survey: measure each link in turn; (node, bytes/s, error) per peer."""
    out = []
    for node, addr in zip(nodes, addrs):
        try:
            out.append((node, measure(addr, secret, nbytes), ""))
        except (OSError, ValueError) as e:
            out.append((node, 0.0, f"{type(e).__name__}: {e}"[:200]))
    return out


def answer_probe(order: AgentOrder, secret: str) -> AgentEvent:
    """A node agent's answer to a survey order (its action a :class:`LinkProbe`): each link measured in turn."""
    probe = order.action
    rates = probe_peers(list(probe.nodes), list(probe.addrs), secret, probe.bytes)
    return AgentEvent(order=order.id, ok=True, rates=tuple(LinkRate(*rate) for rate in rates))


class Surveyor:
    """The controller's side: one survey at a time, its orders and answers,
    and the last verdict (for ``trainguard status`` and the event log).

    Args:
        order: makes an agent order of an action (``AgentTable.order``).
        send: sends an order to a node agent.
        clock: monotonic seconds.
        timeout_s: a survey ends with the answers it has after this long
            (an agent on a frozen host never answers).
        on_verdict: told each survey's verdict (:attr:`last`).
    """

    def __init__(self, order, send, clock=time.monotonic, timeout_s: float = 60.0, on_verdict=None) -> None:
        self._order, self._send, self._clock, self.timeout_s = order, send, clock, timeout_s
        self._on_verdict = on_verdict or (lambda verdict: None)
        self.survey: LinkSurvey | None = None
        self._asked: dict[int, str] = {}  # order id -> node
        self._since = 0.0
        self.last: dict | None = None

    def start(self, sinks: dict[str, str], why: str) -> bool:
        """Order a survey of ``sinks`` (node -> host:port) unless one runs."""
        if self.survey is not None or len(sinks) < 2:
            return False
        self.survey, self._since, self._asked = LinkSurvey(dict(sinks)), self._clock(), {}
        log.info("surveying the links of %d node agents (%s)", len(sinks), why)
        for node, peers in self.survey.plan().items():
            order = self._order(LinkProbe(nodes=tuple(peers), addrs=tuple(sinks[p] for p in peers), bytes=PROBE_BYTES))
            self._asked[order.id] = node
            self._send(node, order)
        return True

    def answer(self, order_id: int, node: str, rates: Sequence[tuple[str, float, str]]) -> bool:
        """An agent's answer; False when ``order_id`` is no survey order of ``node``'s."""
        if self._asked.get(order_id) != node or self.survey is None:
            return False
        del self._asked[order_id]
        self.survey.add(node, rates)
        if self.survey.done:
            self._conclude()
        return True

    def tick(self) -> None:
        if self.survey is not None and self._clock() - self._since > self.timeout_s:
            self._conclude()

    def _conclude(self) -> None:
        survey, self.survey, self._asked = self.survey, None, {}
        node, why = survey.verdict()
        missing = sorted(set(survey.plan()) - survey.answered)
        if missing:
            why += f"; no answer from {missing[:8]}"
        self.last = {"slow_node": node, "reason": why, "at": time.time(),
                     "best_bytes_per_s": survey.best(),
                     "errors": {f"{a}->{b}": e for (a, b), e in survey.errors.items()}}
        self._on_verdict(self.last)
