"""State the training loop uses but did not give the Guard.

A GradScaler left out of ``Guard(scaler=)`` restarts at its initial scale
after a relaunch, and after a repair one replica scales its gradients by
another factor than the others; a loader left out of ``data=`` restarts at
its first batch. Neither fails: the job goes on, no longer identical to a
fault-free run. :class:`Undeclared` finds both before they matter and says
so once (rank 0, a WARNING):

* a scaler, at the first update it starts (``scaler.step(guard.optimizer)``
  calls the optimizer's ``step`` from the scaler, :func:`.scaler.stepping_scaler`);
* a loader, after the first step: an iterator of a ``DataLoader`` (torch's
  or torchdata's) held by the loop's own frame -- in a variable, inside a
  generator it holds, or on an object of the script's own classes -- that is
  not the one given as ``data=``.

What it found also goes into a rehearsal's fingerprints and final report,
so ``trainguard rehearse`` names it as the cause when the runs part.
"""

from __future__ import annotations

import logging
import types
from types import FrameType
from typing import Any, Iterator

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .data import ResumableLoader, StatefulLoaderPosition
from .scaler import ScalerState, stepping_scaler

__all__ = ["Undeclared"]

log = logging.getLogger("trainguard.torch")


class Undeclared:
    """What one rank's loop uses that its Guard was not given.

    Args:
        scaler: the scaler given (``None``: none).
        data: the data position given (as :func:`.data.resumable` made it).
        optimizers: the names of the optimizers a scaler may step
            (:class:`.scaler.ScalerState`).
        warn: say what was found (rank 0).
    """

    def __init__(self, scaler: Any, data: Any, optimizers: dict, *, warn: bool) -> None:
        self._given_scaler, self._data, self._optimizers, self._warn = scaler, data, optimizers, warn
        self.scaler: ScalerState | None = None  # a scaler found stepping, not given
        self.found: dict[str, str] = {}  # "scaler" / "data" -> what was found, in words
        self._looked_at_loop = False

    # -------------------------------------------------------------- the scaler
    def update_starts(self, frame: FrameType | None) -> None:
        """An optimizer update starts; ``frame``: the caller of the optimizer's ``step``."""
        if self.scaler is not None:
            return
        scaler = stepping_scaler(frame)
        if scaler is None or scaler is self._given_scaler:
            return
        self.scaler = ScalerState(scaler, self._optimizers)
        self.found["scaler"] = (f"a {type(scaler).__name__} steps guard.optimizer but was not given to the Guard "
                                f"as scaler=")
        self._say(f"{self.found['scaler']}: its loss scale and growth tracker are neither saved nor restored, so "
                  f"a relaunch starts it over and a repaired replica scales its gradients by another factor than "
                  f"the others -- the job is then no longer bit-identical to a fault-free run. Pass "
                  f"Guard(..., scaler=scaler)")

    # -------------------------------------------------------------- the loader
    def loop_ran(self, frame: FrameType | None) -> None:
        """The first step of this process ended; ``frame``: the loop's."""
        if self._looked_at_loop or frame is None:
            return
        self._looked_at_loop = True
        if self._data is not None and not isinstance(self._data, (StatefulLoaderPosition, ResumableLoader)):
            return  # a position of the script's own making: what it covers is the script's business
        given = self._data.loader.dataset if self._data is not None else None
        for where, dataset in _loaders_in_use(frame):
            if dataset is not given:
                self.found["data"] = (f"the loop iterates a DataLoader ({where}) that was not given to the Guard "
                                      f"as data=")
                self._say(f"{self.found['data']}: a relaunch or a rollback does not move it back, so the job reads "
                          f"other batches than a fault-free run would. Pass data=loader (torchdata's "
                          f"StatefulDataLoader as it is, or a DataLoader wrapped in trainguard.torch.ResumableLoader; "
                          f"see docs/torch.md#resumable-data)")
                return

    def _say(self, text: str) -> None:
        if self._warn:
            log.warning("%s", text)


def _loaders_in_use(frame: FrameType) -> Iterator[tuple[str, Any]]:
    """The DataLoaders the loop's frame iterates, as (where, in words; the
    loader's dataset): an iterator of one in a variable, in an attribute of
    an object of the script's own classes, or in a generator's variables --
    where the loader itself counts too (``for batch in loader: yield batch``
    keeps its iterator out of sight)."""
    module = frame.f_globals.get("__name__")
    for name, value in list(frame.f_locals.items()):
        if isinstance(value, _BaseDataLoaderIter):
            yield f"`{name}`", value._dataset
        elif isinstance(value, types.GeneratorType) and value.gi_frame is not None:
            for inner, v in list(value.gi_frame.f_locals.items()):
                if isinstance(v, (_BaseDataLoaderIter, DataLoader)):
                    yield f"`{inner}` in the generator `{name}`", v._dataset if isinstance(v, _BaseDataLoaderIter) \
                        else v.dataset
        elif type(value).__module__ == module and not isinstance(value, type) and hasattr(value, "__dict__"):
            for attr, v in list(vars(value).items()):
                if isinstance(v, _BaseDataLoaderIter):
                    yield f"`{name}.{attr}`", v._dataset
