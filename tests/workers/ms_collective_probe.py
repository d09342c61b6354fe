"""Can anything release a MindSpore CPU collective that waits for a lost peer?

A probe for ``bench/mindspore.py --dying-gasp``, started the way msrun starts
a job (``MS_ROLE`` = ``MS_SCHED`` / ``MS_WORKER``, ``MS_NODE_ID``, two
workers). Both workers all-reduce twice; then rank 1 exits and rank 0 enters
a third all-reduce, which can only end at ``MS_CPU_COMM_OP_TIMEOUT``. Two
seconds in, a second thread of rank 0 tries one way out (``HOW``):

- ``read``: read a parameter (``asnumpy``) -- what a dying-gasp save needs;
- ``direct``: ``direct_copy_to_host`` (what MindSpore's own TFT reads its
  flag with while training is stopped), then the copy's ``data_ptr``;
- ``finalize``: ``_finalize_comm()`` (MindSpore's ARF rebuild, first half);
- ``release``: ``mindspore.communication.release()``;
- ``destroy``: ``CollectiveManager.destroy_group("mccl_world_group")``;
- ``async``: the third all-reduce is ``mint.distributed.all_reduce(...,
  async_op=True)``; the main thread then reads a parameter.

Each line printed is ``PROBE {json}`` with the seconds since the third
all-reduce started (``t``), so the caller sees when each call returned.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, ops
from mindspore.communication import get_rank, init

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
init()
if os.environ["MS_ROLE"] == "MS_SCHED":
    sys.exit(0)
rank, how = get_rank(), os.environ["HOW"]
weight = Parameter(Tensor(np.ones([4], np.float32)), name="w")
started = [0.0]


def probe(event: str, **fields) -> None:
    print("PROBE " + json.dumps({"how": how, "event": event, "t": round(time.perf_counter() - started[0], 2),
                                 **fields}), flush=True)


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"


def try_release() -> None:
    time.sleep(2.0)
    probe("call")
    try:
        if how == "read":
            weight.asnumpy()
        elif how == "direct":
            from mindspore._c_expression import direct_copy_to_host
            copy = direct_copy_to_host(weight)
            probe("direct_copy_to_host returned")
            copy.data_ptr()
        elif how == "finalize":
            from mindspore._c_expression import _finalize_comm
            _finalize_comm()
        elif how == "release":
            from mindspore.communication import release
            release()
        elif how == "destroy":
            from mindspore._c_expression import CollectiveManager
            CollectiveManager.get_instance().destroy_group("mccl_world_group")
        probe("returned")
    except Exception as e:  # noqa: BLE001 - the probe reports whatever it was
        probe("raised", error=first_line(e))


for i in range(3):
    x = Tensor(np.full([4], rank + 1.0, np.float32))
    if i < 2:
        ops.AllReduce()(x).asnumpy()
        continue
    if rank == 1:
        time.sleep(0.5)
        os._exit(9)  # lost: rank 0 is alone in its next all-reduce
    started[0] = time.perf_counter()
    if how != "async":
        threading.Thread(target=try_release, daemon=True).start()
    try:
        if how == "async":
            from mindspore.mint.distributed import all_reduce
            handle = all_reduce(x, async_op=True)
            probe("async all_reduce returned a handle")
            weight.asnumpy()
            probe("parameter read")
            handle.wait()
        else:
            y = ops.AllReduce()(x).asnumpy()
            probe("collective returned", sum=float(y[0]))
    except Exception as e:  # noqa: BLE001
        probe("collective raised", error=first_line(e))
    time.sleep(0.5)  # the releasing thread reports
probe("done")
