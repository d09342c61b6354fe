"""Where a starting job resumes, agreed by every rank before any trains.

Every rank lists the steps it can load -- its sealed snapshots in this
node's memory and the newest sound checkpoint on storage -- and all take the
newest step every rank has. Each loads it (from memory where it can), and
then all exchange how that went:

* every rank loaded it: training starts there;
* a rank found its copy unusable (a snapshot or a checkpoint file that fails
  its check or does not load: a :class:`~.api.CheckpointError`): that copy
  is dropped -- an older checkpoint takes the place of a bad one -- and the
  ranks agree again;
* a rank could not load for any other reason (its data position or an
  extra object refused the state, a bug): every rank raises
  :class:`~.api.ResumeError` naming it. None trains, so nothing newer than
  the checkpoint is ever written, and that checkpoint stays as it was.

Without the exchange a rank that failed here left its peers training alone
into a checkpoint that named a world it did not cover.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from ..api import CheckpointError, ResumeError

__all__ = ["FAILED", "LOADED", "UNUSABLE", "UNUSABLE_STORED", "resume"]

log = logging.getLogger("trainguard.resume")

#: A rank's outcome of loading the step, exchanged as an integer (MindSpore
#: gathers integers only): loaded; its snapshot in memory was unusable (that
#: copy is this rank's alone); the checkpoint on storage was (it is every
#: rank's: all drop it); it failed.
LOADED, UNUSABLE, UNUSABLE_STORED, FAILED = 0, 1, 3, 2


class Found(Protocol):  # a verified checkpoint (core.checkpoint.Verified)
    step: int
    path: Any


def resume(memory: dict[int, tuple[Any, str]], newest_stored: Callable[[set[int]], Found | None], *,
           gather: Callable[[list[int]], list], outcomes: Callable[[int], list[int]],
           load_memory: Callable[[int, Any, str], None], load_stored: Callable[[Any], None],
           rank: int, before: Callable[[int], None] = lambda step: None) -> int:
    """Pick the step to resume at and load it on every rank; 0 when there is
    nothing anywhere.

    Args:
        memory: this rank's sealed snapshots, ``step -> (slot, source)``.
        newest_stored: the newest sound checkpoint on storage whose step is
            not in the given set, or ``None``.
        gather: every rank's list of steps (a collective).
        outcomes: every rank's outcome code -- :data:`LOADED`,
            :data:`UNUSABLE` or :data:`FAILED` (a collective).
        load_memory: load ``(step, slot, source)``; raises
            ``CheckpointError`` when the snapshot is unusable.
        load_stored: load a checkpoint from :func:`newest_stored`; raises
            ``CheckpointError`` when one of its files does not load.
        rank: this rank, for messages.
        before: called with the step before each load (the fault injector's
            ``phase=resume`` strikes there).

    Raises:
        CheckpointError: the ranks share no step.
        ResumeError: a rank could not load the step (on every rank).
    """
    dropped: set[int] = set()
    found = newest_stored(dropped)
    unusable = False  # some rank dropped a checkpoint on storage (every rank knows from the outcomes)
    reasons: list[str] = []  # why this rank dropped each
    try:
        while True:
            every = gather(sorted(set(memory) | ({found.step} if found is not None else set())))
            if not any(every):
                if unusable:  # starting over would silently train past (and prune) the job's checkpoints
                    mine = f"rank {rank}: " + "; ".join(reasons[-3:]) if reasons else "see the other ranks' logs"
                    raise CheckpointError(f"no snapshot or checkpoint that every rank can load is left ({mine}); "
                                          f"not starting from step 0: move the checkpoint directory away to start "
                                          f"the job over")
                return 0
            common = set(every[0]).intersection(*every[1:])
            if not common:
                raise CheckpointError(f"ranks share no step to resume from (steps each rank can load: {every})")
            step = max(common)
            where = "memory" if step in memory else f"storage ({found.path})"
            code, why = LOADED, ""
            try:
                before(step)
                if step in memory:
                    load_memory(step, *memory[step])
                else:
                    load_stored(found)
            except CheckpointError as e:
                log.warning("rank %d: not resuming from %s at step %d: %s", rank, where, step, e)
                reasons.append(f"step {step} from {where}: {e}")
                if step in memory:
                    code = UNUSABLE
                    del memory[step]  # its slot was closed by the read
                else:
                    code = UNUSABLE_STORED
            except Exception as e:  # noqa: BLE001 - whatever the user's objects raise ends the resume
                code, why = FAILED, f"{type(e).__name__}: {e}"
                log.error("rank %d could not load its state at step %d from %s", rank, step, where, exc_info=e)
            codes = outcomes(code)
            unusable = unusable or UNUSABLE_STORED in codes
            if UNUSABLE_STORED in codes and found is not None and found.step == step:  # no rank uses it
                dropped.add(step)
                found = newest_stored(dropped)
            failed = [r for r, c in enumerate(codes) if c == FAILED]
            if failed:
                cause = f": {why}" if why else f" (rank {failed[0]}'s log says why)"
                raise ResumeError(
                    f"rank{'s' if len(failed) > 1 else ''} {failed[:16]} could not load the state of step {step}"
                    f"{cause}; no rank trains on and nothing newer is written (the checkpoint is kept): "
                    f"fix the cause and relaunch")
            if all(c == LOADED for c in codes):
                return step
    finally:
        for slot, _ in memory.values():  # the candidates not read
            slot.close()
