"""In-memory snapshots: slots in shared memory (:mod:`.segment`), the job's
directory and its owner (:mod:`.shm`), the persist worker (:mod:`.persist`)
and copies on a peer node (:mod:`.peer`). Framework-free: adapters fill the
slots (see ``trainguard.adapters.torch.snapshot``)."""

from .peer import fetch, push
from .peer_server import PeerServer
from .persist import PersistWorker
from .ring import SnapshotRing
from .segment import Entry, Layout, Slot, State, payload_header
from .shm import SnapshotDir, sweep

__all__ = ["Entry", "Layout", "PeerServer", "PersistWorker", "Slot", "SnapshotDir", "SnapshotRing", "State", "fetch",
           "payload_header", "push", "sweep"]
