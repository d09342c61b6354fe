"""What a node agent serves to the other nodes, beside its relay: the node's
snapshot directory with the server keeping the previous node's copies
(:mod:`trainguard.core.snapshot.peer`), the mirror of its ranks' own-part
records to the next node (:mod:`trainguard.core.snapshot.own_peer`), and
the link-probe sink (:mod:`trainguard.core.links`).

Where the next node's server is comes from the rendezvous store, which
anyone who reaches it may write: it is a hint. A value that is no address
is dropped here (logged); a server there that cannot prove the job secret
gets nothing from a push and gives nothing to a fetch (the persist worker
logs the failed copy), so a forged value costs the job its peer copies for
the round, never a snapshot.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable

from trainguard.core.config_launch import LaunchConfig
from trainguard.core.links import LinkSink
from trainguard.core.proof import split_address
from trainguard.core.snapshot import PeerServer, SnapshotDir
from trainguard.core.snapshot.own_peer import OwnMirror

__all__ = ["NodeServers"]

log = logging.getLogger("trainguard.launcher")

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class NodeServers:
    """Args: the job id, the launcher's settings (the snapshot root), the
    job secret, the controller's host setting (loopback keeps every server
    on loopback) and the ranks whose own-part records this node mirrors
    (called each time it looks)."""

    def __init__(self, job_id: str, launch: LaunchConfig, secret: str, controller_host: str,
                 mirrored_ranks: Callable[[], list[int]] = list) -> None:
        self.job_id, self.launch, self.secret, self.controller_host = job_id, launch, secret, controller_host
        self.mirrored_ranks = mirrored_ranks
        self.snapshot_dir: SnapshotDir | None = None
        self.peer_server: PeerServer | None = None
        self.own_mirror: OwnMirror | None = None
        self.link_sink: LinkSink | None = None
        self._sink_port = ""

    def addresses(self, local_addr: str | None) -> tuple[str, str]:
        """Where this node's servers listen, and the address the others
        reach this host at (torchrun's --local-addr, when given)."""
        if self.controller_host in _LOOPBACK:
            return "127.0.0.1", "127.0.0.1"
        return "0.0.0.0", local_addr or socket.getfqdn()

    def snapshots(self, worker_group: Any, store: Any, round_key: str) -> None:
        """The node's snapshot directory (kept across rounds, so restarted
        workers find their snapshots) and, with several nodes, the server
        keeping the previous node's copies; the workers learn both from the
        environment."""
        if self.snapshot_dir is None:  # one per agent: a replacement node may share a host with another
            self.snapshot_dir = SnapshotDir.create(f"{self.job_id}-{os.getpid()}", self.launch.snapshot_root)
        os.environ["TRAINGUARD_SNAPSHOT_DIR"] = str(self.snapshot_dir.path)
        nodes, me = worker_group.group_world_size, worker_group.group_rank
        os.environ.pop("TRAINGUARD_SNAPSHOT_PEER", None)
        if nodes < 2:
            return
        bind, here = self.addresses(worker_group.spec.local_addr)
        if self.peer_server is None:
            self.peer_server = PeerServer(self.snapshot_dir, self.secret, bind)
            self.peer_server.start()
        port = self.peer_server.address.rsplit(":", 1)[1]
        # Keyed by this round's id, so a value left by a node of an earlier
        # round (one that was lost) is never read.
        key = f"trainguard/peer/{store.get(round_key).decode(errors='replace')}"
        store.set(f"{key}/{me}", f"{here}:{port}")
        peer = store.get(f"{key}/{(me + 1) % nodes}").decode(errors="replace")
        if split_address(peer) is None:
            log.warning("the next node's snapshot server in the rendezvous store (%r) is no host:port address: "
                        "no peer copies this round", peer[:100])
            return
        os.environ["TRAINGUARD_SNAPSHOT_PEER"] = peer
        if self.own_mirror is None:  # this node's ranks' own-part records, copied to the next node (own_peer.py)
            self.own_mirror = OwnMirror(self.snapshot_dir.path, self.mirrored_ranks,
                                        lambda: os.environ.get("TRAINGUARD_SNAPSHOT_PEER"), lambda: self.secret)
            self.own_mirror.start()

    def sink(self, worker_group: Any) -> str:
        """With several nodes, this node's link-probe sink: its address, or ""."""
        if worker_group.group_world_size < 2:
            return ""
        bind, here = self.addresses(worker_group.spec.local_addr)
        if self.link_sink is None:
            self.link_sink = LinkSink(bind, self.secret)
            self._sink_port = self.link_sink.start().rsplit(":", 1)[1]
        return f"{here}:{self._sink_port}"

    def close(self) -> None:
        """Stop the servers and remove the node's snapshots."""
        if self.own_mirror is not None:
            self.own_mirror.stop()
            self.own_mirror = None
        if self.peer_server is not None:
            self.peer_server.stop()
            self.peer_server = None
        if self.link_sink is not None:
            self.link_sink.stop()
            self.link_sink = None
        if self.snapshot_dir is not None:
            self.snapshot_dir.remove()
            self.snapshot_dir = None
