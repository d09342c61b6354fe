"""``trainguard slow-nodes DIR``: the verdict on a job's records, as a table,
JSON and a plot."""

from __future__ import annotations

import statistics
from pathlib import Path

from .detect import Detector, DetectorConfig
from .records import StepRow, load_rows

__all__ = ["analyse", "plot", "table"]

#: (StepRow attribute, table heading, JSON key of the per-rank median in ms)
_COLUMNS = (("step_s", "step", "step_ms"), ("compute_s", "compute", "compute_ms"), ("fp_s", "forward", "fp_ms"),
            ("data_s", "data", "data_ms"), ("comm_s", "comm wait", "comm_wait_ms"), ("save_s", "save", "save_ms"))
_KEY = {attr: key for attr, _, key in _COLUMNS}


def run_detector(rows: dict[int, dict[int, StepRow]], config: DetectorConfig = DetectorConfig()) -> Detector:
    """Feed every step, in order, to a detector over the ranks in ``rows``."""
    detector = Detector(list(rows), config)
    for step in sorted({s for by_step in rows.values() for s in by_step}):
        detector.feed(step, {r: by_step[step] for r, by_step in rows.items() if step in by_step})
    return detector


def analyse(job_dir: Path, config: DetectorConfig = DetectorConfig()) -> dict:
    """The verdict and its evidence for one job directory (JSON-able)."""
    rows, bad = load_rows(job_dir)
    detector = run_detector(rows, config)
    per_rank = {}
    for rank, by_step in rows.items():
        kept = [row for s, row in sorted(by_step.items()) if s >= config.warmup_steps and row.has_step]
        summary = {"steps": len(kept)}
        for attr, _, key in _COLUMNS:
            values = [getattr(row, attr) for row in kept]
            summary[key] = round(statistics.median(values) * 1e3, 3) if values else None
        summary["slow"] = rank in detector.slow
        per_rank[str(rank)] = summary
    return {
        "job_dir": str(job_dir),
        "ranks": sorted(rows),
        "steps": detector.steps_seen,
        "communication_markers": detector.communication,
        "slow_ranks": sorted(detector.slow),
        "findings": [f.to_dict() for f in detector.findings],
        "per_rank": per_rank,
        "unreadable_lines": bad,
    }


def table(result: dict) -> str:
    """A fixed-width table of per-rank medians (ms), the slow ranks marked."""
    head = f"{'rank':>5} " + " ".join(f"{label:>10}" for _, label, _ in _COLUMNS) + "  verdict"
    lines = [f"job {result['job_dir']}: {len(result['ranks'])} ranks, {result['steps']} steps; "
             f"medians in ms after warm-up" + ("" if result["communication_markers"]
                                              else " (Communication markers were off: no wait split)"), head]
    for rank in result["ranks"]:
        s = result["per_rank"][str(rank)]
        cells = " ".join(f"{s[key]:>10.2f}" if s[key] is not None else f"{'-':>10}" for _, _, key in _COLUMNS)
        lines.append(f"{rank:>5} {cells}  {'SLOW' if s['slow'] else 'ok'}")
    if result["findings"]:
        lines.append("")
        lines += [f"step {f['step']}: {f['reason']}" for f in result["findings"]]
    lines.append("")
    lines.append("slow ranks: " + (", ".join(map(str, result["slow_ranks"])) or "none"))
    return "\n".join(lines)


def plot(job_dir: Path, result: dict, out: Path) -> Path:
    """A PNG: each rank's compute (or step) time and communication wait per
    step, slow ranks in red, with per-rank medians beside.

    Raises:
        ImportError: matplotlib is missing (``pip install trainguard[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = load_rows(job_dir)
    comm = result["communication_markers"]
    fig, axes = plt.subplots(1 + comm, 2, figsize=(13, 4 + 3 * comm), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    panels = [("compute_s" if comm else "step_s", "compute (step - comm wait)" if comm else "step")]
    if comm:
        panels.append(("comm_s", "communication wait"))
    for i, (attr, label) in enumerate(panels):
        ax, bars = axes[i][0], axes[i][1]
        medians = []
        for rank, by_step in sorted(rows.items()):
            steps = sorted(s for s, r in by_step.items() if r.has_step)
            slow = rank in result["slow_ranks"]
            ax.plot(steps, [getattr(by_step[s], attr) * 1e3 for s in steps], lw=1.6 if slow else 0.7,
                    color="tab:red" if slow else None, alpha=1.0 if slow else 0.6,
                    label=f"rank {rank}" + (" (slow)" if slow else ""), zorder=3 if slow else 2)
            medians.append((rank, result["per_rank"][str(rank)][_KEY[attr]] or 0.0, slow))
        for f in result["findings"]:
            if f["rank"] is not None:
                ax.axvline(f["step"], color="tab:red", ls="--", lw=0.8)
        ax.set_title(f"{label} per step (ms)")
        ax.set_xlabel("step")
        if len(rows) <= 16:
            ax.legend(fontsize=7, ncol=2)
        bars.bar([str(r) for r, _, _ in medians], [m for _, m, _ in medians],
                 color=["tab:red" if s else "tab:gray" for _, _, s in medians])
        bars.set_title(f"median {label} (ms)")
        bars.set_xlabel("rank")
    slow = ", ".join(map(str, result["slow_ranks"])) or "none"
    fig.suptitle(f"{Path(result['job_dir']).name}: slow ranks {slow}")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
