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
    A periodic save in the same layout (every rank calls it).
``ReplicatedOptimizer`` / ``replicated_optimizer(config, model_chunks)``
    megatron-core's ``DistributedOptimizer`` kept in ``replica_cnt``
    instances (see :mod:`trainguard.adapters.megatron.optimizer`); the
    function is ``get_megatron_optimizer`` for that layout. Either tells the
    processor the replica layout, so the dying gasp saves one copy of each
    shard (``distrib_optim_shard_{j:03d}.pt``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

from trainguard.adapters.megatron import checkpoint as ckpt
from trainguard.core import CheckpointError, ConfigError
from trainguard.core.checkpoint import FileInfo

from .state import TTP

__all__ = ["ReplicatedOptimizer", "load_checkpoint", "rename_save_result", "replicated_optimizer", "save_checkpoint",
           "tft_rename_save_result", "tft_save_checkpoint", "ttp_save_checkpoint"]

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
    value = os.environ.get("TRAINGUARD_CHECKPOINT_DIR", "")
    if not value:
        raise ConfigError(f"no checkpoint directory: set Megatron-LM's --{kind} or TRAINGUARD_CHECKPOINT_DIR")
    return Path(value)


def _unpack(args: Any) -> tuple[int, Any, Any, Any]:
    if not isinstance(args, (tuple, list)) or len(args) != 4:
        raise CheckpointError("ttp_set_ckpt_args must be given (iteration, model, optimizer, opt_param_scheduler) "
                              f"before a dying-gasp save; got {type(args).__name__}")
    return tuple(args)  # type: ignore[return-value]


def ttp_save_checkpoint(save_rank: int, step: int, rank_list: Sequence[int], args: Any,
                        kind: int | None = None) -> list[FileInfo]:
    """Write this rank's part of the dying-gasp checkpoint at ``step`` as the
    saver of the shard whose copies are ``rank_list`` (MindIO's legacy
    handler is not told the kind: copies in the expert data-parallel group
    mean the expert shard)."""
    iteration, model, optimizer, scheduler = _unpack(args)
    if iteration != step:
        # end_updating_os(step) ran but the loop had not yet set the new args: same objects, newer state
        log.info("rank %d saves step %d (the checkpoint args still said iteration %d)", save_rank, step, iteration)
    if kind is None:
        here = ckpt.parallel_rank_or_world()
        kind = 1 if here.moe and set(rank_list) <= set(here.expert_dp_ranks) and \
            set(rank_list) != set(here.dp_cp_ranks) else 0
    return ckpt.write_rank(ckpt.megatron_store(_directory("save")), step, model, optimizer, scheduler, kind=kind)


def rename_save_result(args: Any) -> None:
    """Make the dying-gasp checkpoint final (one rank)."""
    if TTP.finalizing is None:
        raise CheckpointError("rename_save_result is the rename handler; it runs when the controller finalises a "
                              "dying-gasp checkpoint, not on its own")
    step, shards, history = TTP.finalizing
    ckpt.finalize(ckpt.megatron_store(_directory("save")), step, shards, history, TTP.rank or 0)


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


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any) -> None:
    """A periodic checkpoint in Megatron's layout (every rank calls it)."""
    ckpt.save(ckpt.megatron_store(_directory("save")), iteration, model, optimizer, opt_param_scheduler,
              history=TTP.merged_history({}))


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, *, device: str = "cpu") -> int:
    """Load the newest complete checkpoint; return its iteration (0: none)."""
    iteration, history = ckpt.load(ckpt.megatron_store(_directory("load")), model, optimizer, opt_param_scheduler,
                                   device=device)
    TTP.step = iteration
    if history:
        TTP.history = history
    return iteration


def replicated_optimizer(config: Any, model_chunks: Sequence[Any], **kwargs: Any) -> Any:
    """megatron-core's ``get_megatron_optimizer(config, model_chunks)`` with
    the distributed optimizer kept in parallel_state's instances (two or
    more); tells this process's processor the replica layout."""
    from trainguard.adapters.megatron.optimizer import replicated_optimizer as build

    optimizer = build(config, model_chunks, **kwargs)
    TTP.replicas = optimizer.replica_groups
    return optimizer


_replicated: Any = None


def __getattr__(name: str) -> Any:
    global _replicated
    if name == "ReplicatedOptimizer":  # imports megatron-core's optimizer package only when asked for
        if _replicated is None:
            from trainguard.adapters.megatron.optimizer import ReplicatedOptimizer as Base

            class ReplicatedOptimizer(Base):
                """Also tells this process's processor its replica layout."""

                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    super().__init__(*args, **kwargs)
                    TTP.replicas = self.replica_groups

            _replicated = ReplicatedOptimizer
        return _replicated
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (not a MindIO megatron_ttp name "
                         f"trainguard knows)")
