"""What a rank learns from ``torch.distributed`` for the TTP flow's
processor (:mod:`.runtime`): whether the training thread is blocked
in a collective (for the hang watchdog) and every rank's PID (for the
job's history). ``torch.distributed`` is only looked up among the modules
the script loaded, never imported here.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from .session import TTP

__all__ = ["all_pids", "blocked_in_collective"]


def blocked_in_collective(thread: int) -> Callable[[], bool]:
    """For the hang watchdog: is ``thread`` (the training thread) inside a
    ``torch.distributed`` call? A collective blocked on a peer keeps its
    innermost Python frame in c10d's Python API (megatron's and the script's
    collectives alike), so a rank waiting on a hung peer is not taken for
    the hung one: it gets the longer in-collective limit, and the peer
    names itself first. The trainguard backend's groups wait on a future
    (``torch.futures`` under ``process_group.py``): its frames count too."""
    tdist = sys.modules.get("torch.distributed")
    where = (os.path.dirname(tdist.__file__) + os.sep,) if tdist is not None else ()
    pg = sys.modules.get("trainguard.adapters.torch.process_group")
    if pg is not None:  # the trainguard backend's groups wait on their own future
        where += (pg.__file__,)

    def probe() -> bool:
        frame = sys._current_frames().get(thread)
        for _ in range(3):  # the wait itself may sit in torch.futures, below the collective
            if frame is None or not where:
                return False
            if frame.f_code.co_filename.startswith(where):
                return True
            frame = frame.f_back
        return False
    return probe


def all_pids() -> tuple[dict[int, int], float]:
    """Every rank's PID (for the job's history) and rank 0's clock (one
    default profiling job id), when torch.distributed is up."""
    tdist = sys.modules.get("torch.distributed")
    if tdist is None or not tdist.is_initialized():
        return {TTP.rank: os.getpid()}, time.time()
    ids: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(ids, (os.getpid(), time.time()))
    return {r: pid for r, (pid, _) in enumerate(ids)}, ids[0][1]
