"""``trainguard status --watch``: a running job's ranks and last fault, redrawn.

:func:`render` turns a controller snapshot (``GetStatus``) into a compact
table; :func:`watch` redraws it every ``interval`` seconds until the job
finishes, the controller goes away or the user presses Ctrl-C. On a
terminal each refresh clears the screen (ANSI); otherwise the tables follow
one another. Exit codes: 0 the job finished (or the user stopped watching),
1 the controller could not be reached at all, 3 it went away before the job
finished (stopped after a dump or exit, or its launcher ended).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, TextIO

__all__ = ["render", "watch"]

CLEAR = "\x1b[H\x1b[2J"
#: Above this many ranks the table shows a summary line and only the ranks that stand out.
MAX_ROWS = 32


def _last_fault(snap: dict) -> str:
    ep = snap.get("episode")
    if ep:
        faults = "; ".join(ep.get("faults", [])[:3]) or "?"
        plan = f" -> {ep['plan']}" if ep.get("plan") else " (deciding)"
        return f"now: {faults}{plan}"
    recs = snap.get("recoveries") or []
    if not recs:
        return "none"
    r = recs[-1]
    return (f"{r.get('fault')} on rank {r.get('rank')} at step {r.get('step')} -> {r.get('strategy')} "
            f"(recovered in {r.get('recover_s')} s, lost {r.get('lost_steps')} steps)"
            + (f"; {len(recs)} faults so far" if len(recs) > 1 else ""))


def render(snap: dict, *, address: str = "", now: float | None = None) -> str:
    """The table of one controller snapshot."""
    ranks = {int(k): v for k, v in (snap.get("ranks") or {}).items()}
    world = snap.get("world_size") or len(ranks)
    clock = time.strftime("%H:%M:%S", time.localtime(time.time() if now is None else now))
    lines = [f"job {snap.get('job_id', '?')}  state {snap.get('state', '?')}  {len(ranks)}/{world} ranks "
             f"registered  {address}  {clock}"]
    steps = [v.get("step", 0) for v in ranks.values()]
    shown = sorted(ranks)
    if len(ranks) > MAX_ROWS:
        median = statistics.median(steps)
        lines.append(f"steps: min {min(steps)}  median {median:g}  max {max(steps)}; showing ranks not training, "
                     f"lost or behind the median")
        shown = [r for r in shown if ranks[r].get("run") not in ("TRAINING", "FINISHED")
                 or not ranks[r].get("alive", True) or ranks[r].get("step", 0) < median][:MAX_ROWS]
    lines.append(f"{'rank':>6} {'step':>8}  {'state':<10} {'data':<9} {'alive':<5}  host:pid")
    for r in shown:
        v = ranks[r]
        lines.append(f"{r:>6} {v.get('step', 0):>8}  {str(v.get('run', '?')):<10} {str(v.get('data', '?')):<9} "
                     f"{'yes' if v.get('alive') else 'no':<5}  {v.get('host', '?')}:{v.get('pid', '?')}")
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        lines.append(f"not registered: {missing[:16]}{' ...' if len(missing) > 16 else ''}")
    lines.append(f"last fault: {_last_fault(snap)}")
    persist = snap.get("persist") or {}
    if persist.get("failing"):
        lines.append(persist["failing"])
    return "\n".join(lines)


def watch(fetch: Callable[[], dict], *, interval: float, address: str = "", out: TextIO | None = None,
          clear: bool | None = None, sleep: Callable[[float], None] = time.sleep,
          lost: tuple[type[BaseException], ...] = (Exception,)) -> int:
    """Redraw :func:`render` every ``interval`` seconds; see the module for the exit codes.

    ``fetch`` returns a snapshot or raises one of ``lost`` when the
    controller cannot be reached. The controller is asked every
    ``min(interval, 0.5)`` s, so that a job's brief FINISHED state is seen.
    """
    out = sys.stdout if out is None else out
    clear = out.isatty() if clear is None else clear
    poll = max(0.05, min(interval, 0.5))
    try:
        try:
            snap = fetch()
        except lost as e:
            print(f"trainguard status: {e}", file=sys.stderr)
            return 1
        drawn_at, drawn_state = -1e18, None
        while True:
            state = snap.get("state")
            if time.monotonic() - drawn_at >= interval or state != drawn_state or state == "FINISHED":
                table = render(snap, address=address)
                out.write((CLEAR + table + "\n") if clear else (table + "\n\n"))
                out.flush()
                drawn_at, drawn_state = time.monotonic(), state
            if state == "FINISHED":
                out.write("the job finished: every rank completed its steps\n")
                return 0
            sleep(poll)
            try:
                snap = fetch()
            except lost:
                why = (snap.get("episode") or {}).get("reason") if snap.get("episode") else ""
                out.write(f"the controller at {address} went away while the job was {state}"
                          + (f" ({why})" if why else "")
                          + ": the job stopped or its launcher ended (see the launcher's exit code)\n")
                return 3
    except KeyboardInterrupt:
        out.write("\n")
        return 0
