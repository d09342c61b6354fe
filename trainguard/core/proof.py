"""Proving the job secret both ways without sending it.

Every channel of a job (the control plane's gRPC calls, the peer-snapshot
stream, the link probe) opens with the same exchange, under a key derived
from the job secret for that channel (:func:`derive`):

1. the client sends a fresh nonce ``cn`` and the address it dialed;
2. the server refuses an address that is not its own (:class:`Names`),
   else answers a fresh nonce ``sn`` and :func:`server_proof` of
   ``(cn, sn, address)``: a server that does not know the secret cannot
   make it, so the client learns it reached its job's server before it
   sends anything that could open that server;
3. the client answers :func:`client_proof` of ``(sn, cn, address, what)``.

Both nonces make each proof good for one exchange: a captured one is
worthless to a later session (the server's nonce is used once) and to
another server (it never issued that nonce). The address stops a relay:
a server that an address read from the unauthenticated rendezvous store
steered a client to receives a proof bound to *its* address, which the
real server refuses, and the real server's answer to a relayed first step
is bound to the real address, which the client refuses. Under mutual TLS
the certificates prove the endpoints and the address is not compared (so
a proxy or port-forward in front of the controller works there).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from functools import lru_cache

__all__ = ["NONCE_BYTES", "Admission", "Names", "Nonces", "client_proof", "derive", "nonce", "server_proof", "split_address"]

NONCE_BYTES = 16
MAX_ADDRESS = 300
_WILDCARD = frozenset({"", "0.0.0.0", "::", "*"})


def derive(secret: str, channel: str) -> bytes:
    """The key of ``channel`` (``control``, ``peer``, ``link``...), never the secret itself."""
    return hmac.new(secret.encode(), b"trainguard/" + channel.encode() + b"/v1", hashlib.sha256).digest()


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _fields(*parts: bytes) -> bytes:
    return b"".join(struct.pack("!H", len(p)) + p for p in parts)  # lengths first: no two inputs alike


@lru_cache(maxsize=16)
def _keyed(key: bytes) -> "hmac.HMAC":
    """HMAC-SHA256 with ``key`` mixed in and nothing else: each proof starts from a copy (the key schedule is
    computed once per key, not once per proof; a job has a handful of keys, one per channel)."""
    return hmac.new(key, digestmod=hashlib.sha256)


def _mac(key: bytes, data: bytes) -> bytes:
    h = _keyed(key).copy()
    h.update(data)
    return h.digest()


def server_proof(key: bytes, cn: bytes, sn: bytes, address: str) -> bytes:
    """The server's answer to ``cn``: it knows ``key``, for this exchange, at ``address``."""
    return _mac(key, b"server\0" + _fields(cn, sn, address.encode()))


def client_proof(key: bytes, sn: bytes, cn: bytes, address: str, what: bytes = b"") -> bytes:
    """The client's answer to ``sn``, for ``what`` (the call it opens, the request it makes)."""
    return _mac(key, b"client\0" + _fields(sn, cn, address.encode(), what))


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``[v6]:port``; ``None`` for anything else."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None
    if not host.isprintable() or any(c.isspace() for c in host):
        return None
    return host.lower(), int(port)


class Names:
    """Whether an address a client dialed reaches this server and no one
    else: the server's port, and a host whose every address is one the
    server holds that port on -- the addresses its host name resolves to,
    or, bound to every interface, any address of this machine of that
    family (a wildcard bind keeps everyone else off the port, 127.0.0.2
    included). ``localhost`` for a server bound to 127.0.0.1 is refused:
    it also resolves to ``::1``, where another user may listen.

    Args:
        host: the host the server bound (``0.0.0.0``: every IPv4 interface, ``::``: every one).
        port: the port it bound.
    """

    def __init__(self, host: str, port: int) -> None:
        self.port = port
        self.host = host.strip("[]").lower()
        self.wildcard = self.host in _WILDCARD
        self.versions = (4,) if self.host == "0.0.0.0" else (4, 6)
        self._bound = set() if self.wildcard else self._resolve(self.host)
        self._cache: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, address: str) -> bool:
        return address in self._cache

    def problem(self, address: str) -> str | None:
        """Why ``address`` is not this server's (``None``: it is). May resolve a name (blocking)."""
        with self._lock:
            if address in self._cache:
                return self._cache[address]
        why = self._problem(address)
        with self._lock:
            self._cache[address] = why
            while len(self._cache) > 256:
                self._cache.popitem(last=False)
        return why

    def _problem(self, address: str) -> str | None:
        parsed = split_address(address)
        if parsed is None:
            return f"{address[:80]!r} is not a host:port address"
        host, port = parsed
        if port != self.port:
            return f"{address} names port {port}; this server listens on port {self.port}"
        if host == self.host:
            return None
        ips = self._resolve(host)
        if ips and all(self._ours(ip) for ip in ips):
            return None
        return (f"{address} is not only this server's (it listens on {self.host or '*'}:{self.port}; "
                f"{host} resolves to {sorted(ips)[:4] or 'nothing'})")

    def _ours(self, ip: str) -> bool:
        if not self.wildcard:
            return ip in self._bound
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
        if addr.version not in self.versions:
            return False
        family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
        try:  # an address this machine holds can be bound; another host's cannot
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
            return True
        except OSError:
            return False

    @staticmethod
    def _resolve(host: str) -> set[str]:
        try:
            return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        except (OSError, UnicodeError):
            return set()


class Nonces:
    """The nonces a server issued and not yet seen used: each good once,
    for ``ttl_s``; past ``cap`` outstanding the oldest are forgotten (a
    flood of first steps costs a client that waited that long a retry)."""

    def __init__(self, cap: int = 4096, ttl_s: float = 30.0, clock=time.monotonic) -> None:
        self.cap, self.ttl_s, self.clock = cap, ttl_s, clock
        self._issued: OrderedDict[bytes, tuple[float, bytes, str]] = OrderedDict()

    def issue(self, cn: bytes, address: str) -> bytes:
        sn = nonce()
        self._issued[sn] = (self.clock() + self.ttl_s, cn, address)
        while len(self._issued) > self.cap:
            self._issued.popitem(last=False)
        return sn

    def take(self, sn: bytes) -> tuple[bytes, str] | None:
        """``(cn, address)`` of an issued, unexpired nonce, which is used up; else ``None``."""
        entry = self._issued.pop(sn, None)
        if entry is None or entry[0] < self.clock():
            return None
        return entry[1], entry[2]


class Admission:
    """Connections that have not proved the secret yet: at most
    ``per_host`` from one address and ``total`` in all, so a few silent or
    trickling sockets cannot take the places of real peers (which hold
    places of their own once they proved it)."""

    def __init__(self, per_host: int = 2, total: int = 16) -> None:
        self.per_host, self.total = per_host, total
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, host: str) -> bool:
        with self._lock:
            if self._open.get(host, 0) >= self.per_host or sum(self._open.values()) >= self.total:
                return False
            self._open[host] = self._open.get(host, 0) + 1
            return True

    def leave(self, host: str) -> None:
        with self._lock:
            left = self._open.get(host, 0) - 1
            if left > 0:
                self._open[host] = left
            else:
                self._open.pop(host, None)
