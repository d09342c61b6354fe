"""The records a step's files leave for the finalising persist, and what a
finaliser that gave up on a step removes.

Each file written into a step's temporary directory -- by a persist
worker, or by a rank beside it (its own part) -- is recorded under
``<step>_tmp/.records/``; the finaliser waits for every expected record,
then writes the manifest. A file that could not be written is recorded as
failed, and the finaliser gives up on the step: :class:`Leftovers` removes
its temporary directory once the other ranks are done with it. A file whose
writer was lost before it wrote it (the process died; its replacement does
not write the step) is marked lost by a survivor (:func:`give_up`), and the
finaliser gives up on the step at once rather than wait for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from ..checkpoint import TMP_SUFFIX, CheckpointStore, FileInfo, io_error

__all__ = ["FAILED", "LOST", "RECORDS", "Leftover", "Leftovers", "give_up", "record_path", "write_record"]

RECORDS = ".records"
FAILED = ".failed"  # the suffix of a record saying its file could not be written
LOST = ".lost"  # the suffix of a record saying its file's writer was lost before it wrote it
#: How long a finalising worker that gave up on a step waits, beside its other work, for the other ranks'
#: records before it removes the step's directory (a rank still writing would make it again); once its
#: trainer closed it, at most :data:`CLOSING_GRACE_S` more (the trainer waits for it to exit).
GIVE_UP_GRACE_S = 5.0
CLOSING_GRACE_S = 0.5


def record_path(tmp: Path, name: str) -> Path:
    return tmp / RECORDS / (name.replace("/", "__") + ".json")


def write_record(store: CheckpointStore, step: int, info: FileInfo) -> None:
    """Record a file written into ``step``'s temporary directory, for the
    finalising persist to collect (whole or not at all: it may read at once);
    ``bytes=-1``: it could not be written, and the step is not finalised.
    That record is an empty file (``<name>.failed``): it needs no data
    block, so a full store still takes it and the finaliser stops waiting.

    Raises:
        CheckpointError: the store did not take the record.
    """
    record = record_path(store.tmp_path(step), info.name)
    part = record.with_suffix(".part")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)  # a failed record may come first
        if info.bytes < 0:
            record.with_suffix(FAILED).touch()
            return
        part.write_text(json.dumps([info.name, info.bytes, info.sha256, info.xxh3]))
        os.replace(part, record)
    except OSError as e:
        with contextlib.suppress(OSError):  # (none was made where the directory could not be)
            part.unlink(missing_ok=True)
        raise io_error(f"recording {info.name} of step {step}", e) from None


def give_up(store: CheckpointStore, step: int, names: list[str]) -> list[str]:
    """Mark each of ``names`` (files of ``step`` whose writers were lost)
    that is not recorded yet as lost, so the finaliser waiting for it gives
    up on the step; returns those marked. A file already recorded stays:
    its writer wrote it before it was lost (the step may still complete).

    Raises:
        CheckpointError: the store did not take a mark.
    """
    tmp, marked = store.tmp_path(step), []
    for name in names:
        record = record_path(tmp, name)
        if record.is_file():
            continue
        try:
            # Never made here: without its directory, the finaliser is done with the step (it removes the
            # records once every one is in, and this one was not), or it gave up on it.
            record.with_suffix(LOST).touch()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise io_error(f"marking {name} of step {step} lost", e) from None
        marked.append(name)
    return marked


@dataclasses.dataclass
class Leftover:
    """A step a finaliser gave up on, to remove from the store."""

    store: CheckpointStore
    step: int
    others: list[Path]  # the other ranks' records
    deadline: float

    def due(self, now: float) -> bool:
        return now >= self.deadline or self.final() or \
            all(p.is_file() or p.with_suffix(FAILED).exists() or p.with_suffix(LOST).exists() for p in self.others)

    def final(self) -> bool:
        """Whether a newer or the same step is final meanwhile (its finalise
        removed the older directories, or a dying gasp made this step)."""
        newest = self.store.tracked_step()
        return newest is not None and newest >= self.step

    def remove(self) -> None:
        """Remove the temporary directories of the step and of older steps
        (none of them can be finalised any more), unless :meth:`final`."""
        if self.final():
            return
        try:
            paths = [p for p in self.store.root.iterdir() if p.name.endswith(TMP_SUFFIX)]
        except OSError:  # the store is gone, or not readable: nothing to give back
            return
        for path in paths:
            old = self.store.naming.step_of(path.name[:-len(TMP_SUFFIX)])
            if old is not None and old <= self.step:
                shutil.rmtree(path, ignore_errors=True)


class Leftovers:
    """The steps a finalising worker gave up on, removed once every other
    rank's record is in (or :data:`GIVE_UP_GRACE_S` passed): a rank still
    writing its file of the step would make the directory again after it
    was removed. The worker checks between requests, so waiting here keeps
    no snapshot slot from training, and before it exits."""

    def __init__(self) -> None:
        self.pending: list[Leftover] = []

    def add(self, leftover: Leftover) -> None:
        self.pending.append(leftover)
        self.check()

    def check(self, *, last: bool = False) -> None:
        """Remove the steps that are due; ``last`` (the trainer closed the
        worker): every one, waiting at most :data:`CLOSING_GRACE_S`."""
        end = time.monotonic() + CLOSING_GRACE_S
        while self.pending:
            now = time.monotonic()
            for leftover in [p for p in self.pending if (last and now >= end) or p.due(now)]:
                self.pending.remove(leftover)
                leftover.remove()
            if not last or not self.pending:
                return
            time.sleep(0.05)
