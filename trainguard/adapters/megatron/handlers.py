"""The controller's recovery commands, carried out with the handlers a
script on the TTP API registered (``ttp_register_*`` / ``tft_register_*``,
kept in :data:`~.session.TTP`): MindIO's handler shapes behind trainguard's
:class:`~trainguard.core.rank.recovery.Handlers`."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Sequence

from trainguard.core import CheckpointError, DataStatus, RecoveryError, Transfer
from trainguard.core.checkpoint import FileInfo, SavedShard
from trainguard.core.rank.recovery import Handlers

if TYPE_CHECKING:
    from .session import TtpSession

__all__ = ["TtpHandlers"]


def _takes_kind(fn) -> bool:
    try:
        return "kind" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class TtpHandlers(Handlers):
    """MindIO's handler shapes behind trainguard's :class:`~trainguard.core.rank.recovery.Handlers`."""

    def __init__(self, state: "TtpSession") -> None:
        self.s = state

    def _need(self, kind: str, what: str):
        found = self.s.handler(kind)
        if found is None:
            raise RecoveryError(f"{what} needs a {kind} handler (tft_register_{kind}_handler); none was registered")
        return found

    def clean(self, uce: bool) -> int:
        fn, ctx, _ = self._need("clean", "in-place recovery")
        return int(fn(uce, self.s.args, ctx))

    def rebuild(self, generation: int, ranks: Sequence[int], join_store: str = "") -> None:
        if join_store:
            raise RecoveryError("a replacement process cannot join a script driven by the MindIO API; use "
                                "trainguard.torch.Guard for process-level rescheduling")
        fn, ctx, _ = self._need("rebuild", "in-place recovery")
        self.s.generation = generation
        fn(sorted(set(range(self.s.world_size)) - set(ranks)), self.s.args, ctx)

    def repair(self, step: int, transfers: Sequence[Transfer]) -> None:
        fn, ctx, _ = self._need("repair", "copying state from a replica")
        mine = [t for t in transfers if self.s.rank in (t.src, t.dst)]
        processor = self.s.live()
        receiving = any(t.dst == self.s.rank for t in mine)
        if receiving:
            processor.begin_copy()
        fn(step, True, sorted({t.dst for t in transfers}),
           [{"src": t.src, "dst": t.dst, "type": t.kind} for t in mine], self.s.args, ctx)
        if receiving:
            processor.end_copy(step)

    def rollback(self, step: int) -> None:
        fn, ctx, _ = self._need("rollback", "in-place recovery")
        fn(step, self.s.args, ctx)
        processor = self.s.live()
        if processor.data is not DataStatus.UPDATED:
            processor.abandon_update()
        processor.step = self.s.step = step

    def save(self, step: int, kind: int) -> Sequence[FileInfo]:
        found = self.s.handler("save")
        if found is None:
            raise CheckpointError("no save handler registered (ttp_register_save_ckpt_handler): nothing can save "
                                  "the dying-gasp checkpoint")
        fn, ctx, legacy = found
        ranks = sorted(self.s.groups()[kind].copies(self.s.rank))
        if not legacy:
            out = fn(step, [{"type": kind, "ranks": ranks}], self.s.args, ctx)
        elif _takes_kind(fn):  # trainguard's megatron_ttp.ttp_save_checkpoint: the copies alone can be ambiguous
            out = fn(self.s.rank, step, ranks, self.s.args, kind=kind)
        else:  # MindIO's legacy shape tells no kind
            out = fn(self.s.rank, step, ranks, self.s.args)
        # trainguard's own save handlers return the files they wrote, for the manifest
        return [f for f in out if isinstance(f, FileInfo)] if isinstance(out, (list, tuple)) else []

    def finalize(self, step: int, shards: Sequence[SavedShard], history: dict,
                 own: Sequence[FileInfo] = ()) -> None:
        found = self.s.handler("rename")
        if found is None:
            raise CheckpointError("no rename handler registered (ttp_register_rename_handler): the dying-gasp "
                                  "checkpoint cannot be made final")
        fn, _, legacy = found
        self.s.finalizing = (step, tuple(shards), self.s.merged_history(history))
        try:
            fn(self.s.args) if legacy else fn(step, self.s.args)
        finally:
            self.s.finalizing = None

    def resumed(self, step: int, record: dict, pids: dict | None = None, replicas: int = 0) -> None:
        self.s.record_resume(record, pids)
