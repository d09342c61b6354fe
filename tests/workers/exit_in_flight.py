"""A process that ends while a backend thread of its AbortableProcessGroup
still has Python to run: a collective's completion callback (``callback``),
or the same while a rebuild retires that backend (``retiring``).

usage: exit_in_flight.py callback|retiring

The callback sleeps (the GIL released) past the end of the script, and the
module's teardown takes a while, so without trainguard's exit handling that
thread wakes while the interpreter finalizes and the process aborts
("terminate called without an active exception"). Prints "callback done"
when the callback returns.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard.adapters.torch.process_group import AbortableProcessGroup


def slow(fut, sleep=time.sleep):
    sleep(0.5)
    print("callback done", flush=True)
    return fut.value()


class SlowTeardown:
    """Released with the module's globals: the interpreter is finalizing by then."""

    def __del__(self, sleep=time.sleep) -> None:
        sleep(1.5)


group = AbortableProcessGroup(dist.HashStore(), 0, 1, timeout=timedelta(seconds=30))
group.allreduce([torch.ones(4)]).get_future().then(slow)
time.sleep(0.1)  # the callback is running
if sys.argv[1] == "retiring":
    group.rebuild(1)  # the old backend's destructor waits for that callback, on a thread of its own
teardown = SlowTeardown()
