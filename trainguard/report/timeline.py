"""A run directory's events read back into a timeline, and its text summary.

:func:`load` reads ``RUN_DIR/events.jsonl`` (see :mod:`.events`) through
:mod:`.read`, which trusts nothing in it, into a :class:`Timeline`; past
:data:`MAX_POINTS` step points the curves are thinned, so memory stays
bounded whatever the file holds.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.core.events import EVENTS

from .read import RunDirError, read_events

__all__ = ["Episode", "RunDirError", "Timeline", "load", "summary"]

#: Step points kept in all; past it every rank's curve keeps every other point, and so on.
MAX_POINTS = 1 << 19


@dataclass
class Episode:
    """From a fault (or a planned pause) to training again, or the end."""

    start: float
    end: float | None = None
    outcome: str = ""  # the state it ended in: NORMAL (recovered), EXITED, FINISHED; "" while open
    faults: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    fallbacks: list[dict] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)
    record: dict | None = None


@dataclass
class Timeline:
    directory: Path
    events: list[dict]
    skipped: int = 0
    job_id: str = ""
    world_size: int = 0
    strategies: list[str] = field(default_factory=list)
    launches: list[dict] = field(default_factory=list)  # {"start", "end", "code"}
    controllers: list[float] = field(default_factory=list)
    steps: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # rank -> (t, step); step nan: a gap
    down: list[tuple[float, list[int]]] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    snapshots: list[dict] = field(default_factory=list)
    finished: dict[int, int] = field(default_factory=dict)
    startups: list[tuple[float, float]] = field(default_factory=list)  # launch (or controller) start -> training

    @property
    def t0(self) -> float:
        return self.events[0]["t"]

    @property
    def t_end(self) -> float:
        return self.events[-1]["t"]

    @property
    def records(self) -> list[dict]:
        return [e.record for e in self.episodes if e.record is not None]

    def last_step(self) -> int:
        if self.finished:
            return max(self.finished.values())
        seen = [s for points in self.steps.values() for _, s in points if s == s]
        return int(max(seen)) if seen else 0

    def median_step_s(self) -> float | None:
        """The median time of one step, from the ranks' step curves."""
        rates = []
        for points in self.steps.values():
            for (t1, s1), (t2, s2) in zip(points, points[1:]):
                if s2 == s2 and s1 == s1 and s2 > s1 and t2 > t1:
                    rates.append((t2 - t1) / (s2 - s1))
        return statistics.median(rates) if rates else None


