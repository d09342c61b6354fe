"""The per-process session of a Megatron script driven by the TTP API.

The TTP flow (MindIO's ``ttp_*`` / ``tft_*`` calls, the drop-in names of
:mod:`trainguard.compat.mindio_ttp`) has no loop object: the script calls
module-level functions. :data:`TTP` is what those calls share in one
process -- the arguments and handlers the script registered, the rank's
:class:`~trainguard.core.Processor`, the completed updates, and the job's
history (a :class:`~trainguard.core.rank.history.JobHistory`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from trainguard.core import ConfigError, Processor, RankConfig, RecoveryError, ReplicaGroup
from trainguard.core import logs
from trainguard.core.classify import Classifier
from trainguard.core.rank.history import JobHistory

__all__ = ["TTP", "TtpSession", "checked_int"]

log = logging.getLogger("trainguard.compat.mindio")


def checked_int(name: str, value: Any, *, minimum: int = 0) -> int:
    """``value`` when it is an ``int >= minimum``; else a ``ConfigError`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class TtpSession(JobHistory):
    """One process's TTP session: what the script registered and set, and
    the job's history (from the checkpoint loaded, plus this launch's)."""

    def __init__(self) -> None:
        self.controller_args: dict | None = None
        self.controller: Any = None
        self.rank: int | None = None
        self.world_size = 1
        self.dp_ranks: tuple[int, ...] | None = None
        self.replicas: tuple[ReplicaGroup, ...] | None = None  # tft_set_optimizer_replica / ReplicatedOptimizer
        self.processor: Processor | None = None
        self.handlers: dict[str, tuple[Callable, Any, bool]] = {}
        self.args: Any = None
        self.step = 0  # completed updates (set by load_checkpoint and ttp_end_updating_os)
        self.device = "cpu"
        self.classifier: Classifier | None = None
        self.exit_code: int | None = None
        self.repair_step, self.repair_type = -1, ""
        self.history: dict = {"records": [], "pids": {}}  # earlier launches', from the checkpoint loaded
        self.records: list[dict] = []  # this launch's recoveries
        self.pids: dict[int, int] = {}  # this process's, once connected
        self.markers: Any = None  # profiling markers (trainguard.adapters.torch.markers), when configured
        self.finalizing: tuple | None = None  # (step, shards, history) while the rename handler runs
        self.snapshots: Any = None  # megatron_ttp's in-memory snapshots, when TRAINGUARD_SNAPSHOT_EVERY is set
        self.args_hooks: list[Callable[[Any], None]] = []  # told of each ttp_set_ckpt_args (megatron_ttp's snapshots)
        self.generation = 0  # of the process groups, as the controller numbers them (set at each rebuild)
        self.commit_hooks: list[Callable[[int], None]] = []  # told of each committed step (ttp_end_updating_os)
        self.update_hooks: list[Callable[[int], None]] = []  # told, as an update begins, of the step it will commit
        self._settings: RankConfig | None = None

    @property
    def settings(self) -> RankConfig:
        """What the launcher and the environment tell this rank, read at the
        session's first use of them (a bad value is refused then); a test
        sets them instead."""
        if self._settings is None:
            self._settings = RankConfig.from_env()
        return self._settings

    @settings.setter
    def settings(self, settings: RankConfig) -> None:
        self._settings = settings

    def groups(self) -> tuple[ReplicaGroup, ...]:
        """This rank's replica groups: a ``ReplicatedOptimizer``'s or
        ``tft_set_optimizer_replica``'s, else megatron's ``parallel_state``,
        else ``dp_ranks`` as full copies."""
        if self.replicas:
            return self.replicas
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            from .layout import replica_groups

            return replica_groups()
        if self.dp_ranks is None:
            raise ConfigError("no replica layout for this rank: call ttp_init_processor with dp_ranks, "
                              "tft_set_optimizer_replica, or initialise megatron's parallel_state first")
        if len(self.dp_ranks) < 2:
            raise ConfigError(f"data parallelism of 1 (dp_ranks={list(self.dp_ranks)}) leaves no replica to save "
                              f"or repair from; trainguard needs data parallelism >= 2")
        return (ReplicaGroup.full(self.dp_ranks),)

    def register(self, kind: str, fn: Callable, ctx: Any = None, *, legacy: bool = False) -> None:
        if not callable(fn):
            raise ConfigError(f"the {kind} handler must be callable, got {type(fn).__name__}")
        self.handlers[kind] = (fn, ctx, legacy)

    def handler(self, kind: str) -> tuple[Callable, Any, bool] | None:
        return self.handlers.get(kind)

    def call(self, kind: str, *, optional: bool = False) -> Any:
        """Call a handler that takes ``(args, ctx)`` (exit, stop)."""
        found = self.handlers.get(kind)
        if found is None:
            if optional:
                return None
            raise RecoveryError(f"no {kind} handler registered (tft_register_{kind}_handler)")
        fn, ctx, _ = found
        try:
            return fn(self.args, ctx)
        except Exception:
            log.exception("the %s handler failed", kind)
            if not optional:
                raise

    def live(self) -> Processor:
        if self.processor is None:
            raise ConfigError("ttp_start_processor (tft_start_processor) was not called in this process")
        return self.processor

    def exit_now(self) -> None:
        """At interpreter exit after the controller's exit order: leave without
        running process-group destructors, which block or abort when a peer
        is gone."""
        if self.exit_code is not None:
            logs.exit_now(self.exit_code)


_State = TtpSession  # its former name

TTP = TtpSession()
