"""How far a launch got, for the launch that resumes after it.

A job that stops without a dying gasp -- nothing consistent could be saved,
so its ranks exit 76 (77: a hung rank was ended) -- leaves only older
checkpoints, and its relaunch trains the steps between the newest one and
where the launch had got again. Those are lost steps as much as a
recovery's: the ranks that leave on the controller's exit command note the
step they committed in ``<checkpoint_dir>/.trainguard/reached.json`` (the
highest noted wins), and a launch that resumes below it adds a record of
the redone steps to the job's history (:func:`redone`), so the report's
``lost_steps`` counts them. A job killed as a whole (every process at once)
notes nothing.

A few ranks spread over the job note (:func:`notes`), not every one: a
thousand ranks renaming one file on shared storage at once helps no one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["note", "notes", "redone"]

log = logging.getLogger("trainguard.rank")

#: How many ranks, spread over the job, note how far it got.
NOTERS = 8


def _path(root: str | os.PathLike) -> Path:
    return Path(root) / ".trainguard" / "reached.json"


def notes(rank: int, world_size: int) -> bool:
    """Whether ``rank`` is one of the ranks that note how far the job got."""
    return rank % max(1, world_size // NOTERS) == 0 or rank == world_size - 1


def note(root: str | os.PathLike, rank: int, step: int, why: str) -> None:
    """``rank`` leaves the job having committed ``step`` (``why``: the
    controller's reason). Failing to write only loses this count."""
    path = _path(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if _read(path).get("step", -1) >= step:
            return
        tmp = path.with_name(f"{path.name}.r{rank}.tmp")
        tmp.write_text(json.dumps({"step": step, "why": why[:300]}))
        tmp.replace(path)
    except OSError as e:
        log.debug("rank %d could not note step %d in %s: %s", rank, step, path, e)


def redone(root: str | os.PathLike, resumed: int, *, say: bool = True) -> dict | None:
    """The history record of a launch that resumes at ``resumed`` below the
    step an earlier launch noted (``None``: it did not); ``say``: log it."""
    noted = _read(_path(root))
    reached = noted.get("step")
    if not isinstance(reached, int) or reached <= resumed:
        return None
    why = str(noted.get("why", ""))
    if say:
        log.warning("the last launch reached step %d (%s); this one resumes from step %d and trains %d steps again",
                    reached, why or "it stopped without a dying gasp", resumed, reached - resumed)
    return {"fault": "stopped", "rank": -1, "step": resumed, "strategy": "relaunch",
            "reason": f"the last launch reached step {reached} and stopped without a checkpoint of it"
                      f"{': ' + why if why else ''}; resumed from step {resumed}",
            "detect_s": None, "recover_s": None, "lost_steps": reached - resumed, "detected_at": None,
            "message": why}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
