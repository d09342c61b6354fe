"""One PNG of a run's timeline (matplotlib, imported here only).

Top: every rank's step over seconds from the job's start (above 16 ranks:
the median and the min-max band), faults as red crosses on the faulty
rank's curve, each recovery as a band coloured by its strategy and
labelled, lost work (steps recomputed) hatched, checkpoints as triangles
(a dying gasp's as a star). Bottom: one lane per rank -- alive, down, its
faults -- and lanes for checkpoints and snapshots.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from trainguard.core.private import check_directory, write_replace

from .timeline import Timeline

__all__ = ["draw"]

STRATEGY_COLOURS = {"retry": "#ff9f1c", "recover-in-place": "#9b5de5", "recover": "#8d6e63",
                    "elastic-training": "#2a9d8f", "dump": "#e9c46a", "exit": "#8d99ae"}
FAULT = "#d62828"
CHECKPOINT = "#2b9348"
DUMP = "#f77f00"
SNAPSHOT = "#577590"
MAX_LANES = 16


def _strategy(ep) -> str:
    if ep.record is not None:
        return str(ep.record.get("strategy", ""))
    return str(ep.decisions[-1].get("strategy", "")) if ep.decisions else ""


def _cause(ep):
    """The fault the episode's record names (its kind and rank), else its first."""
    rec = ep.record or {}
    return next((f for f in ep.faults if f.get("kind") == rec.get("fault") and f.get("rank") == rec.get("rank")),
                ep.faults[0] if ep.faults else None)


def _curve(points, t0):
    xs = [t - t0 for t, _ in points]
    ys = [s for _, s in points]
    return xs, ys


