"""A run directory's ``events.jsonl`` read without trusting it.

Anyone who could write the run directory may have written the file: it is
read without following a link (a regular file only), a line at a time (at
most :data:`MAX_LINE` bytes); a line that is not a JSON object with a
finite time and a name is skipped and counted; every value is made
harmless (:func:`_value`: finite numbers, text with its control characters
written out -- a terminal would obey them --, short and shallow lists) and
each field the timeline reads is checked for its type and range
(:data:`_FIELDS`: ranks below :data:`MAX_RANKS`, steps and seconds finite)
and dropped otherwise.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from trainguard.core.events import EVENTS
from trainguard.core.private import open_read

__all__ = ["MAX_BYTES", "MAX_LINE", "MAX_RANKS", "RunDirError", "read_events"]

#: The largest events file read (a month of a 4096-rank job's samples is far below).
MAX_BYTES = 512 << 20
#: The longest line read (a ``steps`` event of 65,536 ranks is about 400 KiB); longer ones are skipped.
MAX_LINE = 4 << 20
#: Ranks past this are no rank of a job trainguard ran.
MAX_RANKS = 1 << 17
_TEXT = 600  # longest text kept of a field (what the writer keeps, trainguard.core.events.MAX_TEXT)
_NUMBER = 1e15  # steps, seconds, counts beyond this are no trainguard number


class RunDirError(Exception):
    """The run directory is missing, unreadable or holds no events."""


def _text(value) -> str:
    """``value`` as text a terminal shows as it is: control characters (escapes, newlines) written out."""
    text = value if isinstance(value, str) else str(value)
    text = text[:_TEXT]
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _number(value, least: float = 0.0):
    """``value`` when it is a finite number in ``[least, 1e15]`` (not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value_f = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value_f) and least <= value_f <= _NUMBER else None


def _rank(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_RANKS else None


def _value(value, depth: int = 0):
    """Any field's value made harmless: finite numbers, escaped text, short and shallow lists and objects
    (``None`` for anything else)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return _number(value, least=-_NUMBER)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list) and depth < 4:
        return [_value(v, depth + 1) for v in value[:MAX_RANKS]]
    if isinstance(value, dict) and depth < 4:
        return {_text(k): _value(v, depth + 1) for k, v in list(value.items())[:256]}
    return None


# The fields the timeline reads, and what keeps each (a value that fails is dropped).
_FIELDS = {
    "rank": _rank, "world_size": _rank, "step": _number, "recover_s": _number, "detect_s": _number,
    "lost_steps": lambda v: _number(v) if isinstance(v, int) else None, "joining": lambda v: v is True,
    "code": lambda v: v if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 31 else None,
    "steps": lambda v: [_number(x) for x in v[:MAX_RANKS]] if isinstance(v, list) else None,
    "down": lambda v: [r for r in v[:MAX_RANKS] if _rank(r) is not None] if isinstance(v, list) else None,
    "strategies": lambda v: [_text(x) for x in v[:16]] if isinstance(v, list) else None,
    **dict.fromkeys(("kind", "strategy", "fault", "state", "job_id", "name", "path"),
                    lambda v: _text(v) if isinstance(v, str) else None),
}


def _clean(ev) -> dict | None:
    """The event with every field made harmless (:func:`_value`) and each one the timeline reads checked
    (:data:`_FIELDS`), or ``None`` when it has no finite time and a name."""
    if not isinstance(ev, dict) or not isinstance(ev.get("ev"), str):
        return None
    t = _number(ev.get("t"), least=-_NUMBER)
    if t is None:
        return None
    out = {_text(k): _value(v) for k, v in list(ev.items())[:256] if k not in ("t", "ev")}
    for key, keep in _FIELDS.items():
        if key in out:
            value = keep(ev[key])
            if value is None:
                del out[key]
            else:
                out[key] = value
    out.update(t=float(t), ev=_text(ev["ev"]))
    return out


def _lines(fd: int):
    """The file's lines, each at most :data:`MAX_LINE` bytes (``None`` for a longer one)."""
    with os.fdopen(fd, "rb") as f:
        while line := f.readline(MAX_LINE + 1):
            if len(line) > MAX_LINE and not line.endswith(b"\n"):
                while (rest := f.readline(MAX_LINE)) and not rest.endswith(b"\n"):
                    pass
                yield None
            else:
                yield line


def read_events(directory: Path) -> tuple[list[dict], int]:
    """The events of ``directory``'s events file, in time order, and how many lines were skipped.

    Raises:
        RunDirError: no such directory, no events file, nothing readable in it.
    """
    if not directory.exists():
        raise RunDirError(f"no run directory {directory}")
    if not directory.is_dir():
        raise RunDirError(f"{directory} is not a directory (give the run directory, the one --run-dir named)")
    path = directory / EVENTS
    try:
        fd = open_read(path)
    except FileNotFoundError:
        raise RunDirError(f"no {EVENTS} in {directory}: was the job started with `trainguard run --run-dir "
                          f"{directory}` (or TRAINGUARD_RUN_DIR={directory})?") from None
    except OSError as e:
        raise RunDirError(f"cannot read {path}: {e.strerror or e} (a link, or no regular file, is not read)") from None
    if os.fstat(fd).st_size > MAX_BYTES:
        os.close(fd)
        raise RunDirError(f"{path} is over {MAX_BYTES >> 20} MiB: not an events file trainguard wrote")
    events, skipped = [], 0
    try:
        for line in _lines(fd):
            if line is None:
                skipped += 1
                continue
            if not line.strip():
                continue
            try:
                ev = _clean(json.loads(line.decode("utf-8", errors="replace")))
            except (ValueError, RecursionError):
                ev = None
            if ev is None:
                skipped += 1
            else:
                events.append(ev)
    except OSError as e:
        raise RunDirError(f"cannot read {path}: {e.strerror or e}") from None
    if not events:
        raise RunDirError(f"{path} holds no readable event ({skipped} lines, none a trainguard event): "
                          f"corrupt, or not written by trainguard")
    events.sort(key=lambda e: e["t"])  # stable: one writer's order is kept
    return events, skipped
