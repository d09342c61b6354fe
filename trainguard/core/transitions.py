"""The one table of legal transitions for each state enum, and the check.

Every state change in trainguard goes through :func:`advance`, so an illegal
transition (an optimizer update started twice, a resume while the controller
is dumping) is a named error at the point it happens, not a corrupt
checkpoint later.
"""

from __future__ import annotations

import enum
import threading
from typing import Generic, Mapping, TypeVar

from .api import ControllerState as C
from .api import DataStatus as D
from .api import RunStatus as R
from .api import TransitionError

__all__ = ["DATA", "RUN", "CONTROLLER", "Locked", "advance", "allowed"]

E = TypeVar("E", bound=enum.Enum)

DATA: Mapping[D, frozenset[D]] = {
    D.UPDATED: frozenset({D.UPDATING, D.COPYING}),
    D.UPDATING: frozenset({D.UPDATED, D.COPYING}),
    D.COPYING: frozenset({D.UPDATED}),
}

# A rank's own view of itself (:class:`~.processor.Processor`). Every edge
# is one the training thread takes on a path the adapters and
# :func:`~.recovery.recover` follow; the comments say which.
RUN: Mapping[R, frozenset[R]] = {
    R.STARTING: frozenset({
        R.TRAINING,    # registered with the controller (connect)
        R.STOPPED,     # a fault reported by an offline processor (no controller: it never
                       # registers), or a STOP a replacement answers before its first command
        R.RECOVERING,  # a replacement process (connect(joining=True)) stays STARTING until its
                       # recovery's first command (rebuild, repair, ...): it never trained
        R.EXITING,     # a replacement with no recovery waiting for it is told to exit
    }),
    R.TRAINING: frozenset({
        R.STOPPED,     # left its step: its own fault reported, or a STOP answered
        R.EXITING,     # an exit command with no step left first (kept from the first table;
                       # recover is entered after a report, so not taken today)
        R.FINISHED,    # close() after the last step
    }),
    R.STOPPED: frozenset({
        R.STOPPED,     # a second STOP while stopped (another rank's fault during the
                       # recovery, or a STOP to a rank that had reported its own fault)
        R.RECOVERING,  # the next recovery command
        R.TRAINING,    # resume
        R.EXITING,     # exit command
    }),
    R.RECOVERING: frozenset({
        R.STOPPED,     # the command's result was sent
        R.EXITING,     # kept from the first table; recover is STOPPED again before each command
    }),
    R.EXITING: frozenset(),
    R.FINISHED: frozenset(),
}

CONTROLLER: Mapping[C, frozenset[C]] = {
    C.INIT: frozenset({C.NORMAL, C.ABNORMAL, C.EXITED}),
    C.NORMAL: frozenset({C.ABNORMAL, C.FINISHED, C.EXITED}),
    C.ABNORMAL: frozenset({C.RECOVERING, C.DUMPING, C.EXITED}),
    C.RECOVERING: frozenset({C.NORMAL, C.ABNORMAL, C.EXITED}),
    C.DUMPING: frozenset({C.ABNORMAL, C.EXITED}),
    C.EXITED: frozenset(),
    C.FINISHED: frozenset(),
}

_TABLES: dict[type, Mapping] = {D: DATA, R: RUN, C: CONTROLLER}


def allowed(current: E, new: E) -> bool:
    """Whether ``current -> new`` is in the table for their enum."""
    return new in _TABLES[type(current)][current]


def advance(current: E, new: E, *, what: str = "") -> E:
    """Return ``new`` if the transition is legal, else raise.

    Raises:
        TransitionError: ``current -> new`` is not in the table.
    """
    if not allowed(current, new):
        subject = f"{what}: " if what else ""
        raise TransitionError(
            f"{subject}illegal {type(current).__name__} transition "
            f"{current.name} -> {new.name}"
        )
    return new


class Locked(Generic[E]):
    """A state changed from several threads: each change is checked by
    :func:`advance` and made under one lock, so a check that passed still
    holds when the state is set."""

    def __init__(self, initial: E, owner: str) -> None:
        self.value = initial
        self.lock = threading.Lock()
        self._owner = owner  # who holds the state, for the error

    def set(self, new: E, what: str) -> None:
        """Change to ``new`` (``what``: the cause, for the error).

        Raises:
            TransitionError: the change is not in the table.
        """
        with self.lock:
            self.value = advance(self.value, new, what=f"{self._owner} {what}")
