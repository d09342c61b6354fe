"""A stand-in for a TensorFlow worker (no TensorFlow): what the launcher of
``trainguard run --framework tensorflow`` sees of one.

    python tf_fake_worker.py STEPS OUT_JSONL [refuse|early|fail]

Appends ``{"index", "pid", "restart", "tf_config"}`` to OUT_JSONL, reports
``resumed 0``, then STEPS steps of 50 ms on the progress pipe (striking
``TRAINGUARD_FAULT``'s faults before each, logged in OUT_JSONL's directory
so each strikes once per job), then ``done``. ``refuse``: exits 76 at once
(a worker that refuses to resume); ``early``: exits 1 at once, every time
(a script that cannot start); ``fail``: exits 1 after its first step, every time.
"""

import json
import os
import sys
import time
from pathlib import Path

from trainguard.core import FaultInjector
from trainguard.core.step_pipe import StepPipe

steps, out = int(sys.argv[1]), Path(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
with open(out, "a") as f:
    f.write(json.dumps({"index": index, "pid": os.getpid(), "restart": int(os.environ["TRAINGUARD_RESTART"]),
                        "tf_config": config}) + "\n")
if mode == "refuse":
    print("worker refuses: a checkpoint it cannot load", file=sys.stderr)
    sys.exit(76)
if mode == "early":
    sys.exit(1)
pipe = StepPipe.from_env()
if mode == "fail":
    pipe.send("step", 1)
    time.sleep(0.2)
    sys.exit(1)
faults = FaultInjector.from_env(index, log_path=out.with_suffix(".faults.jsonl"))
pipe.send("resumed", 0)
for step in range(steps):
    faults.strike("forward", step)
    time.sleep(0.05)
    pipe.send("step", step + 1)
pipe.send("done", steps)
