"""What the in-memory snapshot tests (``test_snapshot.py``,
``test_snapshot_shared.py``) take and check: a small training state per step
(:func:`sample_state`), an exact comparison of nested states
(:func:`equal`), waiting for the persist worker's seal, a one-rank persist
with its finalise request (:func:`persist_whole`), a flipped byte to break a
checksum (:func:`flip_byte`), and whether this machine can mount a small
tmpfs in a user namespace (for the full-disk test)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from trainguard.adapters.torch.snapshot import Snapshots
from trainguard.core.snapshot import State

WHOLE = "shard_k0_r0.safetensors"  # the file of a one-rank job's whole state


def one_rank(name: str = WHOLE) -> dict:
    """A one-rank job's layout: rank 0 saved the whole state in ``name``."""
    return {"world_size": 1, "shards": [{"kind": 0, "copies": [0], "full": True, "saved_by": 0, "files": [name]}]}


def sample_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"state": {"model": {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g).half(),
                                "n": torch.tensor(step)},
                      "optimizer": {"state": {0: {"step": torch.tensor(float(step)),
                                                  "exp_avg": torch.randn(300, 70, generator=g)}},
                                    "param_groups": [{"lr": 0.01, "params": [0]}]},
                      "host": {"sched": {"last_epoch": step}}, "step": step},
            "history": {"records": [], "pids": {"0": [1]}}}


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def wait_sealed(snaps: Snapshots, index: int) -> None:
    deadline = time.monotonic() + 30
    while snaps.slots[index].info().state is not State.SEALED:
        assert time.monotonic() < deadline, "the persist worker never sealed the snapshot"
        snaps.poll(timeout=0.05)


def persist_whole(snaps: Snapshots, index: int, step: int, root: Path, **finalize) -> None:
    """Ask for slot ``index`` persisted as step ``step`` of a one-rank job
    under ``root``, finalised (``finalize``: more of the finalise request)."""
    snaps.persist(index, step, root=str(root), name=WHOLE,
                  finalize={"expected": [WHOLE], "layout": one_rank(), "meta": {}, **finalize})


def flip_byte(path: Path, from_end: int) -> None:
    """Invert every bit of the byte ``from_end`` bytes before the end of
    ``path`` (flipping the same byte again restores it)."""
    with open(path, "r+b") as f:
        f.seek(-from_end, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def thread_count() -> int:
    """The threads of this process."""
    return len(os.listdir("/proc/self/task"))


def unshare_ok() -> bool:
    """Whether an unprivileged user and mount namespace can mount a small tmpfs here."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True)
    return probe.returncode == 0
