"""The GPT-3 example (``examples/gpt3/train.py``, same arguments), except
that with ``CORRUPT_ON_RESTART=R`` rank R flips a byte in each of its
snapshots in memory when it is a restarted process, before the example
looks at them."""

import os
import runpy
import sys
from pathlib import Path

from snapshot_train import corrupt_own_snapshots

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt3" / "train.py"

if __name__ == "__main__":
    rank = os.environ["RANK"]
    if os.environ.get("CORRUPT_ON_RESTART") == rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        corrupt_own_snapshots(int(rank))
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
__import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
