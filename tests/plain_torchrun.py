"""Plain ``torchrun`` jobs for the end-to-end test of ``test_patch.py``: a
2-rank run of ``workers/tiny_train.py`` through this install's ``torchrun``
(patched or not) with its report read back (:func:`plain_torchrun`), and the
other processes already using that ``torchrun``, which patching the install
would reroute (:func:`others_launching_torchrun`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import WORKERS

STEPS = 8


def others_launching_torchrun() -> list[str]:
    """Other processes running torchrun from this install would be rerouted while it is patched."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(pid) != os.getpid() and ("torch.distributed.run" in cmd or "/torchrun " in cmd) \
                and _same_install(pid, cmd):
            found.append(cmd)
    return found


def plain_torchrun(tmp: Path, name: str, env: dict, args: tuple = ()) -> tuple[subprocess.CompletedProcess, dict | None]:
    report, ckpt = tmp / f"{name}.json", tmp / f"{name}-ckpt"
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "TRAINGUARD_PRELOCK_TIMEOUT_S": "20",
                 "PYTHONUNBUFFERED": "1", **env})
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "2", "--monitor-interval", "0.1", *args, str(WORKERS / "tiny_train.py"),
           str(STEPS), str(report), str(ckpt)]
    out = subprocess.run(cmd, env=full, cwd=tmp, capture_output=True, text=True, timeout=60)
    return out, (json.loads(report.read_text()) if report.exists() else None)


def _same_install(pid: str, cmd: str) -> bool:
    """Whether process ``pid`` runs this environment's Python (another
    virtual environment's torchrun reads its own torch)."""
    prefix = str(Path(sys.executable).parent.parent)
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    first = cmd.split(" ", 1)[0]
    return first.startswith(prefix) or (not first.startswith("/") and exe.startswith(os.path.realpath(prefix)))