def _band(tl: Timeline, t0: float):
    """Median, min and max step over ranks at each sample time (large jobs)."""
    times = sorted({t for points in tl.steps.values() for t, _ in points})
    last = {r: math.nan for r in tl.steps}
    idx = {r: 0 for r in tl.steps}
    med, lo, hi = [], [], []
    for t in times:
        for r, points in tl.steps.items():
            while idx[r] < len(points) and points[idx[r]][0] <= t:
                last[r] = points[idx[r]][1]
                idx[r] += 1
        vals = sorted(v for v in last.values() if v == v)
        med.append(vals[len(vals) // 2] if vals else math.nan)
        lo.append(vals[0] if vals else math.nan)
        hi.append(vals[-1] if vals else math.nan)
    return [t - t0 for t in times], med, lo, hi


def _step_at(tl: Timeline, rank: int, t: float) -> float:
    best = math.nan
    for when, step in tl.steps.get(rank, []):
        if when > t:
            break
        best = step
    return best if best == best else 0.0


def draw(tl: Timeline, out: Path, *, title: str | None = None) -> Path:
    """Write the picture of ``tl`` to ``out`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    t0, span = tl.t0, max(tl.t_end - tl.t0, 1e-3)
    min_w = span * 0.006  # a recovery of milliseconds still shows
    ranks = sorted(r for r in tl.steps if r >= 0)
    lanes = ranks if len(ranks) <= MAX_LANES else sorted({f.get("rank") for ep in tl.episodes for f in ep.faults
                                                          if isinstance(f.get("rank"), int)})[:MAX_LANES]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(12, 7.2), dpi=110,
                                      gridspec_kw={"height_ratios": [3, 1.2 + 0.12 * len(lanes)]})
    handles = []
    # ---- steps per rank
    cmap = plt.get_cmap("viridis")
    if len(ranks) <= MAX_LANES:
        for i, rank in enumerate(ranks):
            xs, ys = _curve(tl.steps[rank], t0)
            colour = cmap(0.1 + 0.75 * i / max(1, len(ranks) - 1))
            width = 1.4 + 2.2 * (len(ranks) - 1 - i) / max(1, len(ranks) - 1)  # equal curves stay visible
            top.plot(xs, ys, drawstyle="steps-post", color=colour, lw=width, label=f"rank {rank}")
            handles.append(Line2D([], [], color=colour, lw=width, label=f"rank {rank} step"))
    else:
        xs, med, lo, hi = _band(tl, t0)
        top.fill_between(xs, lo, hi, step="post", color=cmap(0.3), alpha=0.3)
        top.plot(xs, med, drawstyle="steps-post", color=cmap(0.3), lw=1.6)
        handles += [Line2D([], [], color=cmap(0.3), lw=1.6, label=f"median step of {len(ranks)} ranks"),
                    Patch(color=cmap(0.3), alpha=0.3, label="min-max over ranks")]
    ymax = max([tl.last_step(), 1] + [c.get("step", 0) for c in tl.checkpoints if isinstance(c.get("step"), int)])
    # ---- recoveries, faults, lost work
    seen_strategies = []
    symptoms = False
    for ep in tl.episodes:
        strategy = _strategy(ep)
        colour = STRATEGY_COLOURS.get(strategy, "#adb5bd")
        start, end = ep.start - t0, (ep.end if ep.end is not None else tl.t_end) - t0
        for ax in (top, bottom):
            ax.axvspan(start, max(end, start + min_w), color=colour, alpha=0.35, lw=0)
        if strategy and strategy not in seen_strategies:
            seen_strategies.append(strategy)
        tried = [f.get("strategy", "?") for f in ep.fallbacks]
        label = " -> ".join([*tried, strategy or "?"])
        top.annotate(label, (max(end, start + min_w), 1.0), xycoords=("data", "axes fraction"), xytext=(2, -4),
                     textcoords="offset points", rotation=90, va="top", ha="left", fontsize=9, color="#333333")
        rec = ep.record or {}
        main = _cause(ep)
        for f in ep.faults:
            rank = f.get("rank")
            if not isinstance(rank, int):
                continue
            step = f.get("step") if isinstance(f.get("step"), int) else _step_at(tl, rank, f["t"])
            x = f["t"] - t0
            if f is not main:  # a symptom (a peer's broken collective) or a later fault of the episode
                top.plot([x], [step], marker="x", ms=6, color=FAULT, mew=1.2, zorder=5)
                symptoms = True
                continue
            if isinstance(rec.get("step"), int):
                step = rec["step"]  # the step the recovery names (a lost rank's last heartbeat may be older)
            top.plot([x], [step], marker="X", ms=12, color=FAULT, mec="white", mew=0.8, zorder=6)
            top.annotate(f"{f.get('kind')} r{rank}", (x, step), xytext=(7, -13), textcoords="offset points",
                         fontsize=9, color=FAULT, fontweight="bold", zorder=7,
                         bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
            for ax in (top, bottom):
                ax.axvline(x, color=FAULT, ls=":", lw=1)
        lost, step = rec.get("lost_steps"), rec.get("step")
        if isinstance(lost, int) and isinstance(step, int) and lost > 0:
            reached = step + lost
            who = rec.get("rank") if rec.get("rank") in tl.steps else (ranks[0] if ranks else 0)
            again = next((t for t, s in tl.steps.get(who, [])
                          if t >= (ep.end or tl.t_end) and s >= reached), tl.t_end)
            top.fill_between([end, max(again - t0, end + min_w)], step, reached, facecolor="none",
                             edgecolor=FAULT, hatch="///", lw=0)
    # ---- start-up: from the launch (or a new controller) until every rank trains
    for begin, trained in tl.startups:
        for ax in (top, bottom):
            ax.axvspan(begin - t0, trained - t0, color="#e9ecef", lw=0, zorder=0)
        if trained - begin > span * 0.08:
            top.annotate("start-up", ((begin + trained) / 2 - t0, 0.5), xycoords=("data", "axes fraction"),
                         ha="center", fontsize=9, color="#6c757d")
    # ---- launches and controller restarts
    for launch in tl.launches[1:]:
        for ax in (top, bottom):
            ax.axvline(launch["start"] - t0, color="black", ls="--", lw=1.2)
        top.annotate("relaunch", (launch["start"] - t0, 0.02), xycoords=("data", "axes fraction"),
                     xytext=(3, 0), textcoords="offset points", fontsize=8)
    # ---- checkpoints and snapshots
    for c in tl.checkpoints:
        if isinstance(c.get("step"), int):
            x = c["t"] - t0
            top.plot([x], [c["step"]], marker="*" if c.get("dump") else "^", ms=20 if c.get("dump") else 8,
                     color=DUMP if c.get("dump") else CHECKPOINT, mec="black", mew=0.5, zorder=4)
    # ---- lanes: ranks, checkpoints, snapshots
    names = [f"rank {r}" for r in lanes] + ["checkpoints"] + (["snapshots"] if tl.snapshots else [])
    row = {r: i for i, r in enumerate(lanes)}
    ends = sorted({t for points in tl.steps.values() for t, s in points if s != s})  # launches, rounds ending
    for rank in lanes:
        begin = None
        for t, s in tl.steps.get(rank, []) + [(tl.t_end, math.nan)]:
            if s == s and begin is None:
                begin = t
            elif s != s and begin is not None:
                bottom.broken_barh([(begin - t0, t - begin)], (row[rank] - 0.3, 0.6), color="#cfe8d5")
                begin = None
    for t, down in tl.down:
        nxt = min([t2 for t2, d2 in tl.down if t2 > t and set(d2) != set(down)] + [e for e in ends if e > t]
                  + [tl.t_end])
        for rank in down:
            if rank in row:
                bottom.broken_barh([(t - t0, nxt - t)], (row[rank] - 0.3, 0.6), color="#adb5bd")
    for ep in tl.episodes:
        main = _cause(ep)
        for f in ep.faults:
            if f.get("rank") in row:
                big = f is main
                bottom.plot([f["t"] - t0], [row[f["rank"]]], marker="X" if big else "x", ms=10 if big else 6,
                            mew=0.8 if big else 1.2, color=FAULT, mec="white" if big else FAULT, zorder=5)
    ck_row, sn_row = len(lanes), len(lanes) + 1
    for c in tl.checkpoints:
        bottom.plot([c["t"] - t0], [ck_row], marker="*" if c.get("dump") else "^", ms=11 if c.get("dump") else 7,
                    color=DUMP if c.get("dump") else CHECKPOINT, mec="black", mew=0.4)
    if tl.snapshots:
        bottom.plot([s["t"] - t0 for s in tl.snapshots], [sn_row] * len(tl.snapshots), "|", ms=9, color=SNAPSHOT)
    bottom.set_yticks(range(len(names)), names, fontsize=8)
    bottom.set_ylim(len(names) - 0.4, -0.6)
    bottom.set_xlabel("seconds since the job started")
    top.set_ylabel("step (from the ranks' heartbeats)")
    top.set_ylim(-0.5, ymax * 1.08 + 1)
    top.set_xlim(-span * 0.01, span * 1.01)
    for ax in (top, bottom):
        ax.grid(True, axis="x", alpha=0.3)
    top.grid(True, axis="y", alpha=0.3)
    if tl.startups:
        handles.append(Patch(color="#e9ecef", label="start-up (launch to all ranks training)"))
    handles += [Line2D([], [], ls="", marker="X", ms=10, color=FAULT, label="fault (kind, rank)")]
    if symptoms:
        handles.append(Line2D([], [], ls="", marker="x", ms=6, mew=1.2, color=FAULT,
                              label="other fault reports (symptoms)"))
    handles += [Patch(color=STRATEGY_COLOURS.get(s, "#adb5bd"), alpha=0.5, label=f"recovery: {s}")
                for s in seen_strategies]
    if any(isinstance((ep.record or {}).get("lost_steps"), int) and ep.record["lost_steps"] > 0
           for ep in tl.episodes):
        handles.append(Patch(facecolor="none", edgecolor=FAULT, hatch="///", label="lost work (recomputed)"))
    handles += [Line2D([], [], ls="", marker="^", color=CHECKPOINT, mec="black", label="checkpoint")]
    if any(c.get("dump") for c in tl.checkpoints):
        handles.append(Line2D([], [], ls="", marker="*", ms=11, color=DUMP, mec="black", label="dying-gasp checkpoint"))
    if tl.snapshots:
        handles.append(Line2D([], [], ls="", marker="|", ms=9, color=SNAPSHOT, label="snapshot (rank 0)"))
    if any(d for _, d in tl.down):
        handles.append(Patch(color="#adb5bd", label="rank down"))
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    n_faults = len(tl.episodes)
    top.set_title(title or f"job {tl.job_id[:40] or '?'}: {tl.world_size} ranks, {tl.last_step()} steps, "
                           f"{n_faults} fault{'s' if n_faults != 1 else ''}, {len(tl.checkpoints)} checkpoints",
                  fontsize=11)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_directory(out.parent, "the picture's directory")  # another user's could swap the file for a link
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return write_replace(out, png.getvalue())  # a link at its name is replaced, never written through
