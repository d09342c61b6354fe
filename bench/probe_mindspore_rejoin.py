"""Can a restarted MindSpore worker rejoin its running peers on CPU?

The question behind recover-in-place for MindSpore (restart only the lost
worker, the survivors keep their processes): a probe, not a speed benchmark.
It launches a scheduler and two workers the way msrun does
(``MS_ROLE``/``MS_NODE_ID``, ``MS_ENABLE_RECOVERY=1`` as msrun sets it under a
process-control plugin), all-reduces in a loop, SIGKILLs rank 1 after 3
all-reduces and starts a new rank 1 with the same node id. The survivor's
next all-reduce fails after ``MS_CPU_COMM_OP_TIMEOUT``; both then call
MindSpore's own ARF rebuild (``_finalize_comm(); _rebuild_group()``, what
``_tft_rebuild_groups`` does) after every failure and try again.

What it showed with MindSpore 2.10.0 (bench/results/mindspore_rejoin.json):
the scheduler accepts the new process ("node 1 have been recovered"), but no
all-reduce between the survivor and it ever succeeds (0 of 15): the CPU
collective library (mccl) tags ring messages with a per-process sequence
number, so the survivor waits for ``[1, 13]``, ``[1, 14]``, ... while the new
process waits for ``[0, 1]``, ``[0, 2]``, ..., and ``_rebuild_group`` keeps
the existing group ("has already existed"). So on CPU a lost MindSpore worker cannot be replaced
alone; the survivors must be relaunched too (trainguard's ``dump``).

usage: python bench/probe_mindspore_rejoin.py   (about 1 minute)
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORKER = r"""
import os, sys, time, numpy as np
import mindspore as ms
from mindspore import Tensor, ops
from mindspore.communication import init, get_rank
from mindspore._c_expression import _finalize_comm, _rebuild_group
ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
init()
if os.environ["MS_ROLE"] == "MS_SCHED":
    sys.exit(0)
rank, new = get_rank(), os.environ.get("NEW") == "1"
for i in range(int(os.environ["ITERS"])):
    if rank == 1 and not new and i == 3:
        os.kill(os.getpid(), 9)
    try:
        y = ops.AllReduce()(Tensor(np.full([4], rank + 1.0, np.float32))).asnumpy()
        print(f"RESULT rank={rank} new={int(new)} iter={i} sum={y[0]:g}", flush=True)
    except RuntimeError as e:
        print(f"RESULT rank={rank} new={int(new)} iter={i} sum=failed", flush=True)
        _finalize_comm()
        _rebuild_group()
print("DONE", flush=True)
"""


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ms-rejoin-"))
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(20000 + os.getpid() % 10000),
               MS_WORKER_NUM="2", MS_ENABLE_RECOVERY="1", MS_CPU_COMM_OP_TIMEOUT="5", GLOG_v="2")

    def start(role: str, name: str, **extra) -> subprocess.Popen:
        out = open(tmp / f"{name}.log", "w")
        return subprocess.Popen([sys.executable, str(script)], env=dict(env, MS_ROLE=role, **extra),
                                stdout=out, stderr=subprocess.STDOUT)

    sched = start("MS_SCHED", "sched", ITERS="0")
    survivor = start("MS_WORKER", "rank0", MS_NODE_ID="0", ITERS="12")
    lost = start("MS_WORKER", "rank1", MS_NODE_ID="1", ITERS="12")
    lost.wait(timeout=240)
    new = start("MS_WORKER", "rank1-new", MS_NODE_ID="1", ITERS="6", NEW="1")
    try:
        new.wait(timeout=180)
        survivor.wait(timeout=180)
    finally:
        for p in (sched, survivor, new):
            p.kill()
    results = []
    for name in ("rank0", "rank1", "rank1-new"):
        text = (tmp / f"{name}.log").read_text(errors="replace")
        results += [dict(log=name, **{k: v for k, v in (kv.split("=") for kv in line.split()[1:])})
                    for line in text.splitlines() if line.startswith("RESULT ")]
    sched_log = (tmp / "sched.log").read_text(errors="replace")
    after = [r for r in results if r["log"] != "rank1" and int(r["iter"]) >= (3 if r["log"] == "rank0" else 0)]
    ok_after = [r for r in after if r.get("sum") == "3"]
    seq = sorted(set(re.findall(r"wait receiving \[(\d+,\d+)\]", (tmp / "rank0.log").read_text(errors="replace"))))
    rows = [
        {"measure": "scheduler re-admitted the new rank 1", "value": "have been recovered" in sched_log},
        {"measure": "all-reduces tried after the restart (both ranks)", "value": len(after)},
        {"measure": "of which returned the right sum", "value": len(ok_after)},
        {"measure": "survivor waited for ring messages (src,seq)", "value": ", ".join(seq[:6])},
    ]
    common.report("mindspore_rejoin", rows, ["measure", "value"], [], quick=False,
                  extra={"mindspore": importlib.metadata.version("mindspore"), "results": results, "logs": str(tmp)})

if __name__ == "__main__":
    main()
