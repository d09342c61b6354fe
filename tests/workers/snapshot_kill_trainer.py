"""A trainer for the kill loop: its state at step n is every tensor filled
with n, so any load can be checked for being one whole step.

    python snapshot_kill_trainer.py SNAPSHOT_DIR CHECKPOINT_DIR LOG

At start it loads the newest verified snapshot in memory (else the newest
checkpoint on storage), checks it and appends what it loaded to LOG; then it
snapshots every step and persists every third step, forever.
"""

import json
import os
import sys
import time

import torch

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.adapters.torch.snapshot import Snapshots, read_payload
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import SnapshotDir

SIZES = [(1 << 20,), (512, 1024), (3, 1000), ()]  # about 6 MB of float32 and a 0-d tensor


def state(step: int) -> dict:
    return {"state": {"w": [torch.full(s, float(step)) for s in SIZES], "step": step,
                      "host": {"lr": 0.1 * step}}, "history": {}}


def whole(step: int, held: dict) -> bool:
    s = held["state"]
    return s["step"] == step and s["host"]["lr"] == 0.1 * step and \
        all(bool((t == float(step)).all()) and tuple(t.shape) == sz for t, sz in zip(s["w"], SIZES))


def main() -> None:
    directory, root, log = SnapshotDir.attach(sys.argv[1]), sys.argv[2], sys.argv[3]
    snaps = Snapshots(directory, 0, count=2)
    store = CheckpointStore(root)
    start, source = 0, "none"
    memory = snaps.available()
    if memory:
        start = max(memory)
        slot, source = memory[start]
        slot.lock(False, block=True)
        step, held = read_payload(slot.payload())
        slot.close()
    else:
        found = store.latest()
        if found is not None:
            start, source = found.step, "storage"
            held = {"state": read_stored_snapshot(found.file("shard_k0_r0.safetensors"), "cpu")}
            step = held["state"]["step"]
    ok = source == "none" or (step == start and whole(start, held))
    with open(log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "source": source, "step": start, "whole": ok}) + "\n")
    if not ok:
        sys.exit(3)
    step = start
    while True:
        step += 1
        index = snaps.take(state(step), step)
        if index is not None and step % 3 == 0 and not snaps.pinned:
            snaps.persist(index, step, root=root, name="shard_k0_r0.safetensors",
                          finalize={"expected": ["shard_k0_r0.safetensors"], "keep": 3, "timeout_s": 30,
                                    "layout": {"world_size": 1, "shards": [{
                                        "kind": 0, "copies": [0], "full": True, "saved_by": 0,
                                        "files": ["shard_k0_r0.safetensors"]}]}, "meta": {}})
        time.sleep(0.01)


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
