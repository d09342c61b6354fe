"""The bracket around a torch step's optimizer update, and what it probes.

The Guard's optimizer wrapper (:class:`.optimizer.GuardedOptimizer`) calls
:meth:`UpdateBracket.start` before the update and :meth:`UpdateBracket.end`
after it. The start is where the state stops being the last commit's: it
holds the step API's rules (the update runs inside a step begun with
``begin_step`` or ``protect``, once per step), settles a snapshot copy
still reading the parameters, records this rank's own part (random streams,
data position) for a dump made after the rank is lost, makes DDP's buffers
identical on every replica, and tells the processor. A step committed
without an update (a ``GradScaler`` skipped it) starts one at the commit
(:meth:`UpdateBracket.finish`). The end is where an injected
``phase=optimizer`` fault strikes.

The probes (:class:`.undeclared.Undeclared`) look at the update's caller and
the loop: a ``GradScaler`` stepping the optimizer that was not given to the
Guard, a ``DataLoader`` iterated but not given as ``data=``. What they found
goes into a rehearsal's fingerprints (:meth:`UpdateBracket.pieces`) and its
final report (:attr:`UpdateBracket.found`).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import torch

from trainguard.core import ConfigError

from .optimizer import GuardedOptimizer
from .undeclared import Undeclared

__all__ = ["UpdateBracket"]

NOT_IN_STEP = (
    "guard.optimizer.step() was called outside a step: begin each step with guard.begin_step() and end it with "
    "guard.end_step() (or wrap its body in `with guard.protect():`); for a framework's trainer use its "
    "integration (trainguard.integrations.hf, .lightning, .accelerate)")
TWICE = ("guard.optimizer.step() was called twice in one step: one optimizer update per step (guard.end_step(), or "
         "the end of `with guard.protect():`, commits each)")


class _Rank(Protocol):
    """What the bracket uses of its :class:`~.guard.Guard`."""

    rank: int
    state: Any  # a .trainstate.TrainState
    ddp: Any  # the DistributedDataParallel, or None
    processor: Any
    injector: Any
    _step: int
    _in_step: bool

    def _settle_snapshot(self) -> None: ...

    def _record_own_at_update(self) -> None: ...


class UpdateBracket:
    """The optimizer update of one :class:`~.guard.Guard`'s steps.

    Args:
        guard: the Guard (its processor and injector are read at each update).
        optimizer: the optimizer the script gave; :attr:`optimizer` wraps it.
        scaler: the ``GradScaler`` given (``None``: none).
        data: the data position given.
    """

    def __init__(self, guard: _Rank, optimizer: torch.optim.Optimizer, scaler: Any, data: Any) -> None:
        self._guard = guard
        self.optimizer = GuardedOptimizer(optimizer, self.start, self.end)
        optimizers = {"optimizer": optimizer, "guarded": self.optimizer}  # what a scaler may step, by name
        if guard.state.scaler is not None:
            guard.state.scaler.optimizers.update(optimizers)
        self.undeclared = Undeclared(scaler, data, optimizers, warn=guard.rank == 0)
        self.updated = False  # the step's update ran

    def start(self) -> None:
        """The update starts (called by the wrapper's ``step``)."""
        g = self._guard
        if not g._in_step:
            raise ConfigError(NOT_IN_STEP)
        if self.updated:
            raise ConfigError(TWICE)
        self.undeclared.update_starts(sys._getframe(1))  # a GradScaler not given to the Guard steps?
        g._settle_snapshot()  # a snapshot copy of the last step may still be reading parameters
        g._record_own_at_update()
        if g.ddp is not None and g.ddp.will_sync_module_buffers():
            # Make buffers (BatchNorm statistics) identical on every replica
            # before the update, so any replica can serve or save the step.
            g.ddp._sync_buffers()
        g.processor.start_update()

    def end(self) -> None:
        """The update ended (called by the wrapper's ``step``)."""
        self._guard.injector.strike("optimizer", self._guard._step)
        self.updated = True

    def finish(self) -> None:
        """Before the commit: a step without an update (a ``GradScaler``
        skipped it) starts one now, so the processor sees every step's."""
        if not self.updated:
            self.start()

    def reset(self) -> None:
        """A new step, or a rollback: no update ran."""
        self.updated = False

    def loop_ran(self, frame) -> None:
        """The first step of the process ended; ``frame``: the loop's."""
        self.undeclared.loop_ran(frame)

    @property
    def found(self) -> dict[str, str]:
        """What the probes found (``scaler``, ``data``), in words."""
        return dict(self.undeclared.found)

    def pieces(self, pieces: dict) -> dict:
        """``pieces`` (the committed state's, for a rehearsal) with a
        scaler found stepping but not given."""
        if self.undeclared.scaler is not None and "scaler" not in pieces:
            pieces["scaler"] = self.undeclared.scaler.state_dict()
        return pieces
