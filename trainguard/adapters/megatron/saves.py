"""Checkpoints of a Megatron script driven by the TTP API: the load at
start, periodic saves, the dying gasp (the save and rename handlers) and
in-memory snapshots, in Megatron's layout (:mod:`.checkpoint`,
:mod:`.snapshot`), with the job's history of :data:`~.session.TTP`.

The drop-in names over them (``load_checkpoint``, ``ttp_save_checkpoint``,
``rename_save_result``...) and what each does are in
:mod:`trainguard.compat.mindio_ttp.megatron_ttp`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch.distributed as dist

from trainguard.adapters.torch.comm import job_namespace
from trainguard.core import CheckpointError, ConfigError, RankConfig
from trainguard.core.checkpoint import FileInfo
from trainguard.core.preflight import check_checkpoint_dir
from trainguard.core.snapshot.ring import check_settings, directory_for

from . import checkpoint as ckpt
from .recovery import committed_rng, track_rng
from .session import TTP
from .snapshot import MegatronSnapshots

__all__ = ["SnapshotConfig", "close_snapshots", "finalize_dying_gasp", "load_checkpoint", "save_checkpoint",
           "save_dying_gasp", "snapshot_report"]

log = logging.getLogger("trainguard.compat.mindio")


def _directory(kind: str) -> Path:
    """Megatron-LM's ``args.save`` / ``args.load`` when present, else ``TRAINGUARD_CHECKPOINT_DIR``."""
    try:
        from megatron.training import get_args  # Megatron-LM, not megatron-core

        value = getattr(get_args(), kind, None)
        if value:
            return Path(value)
    except (ImportError, AssertionError, AttributeError):
        pass
    # Read at each call, not kept from the session's start: a script may set the variable in
    # its own code, after it started the processor (the MoE recipe of tests/workers does).
    value = RankConfig.from_env().checkpoint_dir
    if not value:
        raise ConfigError(f"no checkpoint directory: set Megatron-LM's --{kind} or TRAINGUARD_CHECKPOINT_DIR")
    return Path(value)


def _unpack(args: Any) -> tuple[int, Any, Any, Any]:
    if not isinstance(args, (tuple, list)) or len(args) != 4:
        raise CheckpointError("ttp_set_ckpt_args must be given (iteration, model, optimizer, opt_param_scheduler) "
                              f"before a dying-gasp save; got {type(args).__name__}")
    return tuple(args)  # type: ignore[return-value]


def save_dying_gasp(save_rank: int, step: int, rank_list: Sequence[int], args: Any,
                        kind: int | None = None) -> list[FileInfo]:
    """Write this rank's part of the dying-gasp checkpoint at ``step`` as the
    saver of the shard whose copies are ``rank_list``, of ``kind`` (0:
    dense, 1: experts; trainguard's processor passes it. MindIO's legacy
    handler shape is not told the kind: then copies in the expert
    data-parallel group mean the expert shard, which is ambiguous when a
    distributed optimizer's dense shard has the same copies)."""
    iteration, model, optimizer, scheduler = _unpack(args)
    if iteration != step:
        # end_updating_os(step) ran but the loop had not yet set the new args: same objects, newer state
        log.info("rank %d saves step %d (the checkpoint args still said iteration %d)", save_rank, step, iteration)
    if kind is None:
        here = ckpt.parallel_rank_or_world()
        kind = 1 if here.moe and set(rank_list) <= set(here.expert_dp_ranks) and \
            set(rank_list) != set(here.dp_cp_ranks) else 0
    # the survivors may have drawn from their random streams in the step after: save those of the locked step
    rng = committed_rng(step)
    if rng is None:
        log.warning("rank %d: no random-number state kept for step %d; the checkpoint holds the current one",
                    save_rank, step)
    store, snapshots = ckpt.megatron_store(_directory("save")), _snapshots()
    if snapshots is not None:
        return snapshots.write_rank(store, step, model, optimizer, scheduler, kind=kind,
                                    history=TTP.merged_history({}), rng=rng)
    return ckpt.write_rank(store, step, model, optimizer, scheduler, kind=kind, rng=rng)


