"""A killed worker: trainguard's recover-in-place vs what users have today.

Side by side, on the ResNet-50 example (2 CPU ranks, gloo), for several
positions of the fault inside a checkpoint interval of K steps, rank 1's
process is SIGKILLed in its backward pass:

* **baseline**: ``torchrun --max-restarts 1`` with a ``torch.save``
  checkpoint every K steps; torchrun stops every worker, restarts them all,
  and they reload the newest checkpoint (with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which torch 2.13's
  restarted workers hang);
* **trainguard**: ``trainguard run --max-restarts 1`` with
  ``TRAINGUARD_STRATEGIES=recover-in-place,dump``: only rank 1 is started
  again; rank 0 keeps its process, waits at the last consistent step, meets
  the new process and sends it model, optimizer, scheduler and data
  position.

Measured from the job's timeline as in ``bench/recovery.py``: fault until
training runs again, until the next completed step, and until the job is
back at the step it had reached (the time the fault cost: the goal's
measure); steps lost; whether rank 0 kept its process.

usage: python bench/reschedule.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from recovery import NPROC, run_positions  # noqa: E402


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    rows, failures, k, size = run_positions(args.quick, fault="crash", strategies="recover-in-place,dump",
                                            launcher_args=("--max-restarts", "1"))
    for row in rows:
        row["rank0_kept_pid"] = not row.pop("restarted")
    base = [r for r in rows if r["mode"] == "baseline"]
    ours = [r for r in rows if r["mode"] == "trainguard"]
    mean = lambda rs, key: statistics.mean(r[key] for r in rs)  # noqa: E731
    share = mean(ours, "fault_to_regained_s") / mean(base, "fault_to_regained_s")
    goals = [
        common.Goal("recover-in-place time lost to a killed worker, as a share of torchrun's restart + reload",
                    round(100 * share, 1), 30.0, "%"),
        common.Goal("steps lost by recover-in-place (mean)", mean(ours, "lost_steps"), 0, "steps"),
    ]
    common.report("reschedule", rows, ["mode", "fault_step", "fault_to_resumed_s", "fault_to_next_step_s",
                                       "fault_to_regained_s", "lost_steps", "rank0_kept_pid", "step_s"], goals,
                  quick=args.quick, out=args.out,
                  extra={"checkpoint_every_k": k, "nproc": NPROC, "image_size": size["image"],
                         "batch_size": size["batch"], "launches_failed_and_retried": failures,
                         "baseline_mean_lost_steps": mean(base, "lost_steps"),
                         "share_fault_to_next_step_pct": round(100 * mean(ours, "fault_to_next_step_s")
                                                               / mean(base, "fault_to_next_step_s"), 1)})


if __name__ == "__main__":
    main()
