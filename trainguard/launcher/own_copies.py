"""Bringing a lost host's rank's own part to the node that starts it again.

Each node agent mirrors its ranks' own-part record files (random streams,
data position) to the next node's peer server
(:class:`trainguard.core.snapshot.own_peer.OwnMirror`). When a host is lost
and ``recover`` starts one of its ranks on another node, that node's agent
fetches the copy from the lost node's next node before the new process
runs, and puts it where the process reads its predecessor's record.
"""

from __future__ import annotations

import logging
from typing import Any

from trainguard.core.snapshot.own import install_own, own_steps
from trainguard.core.snapshot.own_peer import fetch_own

__all__ = ["fetch_into"]

log = logging.getLogger("trainguard.launcher")

#: The rendezvous store's key of the round's id (the agent's ``_ROUND_KEY``).
ROUND_KEY = "trainguard/round"


def fetch_into(group: Any, directory: Any, token: str, rank: int, step: int) -> str | None:
    """Fetch ``rank``'s own-part record of ``step`` from the host that keeps
    its copy (the next node after its home node, whose peer server's address
    is in the rendezvous store) into ``directory``.

    Returns:
        ``None`` when the record is in place (or a job of one node, where the
        rank restarts on its own node), else why it cannot be had.
    """
    nodes = group.group_world_size
    if nodes < 2 or directory is None:
        return None
    home = rank // group.spec.local_world_size  # torch gives every node local_world_size consecutive ranks
    what = f"rank {rank}'s random streams and data position at step {step}"
    try:
        key = f"trainguard/peer/{group.store.get(ROUND_KEY).decode()}/{(home + 1) % nodes}"
        if not group.store.check([key]):
            return f"no host kept a copy of {what}"
        raw = fetch_own(group.store.get(key).decode(), rank=rank, token=token)
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"the copy of {what} could not be fetched: {e}"
    if raw is None or step not in own_steps(raw):
        held = own_steps(raw) if raw is not None else []
        return (f"no copy of {what} survived on another host (the copy holds steps {held}); starting it "
                f"would go on from its seed, not as the fault-free run")
    install_own(directory.path, rank, raw)
    log.info("took the copy of %s from node %d's peer host", what, home)
    return None
