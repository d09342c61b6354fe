"""The job's history as one rank knows it, and the context manager around
one step's body.

A job's history is the list of recoveries and the PIDs each rank had, over
every launch. It travels inside checkpoints (a relaunch continues it) and
with a replica's state (a new process takes it over), and ends in the report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .contract import StepBody

__all__ = ["JobHistory", "Protected"]


class JobHistory:
    """A mix-in for a guard; it sets ``history`` (from a checkpoint or a
    replica), ``records`` (this launch's recoveries) and ``pids`` (rank ->
    PID of this launch)."""

    history: dict
    records: list[dict]
    pids: dict[int, int]

    def merged_history(self, controller: Mapping[str, Any]) -> dict:
        """Records and PIDs of every launch so far, plus ``controller``'s
        (its ``records`` and ``pids``), for a checkpoint or a report."""
        pids = {k: list(v) for k, v in self.history.get("pids", {}).items()}
        for rank, pid in self.pids.items():
            seen = pids.setdefault(str(rank), [])
            if pid not in seen:
                seen.append(pid)
        for rank, more in controller.get("pids", {}).items():
            seen = pids.setdefault(str(rank), [])
            seen.extend(p for p in more if p not in seen)
        records = list(self.history.get("records", [])) + self.records + list(controller.get("records", []))
        return {"records": records, "pids": pids}

    def replaced_ranks(self, pids: Mapping[str, list] | None) -> list[int]:
        """The ranks a recovery gave new processes: those with a PID in
        ``pids`` (a Resume's, before :meth:`record_resume`) not known yet."""
        known = self.merged_history({})["pids"]
        return sorted(int(r) for r, seen in (pids or {}).items() if any(p not in known.get(str(r), []) for p in seen))

    def resumed_after_dump(self, step: int) -> str:
        """The cause of the dying gasp this rank resumed from at ``step`` (the history's last record
        is a dump of that step), or "" (the controller stops a relaunch that fails alike)."""
        records = self.history.get("records") or []
        last = records[-1] if records and isinstance(records[-1], dict) else {}
        if step > 0 and last.get("strategy") == "dump" and last.get("step") == step:
            return str(last.get("cause") or last.get("fault") or "")[:200]
        return ""

    def record_resume(self, record: dict, pids: Mapping[str, list] | None) -> None:
        """A recovery ended: keep its record and the PIDs the controller saw."""
        if record:
            self.records.append(record)
        for rank, seen in (pids or {}).items():
            known = self.history.setdefault("pids", {}).setdefault(rank, [])
            known.extend(p for p in seen if p not in known)

    def history_report(self) -> dict:
        """The report's ``lost_steps``, ``pids`` (per rank, every launch) and ``recoveries``."""
        history = self.merged_history({})
        return {
            "lost_steps": sum(max(0, r.get("lost_steps", 0)) for r in history["records"]),
            "pids": {int(k): v for k, v in sorted(history["pids"].items(), key=lambda kv: int(kv[0]))},
            "recoveries": history["records"],
        }


class Protected:
    """``with guard.protect():`` -- :meth:`begin_step` on entry; on a clean
    exit :meth:`end_step`; an ``Exception`` from the body goes to
    :meth:`fail_step`, which recovers it (it is swallowed) or raises."""

    def __init__(self, guard: "StepBody") -> None:
        self.guard = guard

    def __enter__(self) -> "Protected":
        self.guard.begin_step()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.guard.end_step()
            return False
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
            return False
        self.guard.fail_step(exc)
        return True
