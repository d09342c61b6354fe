"""MindIO TTP's ``mindio_ttp.megatron_ttp``, run on trainguard.

``import mindio_ttp.megatron_ttp as mega`` becomes
``import trainguard.compat.mindio_ttp.megatron_ttp as mega``:

``load_checkpoint(model, optimizer, opt_param_scheduler)``
    Loads the newest complete checkpoint in Megatron's layout
    (:mod:`trainguard.adapters.megatron.checkpoint`) from ``args.load`` of
    Megatron-LM when it is installed, else ``TRAINGUARD_CHECKPOINT_DIR``;
    returns the iteration (0: none) and tells the processor where training
    resumes.
``ttp_save_checkpoint`` / ``rename_save_result``
    The dying-gasp save and rename handlers: this rank writes its
    ``mp_rank_*/model_optim_rng.pt`` under ``iter_{:07d}_tmp``; the
    finalising rank verifies every file, writes the manifest, renames and
    updates ``latest_checkpointed_iteration.txt``. ``args`` is what
    ``ttp_set_ckpt_args`` got: ``(iteration, model, optimizer, opt_param_scheduler)``.
``save_checkpoint(iteration, model, optimizer, opt_param_scheduler)``
    A periodic save in the same layout (every rank calls it); asynchronous
    with snapshots on (below).
``register_recovery_handlers()`` (and the five ``*_callback`` it registers)
    In-place recovery of a UCE or a communication fault without a restart:
    stop, clean, rebuild the groups, copy the lost state from a replica,
    roll back (:mod:`trainguard.adapters.megatron.recovery`; needs
    ``init_process_group("trainguard")``).
``ReplicatedOptimizer`` / ``replicated_optimizer(config, model_chunks)``
    megatron-core's ``DistributedOptimizer`` kept in ``replica_cnt``
    instances (see :mod:`trainguard.adapters.megatron.optimizer`); the
    function is ``get_megatron_optimizer`` for that layout. Either tells the
    processor the replica layout, so the dying gasp saves one copy of each
    shard (``distrib_optim_shard_{j:03d}.pt``).

In-memory snapshots (MindIO ACP's and DLRover's flash checkpoints) are on
when ``TRAINGUARD_SNAPSHOT_EVERY=N`` is set (:class:`SnapshotConfig`): the
script changes nothing. ``load_checkpoint`` sets them up; then every N
iterations ``ttp_set_ckpt_args((iteration, ...))`` -- the recipe calls it
after ``ttp_end_updating_os`` and the scheduler step, when the objects hold
that iteration's state -- copies this rank's state into a slot in shared
memory (:mod:`trainguard.adapters.megatron.snapshot`; the node agent of
``trainguard run`` owns the slots, so they outlive the process). With them:

* ``save_checkpoint`` blocks only for that copy (none when memory holds the
  iteration) and one all-gather of file names; the persist workers write
  ``iter_{:07d}/mp_rank_*/model_optim_rng.safetensors`` and one finalises
  (manifest, rename, tracker last).
* ``ttp_save_checkpoint`` writes the snapshot of the locked step as it
  lies in memory when memory holds it (logged: ``reuses its snapshot in
  memory``).
* ``load_checkpoint`` resumes at the newest step every rank can load, each
  from this node's memory where a snapshot of it passes its checksum, else
  from storage; the log and :func:`snapshot_report` (``resumed_from``) say
  which.
* :func:`close_snapshots` waits for the last saves and frees the slots; it
  runs at exit when the script does not call it.

``load_checkpoint`` reads checkpoints written either way.

These names are thin calls into the Megatron adapter:
:mod:`trainguard.adapters.megatron.saves` (load, saves, snapshots),
:mod:`trainguard.adapters.megatron.recovery` (the in-place handlers) and
:mod:`trainguard.adapters.megatron.runtime` (the replicated optimizer).
"""

from __future__ import annotations

from typing import Any, Sequence

from trainguard.adapters.megatron import runtime, saves
from trainguard.adapters.megatron.recovery import (clean_callback, rebuild_callback, register_recovery_handlers,
                                                   repair_callback, rollback_callback, stop_callback)
from trainguard.adapters.megatron.saves import (SnapshotConfig, close_snapshots, load_checkpoint, save_checkpoint,
                                                snapshot_report)
from trainguard.adapters.megatron.session import TTP
from trainguard.core import CheckpointError
from trainguard.core.checkpoint import FileInfo

__all__ = ["ReplicatedOptimizer", "SnapshotConfig", "close_snapshots", "load_checkpoint", "rename_save_result",
           "replicated_optimizer", "save_checkpoint", "snapshot_report",
           "tft_rename_save_result", "tft_save_checkpoint", "ttp_save_checkpoint",
           # in-place recovery (UCE, communication faults): see trainguard.adapters.megatron.recovery
           "clean_callback", "rebuild_callback", "register_recovery_handlers", "repair_callback", "rollback_callback",
           "stop_callback"]


def ttp_save_checkpoint(save_rank: int, step: int, rank_list: Sequence[int], args: Any,
                        kind: int | None = None) -> list[FileInfo]:
    """MindIO's name for :func:`trainguard.adapters.megatron.saves.save_dying_gasp`."""
    return saves.save_dying_gasp(save_rank, step, rank_list, args, kind=kind)


def rename_save_result(args: Any) -> None:
    """Make the dying-gasp checkpoint final (one rank)."""
    saves.finalize_dying_gasp()


def tft_save_checkpoint(step: int, save_info: Sequence[dict], args: Any, ctx: Any = None) -> list[FileInfo]:
    """``tft_register_save_ckpt_handler``'s shape of :func:`ttp_save_checkpoint`."""
    files: list[FileInfo] = []
    for info in save_info:
        kind = int(info.get("type", 0))
        if kind not in (0, 1):
            raise CheckpointError(f"unknown shard type {kind} in save_info (0: dense, 1: experts)")
        files += ttp_save_checkpoint(TTP.rank or 0, step, sorted(info.get("ranks", ())), args, kind=kind)
    return files


def tft_rename_save_result(step: int, args: Any) -> None:
    rename_save_result(args)


def replicated_optimizer(config: Any, model_chunks: Sequence[Any], **kwargs: Any) -> Any:
    """megatron-core's ``get_megatron_optimizer(config, model_chunks)`` with
    the distributed optimizer kept in parallel_state's instances (two or
    more); tells this process's processor the replica layout."""
    return runtime.replicated_optimizer(config, model_chunks, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "ReplicatedOptimizer":  # imports megatron-core's optimizer package only when asked for
        return runtime.replicated_optimizer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (not a MindIO megatron_ttp name "
                         f"trainguard knows)")
