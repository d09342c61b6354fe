"""The stores of a rendezvous round, as torch 2.13's c10d rendezvous leaves
them and as a restarted round's workers need them."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

__all__ = ["fresh_worker_store", "publish_bootstrap"]

_WORKER_STORE_KEY = "trainguard/worker_store_port"


def publish_bootstrap(store: Any, spec: Any) -> None:
    """Node 0: publish the shared store's address (``MASTER_ADDR`` /
    ``MASTER_PORT``) in this round too. torch 2.13's c10d rendezvous
    publishes it only in node 0's first round, but a node that joins a
    later round (one replacing a lost node) reads it from that round: it
    would wait there while node 0 waits for its role."""
    info = getattr(spec.rdzv_handler, "_bootstrap_store_info", None)
    if info is not None:
        store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, info.master_addr.encode())
        store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(info.master_port).encode())


def fresh_worker_store(worker_group: WorkerGroup) -> dist.TCPStore | None:
    """Point this round's workers at a store of their own; node 0 serves it
    (returned: it must outlive the workers), every node reads its port.

    torch 2.13's c10d rendezvous shares one TCP store across rounds and
    workers no longer prefix their keys by attempt, so restarted workers
    read the previous attempt's addresses and hang in
    ``init_process_group``.
    """
    served = None
    if worker_group.group_rank == 0:
        served = dist.TCPStore(host_name=worker_group.master_addr, port=0, is_master=True, multi_tenant=True,
                               wait_for_workers=False)
        worker_group.store.set(_WORKER_STORE_KEY, str(served.port))
    worker_group.master_port = int(worker_group.store.get(_WORKER_STORE_KEY).decode())
    # The same on every node of the round, whatever its restart count (a
    # node replacing a lost one starts at 0): the workers' store prefix.
    os.environ["TRAINGUARD_STORE_ROUND"] = str(worker_group.master_port)
    return served
