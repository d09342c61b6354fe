"""What a rank leaves behind for ``trainguard rehearse``.

``trainguard rehearse`` runs the user's script, unedited, once fault-free and
once per fault case, each run in a directory of its own named by
``TRAINGUARD_REHEARSAL_DIR``. Under it a guard:

* saves its checkpoints in ``<dir>/checkpoints`` instead of the script's
  ``checkpoint_dir`` (so the cases do not resume from one another, and a
  dump's relaunch resumes from its own run);
* appends, at every commit, one line to ``<dir>/trace/r<rank>.jsonl``: the
  step and fingerprints of what the step left -- the model, the optimizer,
  the learning rates, the scheduler, the scaler, each extra, this rank's
  random streams, its data position (XXH3-64, hex). A recovery rolls steps
  back and they are traced again: the last line of a step is the one that
  counts (a periodic save adds ``"saved": true`` to its step). Each launch
  that loaded its state (or started afresh) first appends ``{"start": step}``
  (:func:`read_launches`: where each launch started and how far it got).
  Rehearse compares the traces of a case and the fault-free run to say
  *why* a case went wrong (the streams differed first, or the batch, or the
  scaler...), and whether a relaunch trained steps again from an older save;
* writes, when training finished, ``<dir>/final/r<rank>.json``: the guard's
  report (steps, state hash, recoveries, PIDs) and the final fingerprints.

Framework-free: the adapters compute the fingerprints.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ENV", "Rehearsal", "read_final", "read_launches", "read_trace"]

log = logging.getLogger("trainguard.rehearsal")

ENV = "TRAINGUARD_REHEARSAL_DIR"


class Rehearsal:
    """One rank's side of a rehearsal run (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        self.directory, self.rank = Path(directory), rank
        (self.directory / "trace").mkdir(parents=True, exist_ok=True)
        self._trace = open(self.directory / "trace" / f"r{rank}.jsonl", "a", buffering=1)

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] = os.environ) -> "Rehearsal | None":
        directory = environ.get(ENV)
        return cls(directory, rank) if directory else None

    def checkpoint_dir(self, given: str | os.PathLike | None) -> Path:
        """Where this run's checkpoints go, whatever the script named."""
        path = self.directory / "checkpoints"
        if self.rank == 0:
            log.info("rehearsal: checkpoints go to %s (the script names %s)", path, given)
        return path

    def fault_log(self) -> Path:
        """Where the fault injector logs its strikes when the script names no
        checkpoint directory (so a relaunch does not strike them again)."""
        return self.directory / "checkpoints" / ".trainguard" / "faults.jsonl"

    def started(self, step: int) -> None:
        """This launch starts training at ``step`` (what it loaded; 0: nothing)."""
        self._write({"start": step, "t": round(time.time(), 3)})

    def step(self, step: int, fingerprints: Mapping[str, str | None]) -> None:
        """``step`` was committed with these fingerprints."""
        self._write({"step": step, "t": round(time.time(), 3), **fingerprints})

    def saved(self, step: int) -> None:
        """A periodic checkpoint of ``step`` was asked for."""
        self._write({"step": step, "saved": True})

    def _write(self, entry: dict) -> None:
        self._trace.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def final(self, report: Mapping[str, Any]) -> None:
        """Training finished: what the run ended with."""
        final = self.directory / "final"
        final.mkdir(exist_ok=True)
        tmp = final / f"r{self.rank}.json.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(final / f"r{self.rank}.json")

    def close(self) -> None:
        self._trace.close()


def _entries(directory: str | os.PathLike, rank: int) -> list[dict]:
    """A rank's trace entries in order; a line cut short by a kill is skipped."""
    try:
        lines = (Path(directory) / "trace" / f"r{rank}.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def read_trace(directory: str | os.PathLike, rank: int) -> dict[int, dict]:
    """A rank's trace: step -> its last fingerprints (empty when none)."""
    out: dict[int, dict] = {}
    for entry in _entries(directory, rank):
        step = entry.pop("step", None)
        if isinstance(step, int):
            out.setdefault(step, {}).update(entry)
    return out


def read_launches(directory: str | os.PathLike, rank: int) -> list[dict]:
    """A rank's launches, in order: ``{"start": step it started at, "last":
    the highest step it traced}`` (empty: none traced)."""
    out: list[dict] = []
    for entry in _entries(directory, rank):
        if isinstance(entry.get("start"), int):
            out.append({"start": entry["start"], "last": entry["start"]})
        elif isinstance(entry.get("step"), int) and out:
            out[-1]["last"] = max(out[-1]["last"], entry["step"])
    return out


def read_final(directory: str | os.PathLike) -> dict[int, dict]:
    """Every rank's final report of a run, by rank (empty: it did not finish)."""
    out = {}
    for path in sorted((Path(directory) / "final").glob("r*.json")):
        try:
            out[int(path.stem[1:])] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
    return out