def finalize_dying_gasp() -> None:
    """Make the dying-gasp checkpoint final (one rank, in the rename handler)."""
    if TTP.finalizing is None:
        raise CheckpointError("rename_save_result is the rename handler; it runs when the controller finalises a "
                              "dying-gasp checkpoint, not on its own")
    step, shards, history = TTP.finalizing
    ckpt.finalize(ckpt.megatron_store(_directory("save")), step, shards, history, TTP.rank or 0)


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any) -> None:
    """A periodic checkpoint in Megatron's layout (every rank calls it);
    written in the background from the snapshot of ``iteration`` when
    snapshots are on."""
    store, snapshots = ckpt.megatron_store(_directory("save")), _snapshots()
    # a save of a large model takes many steps' time: the hang watchdog leaves it out
    section = TTP.processor.watchdog.section("checkpoint") if TTP.processor is not None else contextlib.nullcontext()
    with section:
        if snapshots is not None:
            snapshots.save(store, iteration, model, optimizer, opt_param_scheduler, history=TTP.merged_history({}))
        else:
            ckpt.save(store, iteration, model, optimizer, opt_param_scheduler, history=TTP.merged_history({}))


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, *, device: str = "cpu") -> int:
    """Load the newest complete checkpoint -- with snapshots on, from this
    node's memory where every rank can -- and return its iteration (0: none)."""
    track_rng()
    check_checkpoint_dir(_directory("save"))  # every rank, before the load's collectives: not at the dying gasp
    store, snapshots = ckpt.megatron_store(_directory("load")), _snapshots()
    if snapshots is not None:
        iteration, history = snapshots.load(store, model, optimizer, opt_param_scheduler, device=device)
    else:
        iteration, history = ckpt.load(store, model, optimizer, opt_param_scheduler, device=device)
    TTP.step = iteration
    if history:
        TTP.history = history
    return iteration


# ------------------------------------------------------------- in-memory snapshots
@dataclass(frozen=True, kw_only=True)
class SnapshotConfig:
    """Snapshots in the TTP flow: ``TRAINGUARD_SNAPSHOT_EVERY`` (iterations
    between two; 0 or unset: off) and ``TRAINGUARD_SNAPSHOTS_IN_MEMORY``
    (slots per rank, default 2; each the size of the rank's state)."""

    every: int = 0
    in_memory: int = 2

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SnapshotConfig":
        """Raises:
            ConfigError: a value that is not a whole number, or out of range."""
        environ = os.environ if environ is None else environ
        values = {}
        for key, name in (("every", "TRAINGUARD_SNAPSHOT_EVERY"), ("in_memory", "TRAINGUARD_SNAPSHOTS_IN_MEMORY")):
            text = environ.get(name, "").strip()
            if text:
                try:
                    values[key] = int(text)
                except ValueError:
                    raise ConfigError(f"{name}={text!r} is not a whole number") from None
        config = cls(**values)
        check_settings(config.every, config.in_memory, 0)
        return config


def _snapshots() -> MegatronSnapshots | None:
    """This process's snapshots, set up at first use when they are on."""
    if TTP.snapshots is None:
        config = SnapshotConfig.from_env()
        if not config.every:
            return None
        rank = dist.get_rank() if dist.is_initialized() else TTP.rank or 0
        settings = RankConfig.from_env()  # with the snapshots' own, when they start (see _directory)
        directory = directory_for(f"{job_namespace(settings)}-r{rank}-{os.getpid()}", node_dir=settings.node_dir,
                                  root=settings.snapshot_root)
        TTP.snapshots = MegatronSnapshots(directory, rank, count=config.in_memory,
                                          save_timeout_s=settings.save_timeout_s)
        TTP.args_hooks.append(functools.partial(_snapshot_after_update, config.every))
        atexit.register(close_snapshots)
    return TTP.snapshots


def _snapshot_after_update(every: int, args: Any) -> None:
    """``ttp_set_ckpt_args``'s hook: every ``every`` iterations, a snapshot
    of the iteration the objects now hold (not of the one loaded at start:
    memory or storage has it already)."""
    iteration, model, optimizer, scheduler = _unpack(args)
    snapshots = TTP.snapshots
    if iteration % every or iteration != TTP.step or snapshots.closed or \
            iteration == (snapshots.resumed_from or {}).get("step", 0):
        return
    snapshots.take_rank(iteration, model, optimizer, scheduler, TTP.merged_history({}))


def snapshot_report() -> dict:
    """``{"snapshots": {...}}`` for a job report when snapshots are on, else
    ``{}``: snapshots taken and skipped, persists and their errors, the dumps
    that reused a snapshot, and ``resumed_from`` (the step loaded at start
    and whether from ``memory``, ``peer memory`` or ``storage``)."""
    snapshots = TTP.snapshots
    return {"snapshots": snapshots.report(snapshots.resumed_from)} if snapshots is not None else {}


def close_snapshots(wait_s: float | None = None) -> None:
    """At the end of training: wait up to ``wait_s`` seconds (default: the
    save timeout; 0 after the controller's exit order) for the saves asked
    so far, stop the persist worker and unmap the slots (the node agent
    removes them when it exits; without one they are removed now). Runs at
    interpreter exit when the script does not call it."""
    snapshots = TTP.snapshots
    if snapshots is not None:
        if wait_s is None:
            wait_s = 0.0 if TTP.exit_code is not None else snapshots.save_timeout_s
        snapshots.shutdown(wait_s)
