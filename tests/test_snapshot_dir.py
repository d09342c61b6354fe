"""Who owns a job's snapshot directory on a node: a directory whose owner
is gone (dead, or a zombie its parent has not reaped) is swept by the next
owner; a live owner of the same job is refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.core import ConfigError
from trainguard.core.snapshot import SnapshotDir, sweep


def test_ownership_stale_directories_and_refusal(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / "trainguard-old"
    (stale / "peer").mkdir(parents=True)
    (stale / "owner.json").write_text(json.dumps({"pid": dead.pid, "start": 1, "host": os.uname().nodename}))
    (stale / "r0.s0").write_bytes(b"x" * 100)
    live = SnapshotDir.create("live", root)
    assert not stale.exists(), "a dead owner's directory must be swept"
    assert live.path.is_dir()
    # Another live process owning the same job's directory: refused.
    code = ("import sys; from trainguard.core.snapshot import SnapshotDir; from trainguard.core import ConfigError\n"
            f"try:\n    SnapshotDir.create('live', {str(root)!r})\nexcept ConfigError as e:\n    print(e); sys.exit(7)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 7 and "runs twice on this node" in out.stdout
    assert sweep(root) == [] and live.path.is_dir()
    # An owner killed and not yet reaped by its parent (a zombie) is gone all the same.
    zombie = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    start = int(Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    (root / "trainguard-killed").mkdir()
    (root / "trainguard-killed" / "owner.json").write_text(
        json.dumps({"pid": zombie.pid, "start": start, "host": socket.gethostname()}))
    assert sweep(root) == [root / "trainguard-killed"]
    zombie.wait()
    with pytest.raises(ConfigError, match="does not exist"):
        SnapshotDir.attach(root / "trainguard-nothing")
    live.remove()
    assert list(root.iterdir()) == []
