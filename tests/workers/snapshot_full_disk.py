"""Persist onto a nearly full disk (a 4 MiB tmpfs the test mounted):

    python snapshot_full_disk.py DISK

saves a small checkpoint of step 1, then asks for one of step 2 that cannot
fit, and prints (JSON) the persist error, the step storage then holds,
whether that checkpoint is whole, and the bytes left in temporary dirs.
"""

import json
import os
import sys

import torch

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.adapters.torch.snapshot import Snapshots
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import SnapshotDir

NAME = "shard_k0_r0.safetensors"


def main() -> None:
    disk = sys.argv[1]
    directory = SnapshotDir.create(f"full-disk-{os.getpid()}")
    snaps = Snapshots(directory, 0, count=2)
    try:
        for step, numel in ((1, 50_000), (2, 2_000_000)):  # 200 KB, then 8 MB
            state = {"state": {"w": torch.full((numel,), float(step)), "step": step}, "history": {}}
            index = snaps.take(state, step)
            snaps.persist(index, step, root=disk, name=NAME,
                          finalize={"expected": [NAME], "meta": {}, "timeout_s": 30, "layout": {
                              "world_size": 1, "shards": [{"kind": 0, "copies": [0], "full": True,
                                                           "saved_by": 0, "files": [NAME]}]}})
            snaps.wait(60)
        found = CheckpointStore(disk).latest()
        state = read_stored_snapshot(found.file(NAME), "cpu")
        leftover = sum(f.stat().st_size for p in os.scandir(disk) if p.name.endswith("_tmp")
                       for f in os.scandir(p.path) if f.is_file())
        print(json.dumps({"error": snaps.errors[-1] if snaps.errors else "", "latest": found.step,
                          "whole": bool((state["w"] == 1.0).all()) and state["step"] == 1,
                          "leftover_bytes": leftover}))
    finally:
        snaps.close()
        directory.remove()


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
