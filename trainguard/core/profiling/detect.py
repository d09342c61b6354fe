"""Slow-node detection: which rank holds the job back, and the evidence.

Two detectors run over the ranks' step rows, step by step, so the same code
serves ``trainguard slow-nodes`` (a finished job's files) and the live
check beside the controller (files as they grow):

* **Cross-rank.** In a synchronous job every rank's *step* takes as long as
  the slowest one's, because the others wait for it in communication. What
  differs is how each step splits: the slow rank computes longest and waits
  least. For each step and metric (compute = step minus communication wait
  when Communication is on; forward; data loading) each rank's value is
  divided by the median over the ranks. A rank is slow when the median of
  that ratio over a short window (fast, for large slowdowns) or a long one
  (for small ones) stays above its threshold for ``consecutive`` steps, its
  excess is a real share of the step (10% / 4%: not noise on a small span), and -- for
  compute -- it waits least in communication.
* **Time series** (TaskD's FD-OL). Each rank's own compute (or step) time,
  smoothed by a median over 5 steps, against a baseline from its first
  ``baseline_steps`` steps after warm-up: above ``max(mean * (1 +
  excess_ratio), mean + sigmas * std)`` for ``consecutive`` steps is a
  degradation. On more than half of the ranks at once it is a job-wide
  slowdown (network, storage), which no one rank explains (reported again
  when one comes back after ``long_window`` steps without); with
  Communication on, the steps' own series counts for this too (a slow link
  lengthens every rank's waits, not its compute); on fewer, it
  names a rank only while that rank is also slower than the others now --
  a rank's own history cannot tell a slow node from a machine that got
  busier for everyone.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass, field

from ..api import ConfigError
from .records import StepRow

__all__ = ["DetectorConfig", "Detector", "Finding"]

METRICS = ("compute", "fp", "data")
_VALUE = {"compute": lambda r: r.compute_s, "fp": lambda r: r.fp_s, "data": lambda r: r.data_s,
          "step": lambda r: r.step_s}


@dataclass(frozen=True, kw_only=True)
class DetectorConfig:
    warmup_steps: int = 5
    baseline_steps: int = 20
    excess_ratio: float = 0.3
    sigmas: float = 3.0
    consecutive: int = 3
    short_window: int = 8
    short_ratio: float = 1.2
    long_window: int = 40
    long_ratio: float = 1.06
    # A rank's excess must also be this share of the step: a big slowdown
    # (short window) slows the job by a tenth at least; a small one (long
    # window) by a few percent. It keeps noise on a small span (a 5 ms
    # forward pass running 2x for a few steps) from naming a rank.
    short_share: float = 0.10
    long_share: float = 0.04

    def __post_init__(self) -> None:
        for name in ("baseline_steps", "consecutive", "short_window", "long_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not (self.short_ratio > 1 and self.long_ratio > 1):
            raise ConfigError("short_ratio and long_ratio must be > 1")


@dataclass
class Finding:
    """One detection: who, how, from which step, and why."""

    rank: int | None  # None: the whole job
    how: str  # "cross-rank" | "time-series" | "job-wide"
    metric: str
    step: int
    ratio: float
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Series:
    """One rank's time series of one metric against its own baseline."""

    baseline: list = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=5))
    bound: float | None = None
    run: int = 0

    def exceeds(self, value: float, c: DetectorConfig) -> bool:
        """Add a step's value; whether the smoothed value has stayed above the bound ``consecutive`` steps."""
        self.recent.append(value)
        if len(self.recent) < self.recent.maxlen:
            return False
        value = statistics.median(self.recent)  # one late step is noise, a run of them is not
        if self.bound is None:
            self.baseline.append(value)
            if len(self.baseline) == c.baseline_steps:
                mean = statistics.fmean(self.baseline)
                self.bound = max(mean * (1 + c.excess_ratio), mean + c.sigmas * statistics.pstdev(self.baseline))
            return False
        self.run = self.run + 1 if value > self.bound else 0
        return self.run >= c.consecutive


@dataclass
class _RankTrack:
    """One rank's recent history (windows of ``window`` steps)."""

    window: int
    ratios: dict = field(init=False)
    shares: dict = field(init=False)
    waits: deque = field(init=False)
    runs: dict = field(default_factory=lambda: {m: 0 for m in METRICS})
    series: dict = field(default_factory=lambda: {"compute": _Series(), "step": _Series()})

    def __post_init__(self) -> None:
        self.ratios = {m: deque(maxlen=self.window) for m in METRICS}
        self.shares = {m: deque(maxlen=self.window) for m in METRICS}
        self.waits = deque(maxlen=self.window)


