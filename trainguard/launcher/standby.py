"""A warm standby worker: a Python process with torch already imported,
waiting to become a restarted rank.

Starting a worker from nothing costs seconds before the script's first line
runs (the interpreter, then ``import torch``: ~2 s on a small CPU box, more
with CUDA libraries). The node agent keeps one standby per node while a
restart strategy is enabled (torch, ``torch._dynamo`` and trainguard
imported); when a rank must be started again it hands the
standby the rank's environment and command line on stdin, and the standby
runs the script as ``python -u script.py args`` (or ``-m module``) would.
The agent then starts the next standby.

Protocol: one JSON line ``{"env": {...}, "argv": [...], "module": bool}``;
end of input without a line means "not needed": exit 0.
"""

from __future__ import annotations

import json
import os
import queue
import runpy
import subprocess
import sys
import threading
from typing import Any

__all__ = ["command_for", "handler_for", "main", "new_standby"]


def command_for(entrypoint: str, args: tuple) -> tuple[list[str], bool] | None:
    """The script's argv and whether it is a module (``-m``), for a worker
    torchrun would start as ``entrypoint args``; ``None`` when a standby
    cannot stand in (``--no-python``, other interpreter flags)."""
    if os.path.realpath(entrypoint) != os.path.realpath(sys.executable):
        return None
    rest = list(args)
    if not rest or rest[0] != "-u":
        return None
    rest = rest[1:]
    module = bool(rest) and rest[0] == "-m"
    if module:
        rest = rest[1:]
    if not rest or rest[0].startswith("-"):
        return None
    return rest, module


def new_standby() -> subprocess.Popen:
    """Start a standby; it imports torch while it waits for its line."""
    return subprocess.Popen([sys.executable, "-u", "-m", "trainguard.launcher.standby"], stdin=subprocess.PIPE,
                            start_new_session=True, text=True)


def handler_for(proc: subprocess.Popen, local_rank: int) -> Any:
    """torch's handle (``SubprocessHandler``) for a standby put to work."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class _Running(SubprocessHandler):
        def __init__(self) -> None:  # noqa: D107 - no new process here
            self.proc = proc
            self.local_rank_id = local_rank
            self._stdout = self._stderr = None

    return _Running()


def _idle_while_importing() -> bool:
    """Import at idle priority (``SCHED_IDLE``), where the kernel lets this
    process switch back to normal before it runs the worker: a standby then
    takes only CPU that training leaves unused (on a 2-core box its import
    beside two starting workers made their start-up seconds longer)."""
    idle, normal = getattr(os, "SCHED_IDLE", None), getattr(os, "SCHED_OTHER", None)
    if idle is None or normal is None:
        return False
    try:
        os.sched_setscheduler(0, idle, os.sched_param(0))
        os.sched_setscheduler(0, normal, os.sched_param(0))  # proves the way back is open
        os.sched_setscheduler(0, idle, os.sched_param(0))
    except OSError:
        try:
            os.sched_setscheduler(0, normal, os.sched_param(0))
        except OSError:
            pass
        return False
    return True


def _normal_priority() -> None:
    """Every thread of the process back at normal priority."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError:  # a thread that ended meanwhile
            pass


def main() -> int:
    idle = _idle_while_importing()
    got: queue.Queue = queue.Queue()

    def wait_for_work() -> None:  # the line may come while the imports run: finish them at normal priority
        line = sys.stdin.readline()
        if idle:
            _normal_priority()
        got.put(line)

    threading.Thread(target=wait_for_work, name="trainguard-standby", daemon=True).start()
    # The expensive part, done before anyone waits for it. DDP's constructor
    # imports torch._dynamo (~1 s on a small CPU box), so that too.
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import trainguard.torch  # noqa: F401

    line = got.get()
    if not line.strip():
        return 0
    spec = json.loads(line)
    os.environ.clear()
    os.environ.update(spec["env"])
    argv = spec["argv"]
    sys.stdin = open(os.devnull)  # as a worker started by torchrun reads nothing either
    if spec["module"]:
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