def _int(value, default: int = -1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def load(directory: str | Path) -> Timeline:
    """The timeline of the run in ``directory``.

    Raises:
        RunDirError: no such directory, no events file, nothing readable in it.
    """
    directory = Path(directory)
    events, skipped = read_events(directory)
    tl = Timeline(directory, events, skipped)
    # Steps come from the ranks' heartbeats, which arrive up to a heartbeat late; between rollbacks a
    # rank's curve never goes down (a late heartbeat after a newer exact step, say at a fault, is not news).
    open_ep: Episode | None = None
    starting: float | None = None  # when the current launch or controller started, until training runs
    floor: dict[int, float] = {}  # rank -> its highest step since the last rollback (heartbeats arrive late)

    kept, stride, seen = [0], [1], {}  # points held; every stride-th point of a rank is kept; points per rank

    def point(rank: int, t: float, step, reset: bool = False) -> None:
        if not isinstance(step, (int, float)) or isinstance(step, bool) or step < 0 or rank < 0:
            return
        step = float(step) if reset else max(float(step), floor.get(rank, 0.0))
        floor[rank] = step
        seen[rank] = seen.get(rank, -1) + 1
        if seen[rank] % stride[0]:
            return
        tl.steps.setdefault(rank, []).append((t, step))
        kept[0] += 1
        if kept[0] > MAX_POINTS:  # every other point of every curve goes, and of what comes; gaps (nan) stay
            stride[0] *= 2
            for r, points in tl.steps.items():
                tl.steps[r] = [p for i, p in enumerate(points) if i % 2 == 0 or p[1] != p[1] or i == len(points) - 1]
            kept[0] = sum(map(len, tl.steps.values()))

    def gap(t: float) -> None:  # the ranks' processes are gone (the launch ended, or a new round starts)
        for rank in list(tl.steps):
            if tl.steps[rank] and tl.steps[rank][-1][1] == tl.steps[rank][-1][1]:
                tl.steps[rank].append((t, float("nan")))
        floor.clear()

    def close(t: float, outcome: str) -> None:
        nonlocal open_ep
        if open_ep is not None:
            open_ep.end, open_ep.outcome = t, outcome
            open_ep = None

    for ev in events:
        kind, t = ev["ev"], ev["t"]
        if kind in ("launch", "controller") and starting is None:
            starting = t
        if kind == "launch":
            close(t, "EXITED")
            tl.launches.append({"start": t, "end": None, "code": None})
        elif kind == "exit":
            close(t, "EXITED")
            gap(t)
            if tl.launches and tl.launches[-1]["end"] is None:
                tl.launches[-1].update(end=t, code=ev.get("code"))
        elif kind == "controller":
            close(t, "EXITED")
            tl.controllers.append(t)
            tl.job_id = str(ev.get("job_id", tl.job_id))
            tl.world_size = max(tl.world_size, _int(ev.get("world_size"), 0))
            tl.strategies = [str(s) for s in ev.get("strategies", [])] if isinstance(ev.get("strategies"), list) \
                else tl.strategies
            gap(t)  # a new launch or round: each curve starts again
        elif kind == "rank" and not ev.get("joining"):  # a replacement takes its step from a replica later
            point(_int(ev.get("rank")), t, ev.get("step"), reset=True)
        elif kind == "steps" and isinstance(ev.get("steps"), list):
            for rank, step in enumerate(ev["steps"][:tl.world_size or None]):  # no rank past the job's world
                point(rank, t, step)
            if "down" in ev and (not tl.down or set(tl.down[-1][1]) != set(ev["down"])):  # changes only
                tl.down.append((t, ev["down"]))
                if len(tl.down) > 4096:  # the picture's bands: at most a few thousand
                    tl.down = tl.down[::2]
        elif kind == "finished":
            tl.finished[_int(ev.get("rank"))] = _int(ev.get("step"), 0)
            point(_int(ev.get("rank")), t, ev.get("step"))
        elif kind == "snapshot":
            tl.snapshots.append(ev)
        elif kind == "checkpoint":
            if "step" in ev:  # a checkpoint is its step
                tl.checkpoints.append({**ev, "dump": open_ep is not None})
        elif kind == "state":
            state = ev.get("state")
            if state == "NORMAL" and starting is not None:
                tl.startups.append((starting, t))
                starting = None
            if state == "ABNORMAL" and open_ep is None:
                open_ep = Episode(start=t)
                tl.episodes.append(open_ep)
            elif state in ("NORMAL", "EXITED", "FINISHED"):
                close(t, state)
            if state == "EXITED":
                gap(t)
        elif kind == "fault":
            if open_ep is None:  # a fault after the job ended, or its state was not recorded
                open_ep = Episode(start=t)
                tl.episodes.append(open_ep)
            open_ep.faults.append(ev)
            point(_int(ev.get("rank")), t, ev.get("step"))
        elif kind in ("decision", "fallback", "phase", "recovery") and open_ep is not None:
            if kind == "decision":
                open_ep.decisions.append(ev)
            elif kind == "fallback":
                open_ep.fallbacks.append(ev)
            elif kind == "phase":
                open_ep.phases.append(ev)
            else:
                open_ep.record = ev
        if kind == "decision" and isinstance(ev.get("step"), int) and ev.get("strategy") not in ("dump", "exit"):
            for rank in list(floor):  # every rank goes on from the locked step
                floor[rank] = float(ev["step"])
    if tl.launches and tl.launches[-1]["end"] is None:
        tl.launches[-1]["end"] = tl.t_end
    if not tl.world_size and tl.steps:
        tl.world_size = max(tl.steps) + 1
    return tl


def _fault_line(ep: Episode, t0: float) -> str:
    rec = ep.record or {}
    first = ep.faults[0] if ep.faults else {}
    kind = rec.get("fault") or first.get("kind", "?")
    rank = rec.get("rank", first.get("rank", "?"))
    step = rec.get("step", first.get("step", "?"))
    head = f"  {ep.start - t0:7.1f} s  {kind} on rank {rank} at step {step}"
    if rec:
        detect = "" if rec.get("detect_s") is None else f", detected in {rec['detect_s']} s"
        tried = "".join(f"{f.get('strategy')} failed, " for f in ep.fallbacks)
        outcome = {"NORMAL": "recovered", "EXITED": "job stopped", "FINISHED": "job finished"}.get(ep.outcome, "")
        line = (f"{head}: {tried}{rec.get('strategy')} -> {outcome or 'ended'} in {rec.get('recover_s')} s"
                f"{detect}; lost {rec.get('lost_steps')} steps")
    else:
        line = f"{head}: no recovery recorded ({'still open' if ep.end is None else ep.outcome or 'ended'})"
    others = sorted({(f.get("kind"), f.get("rank")) for f in ep.faults[1:]} - {(kind, rank)}, key=str)
    if others:
        line += "; also " + ", ".join(f"{k} on rank {r}" for k, r in others[:8])
    return line


def summary(tl: Timeline, picture: Path | None = None) -> str:
    """A few lines: job length, steps, faults and their outcomes, time lost, checkpoints."""
    out = [f"{tl.directory}: job {tl.job_id or '?'}, {tl.world_size} ranks, "
           f"strategies {','.join(tl.strategies) or '?'}"]
    codes = [str(x["code"]) for x in tl.launches if x["code"] is not None]
    launches = f"{len(tl.launches)} launch{'es' if len(tl.launches) != 1 else ''}" if tl.launches else \
        f"{len(tl.controllers)} controller start(s)"
    out.append(f"length: {tl.t_end - tl.t0:.1f} s from start to end, {launches}"
               + (f" (exit codes {', '.join(codes)})" if codes else " (no exit recorded)"))
    median = tl.median_step_s()
    out.append(f"steps: {tl.last_step()} reached" + (f", median step {median:.3f} s" if median else ""))
    out.append(f"faults: {len(tl.episodes)}")
    out.extend(_fault_line(ep, tl.t0) for ep in tl.episodes)
    recs = tl.records
    lost = sum(max(0, _int(r.get("lost_steps"), 0)) for r in recs)
    in_recovery = sum((ep.end or tl.t_end) - ep.start for ep in tl.episodes)
    gaps = sum(b["start"] - a["end"] for a, b in zip(tl.launches, tl.launches[1:]) if a["end"] is not None)
    restarts = sum(end - begin for begin, end in tl.startups[1:])
    redo = f" (~{lost * median:.1f} s to recompute)" if median and lost else ""
    out.append(f"time lost: {in_recovery:.2f} s handling faults, {lost} steps recomputed{redo}"
               + (f", {gaps:.1f} s between launches" if len(tl.launches) > 1 else "")
               + (f", {restarts:.1f} s starting again" if restarts else ""))
    dumps = [c["step"] for c in tl.checkpoints if c.get("dump")]
    steps = [c["step"] for c in tl.checkpoints]
    shown = ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")
    out.append(f"checkpoints: {len(steps)}" + (f" (steps {shown})" if steps else "")
               + (f", dying-gasp at steps {dumps}" if dumps else "")
               + (f"; snapshots: {len(tl.snapshots)}" if tl.snapshots else ""))
    if tl.skipped:
        out.append(f"note: {tl.skipped} unreadable line(s) of {EVENTS} skipped")
    if picture is not None:
        out.append(f"picture: {picture}")
    return "\n".join(out)
