"""The MindSpore Guard's load with shared snapshots, in one process without
msrun: rank 1's snapshots are headers naming rank 0's; a fresh rank 1
(as a restarted process would) resumes from memory with rank 0's parameters
of the newest step both hold sealed. Prints what it loaded as JSON.

With ``corrupt``: rank 0's snapshot of step 2 has a byte flipped; rank 1
resumes from its holder's step 1, and nothing of step 2 reaches its
parameters."""

import json
import os
import sys
import time

import numpy as np

from trainguard.adapters.mindspore.checkpoints import Checkpoints, ParamSnapshots
from trainguard.core.faults import FaultInjector
from trainguard.core.rank import RankRuntime
from trainguard.core.snapshot import SnapshotDir, State
from trainguard.core.snapshot.shared import DENSE_FROM, Sharing

HISTORY = {"records": [], "pids": {}}


def arrays(step: int) -> dict:
    return {"fc.weight": np.full((3, 4), step, np.float32), "moments.fc.weight": np.arange(12.0).reshape(3, 4) * step}


def sealed(snaps: ParamSnapshots, index: int) -> None:
    deadline = time.monotonic() + 30
    while snaps.slots[index].info().state is not State.SEALED:
        assert time.monotonic() < deadline, "never sealed"
        snaps.poll(0.05)


class Params:
    def __init__(self) -> None:
        self.loads: list[dict] = []  # every set of arrays put into the parameters
        self.buffers: list = []  # ModelState's parameters a forward pass moves: none here (no BatchNorm)

    def load_arrays(self, loaded: dict, source: str) -> None:
        self.loads.append({k: v.copy() for k, v in loaded.items()})


class Replica(Checkpoints):
    """What the Guard's load (:meth:`RankRuntime._load` over these
    checkpoints) needs: rank 1 of a world it gathers alone."""

    def __init__(self, snapshots: ParamSnapshots) -> None:
        self.rank, self.world_size, self.snapshots, self.store = 1, 1, snapshots, None
        self.sharing, self.state = Sharing(1, 1, True, {0, 1}), Params()
        self.injector = FaultInjector([], 1)  # no faults: a load strikes phase=resume faults
        self.rehearsal = None  # not under trainguard rehearse

    def all_gather_ints(self, values: list[int]) -> list[int]:
        return list(values)


shm = SnapshotDir.create(f"ms-shared-load-{os.getpid()}")
holder, replica = ParamSnapshots(shm, 0, count=2), ParamSnapshots(shm, 1, count=3)
try:
    for step in (1, 2):
        sealed(holder, holder.take(arrays(step), step, HISTORY))
    for step in (1, 2, 3):  # rank 0 holds no step 3
        sealed(replica, replica.take({}, step, HISTORY, meta={DENSE_FROM: 0}))
    own_bytes = replica.slots[0].info().payload_bytes
    if sys.argv[1:] == ["corrupt"]:
        path = next(slot.path for slot in holder.slots if slot.info().step == 2)
        with open(path, "r+b") as f:  # a byte of the payload's end (the moments) flipped
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    again = Replica(ParamSnapshots(SnapshotDir.attach(shm.path), 1, count=3))
    step = RankRuntime._load(again)  # the runtime's load, without the rest of a Guard
    want = arrays(step)
    print(json.dumps({"step": step, "resumed_from": again.resumed_from, "own_bytes": own_bytes,
                      "loads": len(again.state.loads),
                      "equal": all(sorted(got) == sorted(want) and all(np.array_equal(got[k], v)
                                                                       for k, v in want.items())
                                   for got in again.state.loads)}))
    again.snapshots.close()
finally:
    holder.close()
    replica.close()
    shm.remove()
__import__("gc").freeze()
