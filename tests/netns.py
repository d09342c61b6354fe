"""Test hosts: network namespaces on this machine, each with its own address.

:class:`Hosts` builds N hosts: one network namespace each (loopback up), a
veth pair per host whose outer end sits on a Linux bridge in the root
namespace, and an address ``10.R.0.<i+1>/24`` per host (``R`` unique per
set). Commands run in a host with ``ip netns exec`` (:meth:`Hosts.popen`).
Faults: :meth:`kill_host` (SIGKILL every process of the namespace),
:meth:`freeze_host` / :meth:`thaw_host` (SIGSTOP / SIGCONT them),
:meth:`link_down` / :meth:`link_up` (a partition), :meth:`netem` (a slow
link). :meth:`close` always kills every process of every host and removes
the namespaces, veths and bridge; the ``hosts`` fixture calls it whatever
the test's outcome, and an ``atexit`` hook does for scripts (the benchmark).

Names carry this process's pid and a counter, so test processes running
side by side never collide. Needs root and ``ip`` (iproute2); :func:`why_not`
says why hosts cannot be built here (tests skip with that reason).

The namespaces share the machine's hostname, which resolves to loopback
here: a program that advertises its own address to peers must be told it
(torchrun's ``--local-addr``; gloo's ``GLOO_SOCKET_IFNAME=eth0``).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import time

__all__ = ["Hosts", "why_not", "NetemUnavailable"]

_counter = itertools.count()
IFNAME = "eth0"  # the host's end of its veth, inside its namespace


class NetemUnavailable(RuntimeError):
    """The kernel has no ``netem`` queueing discipline (``CONFIG_NET_SCH_NETEM``)."""


def why_not() -> str | None:
    """Why hosts cannot be built on this machine, or None."""
    if os.geteuid() != 0:
        return "network-namespace test hosts need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network-namespace test hosts need iproute2's `ip` (apt-get install iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netem_available() -> bool:
    """Whether this kernel has ``netem`` (some VM kernels are built without it)."""
    ns = f"tgq{os.getpid()}{next(_counter)}"
    _ip("netns", "add", ns)
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True)
        return r.returncode == 0
    finally:
        _ip("netns", "del", ns, check=False)


class Hosts:
    """``n`` hosts; ``hosts.addr[i]`` is host i's address, ``hosts.name[i]`` its namespace."""

    def __init__(self, n: int = 3) -> None:
        reason = why_not()
        if reason:
            raise RuntimeError(reason)
        k = next(_counter)
        pid = os.getpid()
        self.n = n
        self.subnet = 20 + (pid * 31 + k) % 200  # cosmetic: each bridge is its own network anyway
        tag = f"{pid % 100000}x{k % 100}"  # interface names: 15 characters at most
        self.bridge = f"tgb{tag}"
        self.name = [f"tg-{pid}-{k}-h{i}" for i in range(n)]
        self.veth = [f"tgv{tag}h{i}" for i in range(n)]  # the root namespace's end
        self.addr = [f"10.{self.subnet}.0.{i + 1}" for i in range(n)]
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        atexit.register(self.close)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i in range(n):
                _ip("netns", "add", self.name[i])
                _ip("link", "add", self.veth[i], "type", "veth", "peer", "name", IFNAME, "netns", self.name[i])
                _ip("link", "set", self.veth[i], "master", self.bridge, "up")
                self.exec(i, "ip", "addr", "add", f"{self.addr[i]}/24", "dev", IFNAME)
                self.exec(i, "ip", "link", "set", IFNAME, "up")
                self.exec(i, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ commands
    def exec(self, i: int, *cmd: str) -> str:
        """Run ``cmd`` in host ``i`` to completion; its stdout (raises on failure)."""
        r = subprocess.run(["ip", "netns", "exec", self.name[i], *cmd], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"host {i}: {' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in host ``i`` (``subprocess.Popen`` keyword arguments
        pass through); ended by :meth:`close` at the latest."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.name[i], *cmd], **kwargs)
        self._procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process of host ``i``."""
        out = _ip("netns", "pids", self.name[i], check=False).stdout
        return [int(p) for p in out.split()]

    # -------------------------------------------------------------- faults
    def _signal(self, i: int, sig: int) -> list[int]:
        hit = []
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
                hit.append(pid)
            except ProcessLookupError:
                pass
        return hit

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process of host ``i`` (the host is lost); the pids hit.
        Repeats until none is left (a process may fork meanwhile)."""
        hit: list[int] = []
        deadline = time.time() + 10
        while time.time() < deadline:
            now = self._signal(i, signal.SIGKILL)
            if not now:
                break
            hit += [p for p in now if p not in hit]
            time.sleep(0.05)
        return hit

    def freeze_host(self, i: int) -> list[int]:
        """SIGSTOP every process of host ``i`` (a frozen host); the pids hit."""
        return self._signal(i, signal.SIGSTOP)

    def thaw_host(self, i: int) -> list[int]:
        return self._signal(i, signal.SIGCONT)

    def link_down(self, i: int) -> None:
        """Cut host ``i`` off the network (its veth's outer end down): a partition."""
        _ip("link", "set", self.veth[i], "down")

    def link_up(self, i: int) -> None:
        _ip("link", "set", self.veth[i], "up")

    def netem(self, i: int, delay: str | None = "50ms", rate: str | None = "10mbit") -> str:
        """Slow host ``i``'s link, both ways: ``tc netem delay DELAY rate
        RATE`` on both ends of its veth. Raises :class:`NetemUnavailable`
        on a kernel without netem. Returns the qdisc set."""
        args = ["netem"] + (["delay", delay] if delay else []) + (["rate", rate] if rate else [])
        outer = subprocess.run(["tc", "qdisc", "replace", "dev", self.veth[i], "root", *args],
                               capture_output=True, text=True)
        if outer.returncode:
            if "unknown" in outer.stderr.lower():
                raise NetemUnavailable(f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): {outer.stderr.strip()}")
            raise RuntimeError(f"tc on {self.veth[i]}: {outer.stderr.strip()}")
        self.exec(i, "tc", "qdisc", "replace", "dev", IFNAME, "root", *args)
        return " ".join(args)

    def rate_limit(self, i: int, rate: str = "10mbit") -> str:
        """Limit host ``i``'s link, both ways, with a token bucket (``tbf``):
        for kernels without netem (no added delay). Returns the qdisc set."""
        args = ["tbf", "rate", rate, "burst", "16kb", "latency", "200ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.veth[i], "root", *args], check=True,
                       capture_output=True, text=True)
        self.exec(i, "tc", "qdisc", "replace", "dev", IFNAME, "root", *args)
        return " ".join(args)

    def unlimit(self, i: int) -> None:
        """Take :meth:`rate_limit` (or :meth:`netem`) off host ``i``'s link."""
        subprocess.run(["tc", "qdisc", "del", "dev", self.veth[i], "root"], check=True, capture_output=True, text=True)
        self.exec(i, "tc", "qdisc", "del", "dev", IFNAME, "root")

    # ------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Kill every process of every host, then remove namespaces, veths
        and bridge. Safe to call twice; runs every step whatever fails."""
        if self._closed:
            return
        self._closed = True
        for i in range(self.n):
            try:
                self._signal(i, signal.SIGCONT)  # a stopped process dies of SIGKILL too; its parent waits
                self.kill_host(i)
            except Exception:
                pass
        for proc in self._procs:
            try:
                proc.kill()
                proc.wait(timeout=10)
            except Exception:
                pass
        for i in range(self.n):
            _ip("netns", "del", self.name[i], check=False)
            _ip("link", "del", self.veth[i], check=False)  # gone with its peer's namespace, normally
        _ip("link", "del", self.bridge, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def leftovers() -> list[str]:
    """Namespaces and links of this process's hosts still present (for tests of the fixture)."""
    mine = f"tg-{os.getpid()}-"
    names = [x.split()[0] for x in _ip("netns", "list", check=False).stdout.splitlines() if x.startswith(mine)]
    links = [x for x in _ip("-o", "link", "show", check=False).stdout.splitlines()
             if f"tgb{os.getpid() % 100000}x" in x or f"tgv{os.getpid() % 100000}x" in x]
    return names + links


if __name__ == "__main__":  # a quick look: build, show, remove
    with Hosts(3) as h:
        for i in range(h.n):
            print(h.name[i], h.addr[i], h.exec(i, "ip", "-o", "-4", "addr", "show", IFNAME).split()[3])
    print("left:", leftovers() or "nothing")