class Detector:
    """Feed steps in order with :meth:`feed`; read :attr:`findings`.

    Args:
        ranks: the ranks compared.
        config: thresholds.
    """

    def __init__(self, ranks: list[int], config: DetectorConfig = DetectorConfig()) -> None:
        self.ranks = sorted(ranks)
        self.config = config
        self.findings: list[Finding] = []
        self.slow: dict[int, Finding] = {}
        self.steps_seen = 0
        self.communication = False
        self._tracks = {r: _RankTrack(config.long_window) for r in self.ranks}
        # Per series (compute, step): the job-wide slowdown going on, by its
        # first step, and the steps since it last held (after long_window of
        # them, a new one is news). Apart, so that a slowdown of compute does
        # not hide one of communication that follows.
        self._job_wide_at: dict[str, int] = {}
        self._job_wide_clear: dict[str, int] = {}

    def feed(self, step: int, rows: dict[int, StepRow]) -> list[Finding]:
        """One step's rows (rank -> row; ranks missing from it are skipped
        for this step). Returns the findings this step added."""
        rows = {r: row for r, row in rows.items() if r in self._tracks and row.has_step}
        if not rows:
            return []
        self.steps_seen += 1
        new: list[Finding] = []
        if step < self.config.warmup_steps:
            return new
        comm = any(row.comm_spans for row in rows.values())
        self.communication = self.communication or comm
        if len(rows) >= 2:
            new += self._cross_rank(step, rows, comm)
        new += self._time_series(step, rows, comm)
        self.findings += new
        return new

    # ---------------------------------------------------------- cross-rank
    def _cross_rank(self, step: int, rows: dict[int, StepRow], comm: bool) -> list[Finding]:
        c = self.config
        step_median = statistics.median(row.step_s for row in rows.values())
        waits = {r: row.comm_s for r, row in rows.items()}
        for r in rows:
            self._tracks[r].waits.append(waits[r])
        out = []
        for metric in METRICS:
            if metric == "compute" and not comm:
                continue
            values = {r: _VALUE[metric](row) for r, row in rows.items()}
            if step_median <= 0:
                continue
            for r, value in values.items():
                # Against the others' median: with two ranks the slow one is not half the reference.
                others = statistics.median(v for o, v in values.items() if o != r)
                if others <= 0:
                    continue
                t = self._tracks[r]
                t.ratios[metric].append(value / others)
                t.shares[metric].append((value - others) / step_median)
                if self._slow_now(r, metric):
                    t.runs[metric] += 1
                else:
                    t.runs[metric] = 0
                if t.runs[metric] == c.consecutive and r not in self.slow:
                    ratio = statistics.median(list(t.ratios[metric])[-c.short_window:])
                    finding = Finding(r, "cross-rank", metric, step, round(ratio, 3),
                                      self._why(r, metric, ratio))
                    self.slow[r] = finding
                    out.append(finding)
        return out

    def _slow_now(self, rank: int, metric: str) -> bool:
        c = self.config
        t = self._tracks[rank]
        ratios, shares = list(t.ratios[metric]), list(t.shares[metric])
        for window, limit, share in ((c.short_window, c.short_ratio, c.short_share),
                                     (c.long_window, c.long_ratio, c.long_share)):
            if (len(ratios) >= window and statistics.median(ratios[-window:]) >= limit
                    and statistics.median(shares[-window:]) >= share):
                if metric != "compute":
                    return True
                # The rank that computes slowly is the one the others wait for: it waits least.
                mine = statistics.median(list(t.waits)[-window:])
                if all(mine <= statistics.median(list(o.waits)[-window:])
                       for r, o in self._tracks.items() if r != rank and o.waits):
                    return True
        return False

    def _why(self, rank: int, metric: str, ratio: float) -> str:
        what = {"compute": "computes", "fp": "runs its forward pass", "data": "loads data"}[metric]
        text = f"rank {rank} {what} {ratio:.2f}x as long as the other ranks' median"
        if metric == "compute":
            text += " and waits least in communication"
        return text

    # --------------------------------------------------------- time series
    def _time_series(self, step: int, rows: dict[int, StepRow], comm: bool) -> list[Finding]:
        c = self.config
        metric = "compute" if comm else "step"
        exceeding = [r for r, row in rows.items() if self._tracks[r].series[metric].exceeds(_VALUE[metric](row), c)]
        # With Communication on, the steps' own series too: a slow link
        # leaves every rank's compute as it was and lengthens its waits.
        waiting = [r for r, row in rows.items() if self._tracks[r].series["step"].exceeds(row.step_s, c)] if comm else []
        out, job_wide = [], False
        compute_too = len(exceeding) * 2 > len(self.ranks)
        for series, ranks in [(metric, exceeding)] + ([("step", waiting)] if comm else []):
            if len(ranks) * 2 <= len(self.ranks):
                if series in self._job_wide_at:
                    self._job_wide_clear[series] = self._job_wide_clear.get(series, 0) + 1
                    if self._job_wide_clear[series] >= c.long_window:  # over: the next one is news again
                        del self._job_wide_at[series]
                continue
            job_wide, self._job_wide_clear[series] = True, 0
            if series not in self._job_wide_at:
                self._job_wide_at[series] = step
                out.append(Finding(None, "job-wide", series, step, 0.0, (
                    f"{len(ranks)} of {len(self.ranks)} ranks exceed their {series} baseline together: a "
                    f"job-wide slowdown, not one slow rank" + (
                        "; their compute did not slow: communication did (a slow link?)"
                        if series == "step" and comm and not compute_too else ""))))
        if job_wide:
            return out
        for r in exceeding:
            t = self._tracks[r]
            # A rank's own history alone cannot tell a slow node from a busy
            # machine: it is named only while the others are faster now.
            ratios = list(t.ratios["compute" if comm else "fp"])[-c.short_window:]
            if r in self.slow or not ratios or statistics.median(ratios) < c.long_ratio:
                continue
            s = t.series[metric]
            mean = statistics.fmean(s.baseline)
            value = statistics.median(s.recent)
            finding = Finding(r, "time-series", metric, step, round(value / mean, 3),
                              f"rank {r}'s {metric} time ({value * 1e3:.1f} ms) stayed above its baseline bound "
                              f"{s.bound * 1e3:.1f} ms (mean {mean * 1e3:.1f} ms over {c.baseline_steps} steps) for "
                              f"{c.consecutive} steps, while the other ranks are faster")
            self.slow[r] = finding
            out.append(finding)
        return out
