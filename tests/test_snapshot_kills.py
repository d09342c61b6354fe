"""Random kill -9 of a trainer or its persist worker during persists: every
load, from memory or storage, returns one whole step, never a partial one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import SnapshotDir

WORKERS = Path(__file__).parent / "workers"


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _kill_loop(tmp_path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    shm_root, root, log = tmp_path / "shm", tmp_path / "ckpt", tmp_path / "loads.jsonl"
    shm_root.mkdir()
    owner = SnapshotDir.create("kills", shm_root)  # the test plays the node agent
    cmd = [sys.executable, str(WORKERS / "snapshot_kill_trainer.py"), str(owner.path), str(root), str(log)]
    killed = {"trainer": 0, "worker": 0}

    def start() -> subprocess.Popen:
        """A trainer, once it has loaded and logged what it loaded."""
        proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 60
        while not log.is_file() or len(log.read_text().splitlines()) < killed["trainer"] + 1:
            assert proc.poll() is None, f"the trainer exited with {proc.returncode} at start"
            assert time.monotonic() < deadline, "the trainer did not start"
            time.sleep(0.05)
        return proc

    trainer = start()
    sys.path.insert(0, str(WORKERS))
    from snapshot_kill_trainer import whole  # noqa: E402 - the trainer's own check
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(0.2, 1.0))
            workers = _children(trainer.pid)
            if rng.random() < 0.5 or not workers:
                trainer.kill()
                trainer.wait()
                killed["trainer"] += 1
            else:
                os.kill(workers[0], signal.SIGKILL)
                killed["worker"] += 1
            # Whatever storage holds now is one whole step.
            found = CheckpointStore(root).latest()
            if found is not None:
                state = read_stored_snapshot(found.file("shard_k0_r0.safetensors"), "cpu")
                assert whole(found.step, {"state": state}), f"storage step {found.step} is not whole"
            if trainer.poll() is not None:
                trainer = start()
        time.sleep(2.5)
    finally:
        trainer.kill()
        trainer.wait()
        owner.remove()
    loads = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(entry["whole"] for entry in loads), [e for e in loads if not e["whole"]]
    sources = {e["source"] for e in loads[1:]}
    assert "memory" in sources, loads
    assert killed["trainer"] and killed["worker"], killed
    assert len(loads) == killed["trainer"] + 1
    assert CheckpointStore(root).latest() is not None


def test_kill_loop_short(tmp_path):
    """Random kill -9 of the trainer or its persist worker (12 kills)."""
    _kill_loop(tmp_path, kills=12, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_loop_200(tmp_path):
    _kill_loop(tmp_path, kills=200, seed=2)
