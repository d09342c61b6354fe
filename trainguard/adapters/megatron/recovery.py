"""In-place recovery handlers for Megatron scripts on the TTP API
(exported by :mod:`trainguard.compat.mindio_ttp.megatron_ttp`).

MindIO leaves the stop, clean, rebuild, repair and rollback handlers to the
script (MindSpeed-LLM ships its own). These are trainguard's, for the
objects given to ``ttp_set_ckpt_args((iteration, model, optimizer,
opt_param_scheduler))``::

    dist.init_process_group("trainguard")   # abortable groups, megatron's included
    ...
    mega.register_recovery_handlers()       # once, after ttp_init_processor

With them a device memory error (UCE) or a communication fault on one rank
is retried without a restart: STOP releases every rank from its collective
(:mod:`trainguard.adapters.torch.backend`), each cleans its step, the groups
are rebuilt, the faulty rank receives its state from a replica at the
locked step, every rank puts back its random streams of that step, and the
wrapped training function runs again from ``tft_get_repair_step()``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trainguard.adapters.torch import backend
from trainguard.core import RecoveryError

from . import checkpoint as ckpt
from . import repair
from .session import TTP

__all__ = ["clean_callback", "committed_rng", "rebuild_callback", "register_recovery_handlers", "repair_callback",
           "rollback_callback", "stop_callback", "track_rng"]

log = logging.getLogger("trainguard.compat.mindio")

_rng = repair.RngHistory()


def _objects(args: Any) -> tuple[int, Any, Any, Any]:
    if not isinstance(args, (tuple, list)) or len(args) != 4:
        raise RecoveryError("ttp_set_ckpt_args must be given (iteration, model, optimizer, opt_param_scheduler) "
                            f"before an in-place recovery; got {type(args).__name__}")
    return tuple(args)  # type: ignore[return-value]


def stop_callback(args: Any, ctx: Any = None) -> None:
    """Release the training thread from any collective it waits in."""
    if not backend.groups():
        log.warning("no trainguard process group to stop: init_process_group('trainguard') lets a STOP release "
                    "a rank waiting in a collective")
    backend.stop_all("FORCE STOP: the controller stopped training")


def clean_callback(is_uce: bool, args: Any, ctx: Any = None) -> int:
    """Drop the step in progress (0); on the rank of a memory error, its
    device state too; 1 when the device cannot be repaired in place."""
    _, model, optimizer, _ = _objects(args)
    return repair.clean(model, optimizer, uce=is_uce)


def rebuild_callback(fault_ranks: Sequence[int], args: Any, ctx: Any = None) -> None:
    """Fresh backends under every trainguard group (all ranks, same generation)."""
    processor = TTP.live()
    stops = processor.stops
    backend.rebuild_all(TTP.generation, cancelled=lambda: processor.stops != stops)


def _transfer_device() -> torch.device:
    """Where the groups want tensors: host memory under gloo, the GPU under NCCL."""
    nccl = TTP.settings.inner_backend == "nccl" or dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def repair_callback(step: int, need_rebuild: bool, error_ranks: Sequence[int], repair_info: Sequence[dict],
                    args: Any, ctx: Any = None) -> None:
    """Send this rank's state to the ranks it repairs, or receive its own:
    with experts (MoE), the dense and the expert state each from its own
    replica (``type`` 0 and 1 in ``repair_info``)."""
    iteration, model, optimizer, scheduler = _objects(args)
    moe = ckpt.parallel_rank_or_world().moe
    for info in repair_info:  # checked before anything is copied
        if int(info.get("type", 0)) not in ((0, 1) if moe else (0,)):
            raise RecoveryError(f"cannot repair state of type {info.get('type')} "
                                f"({'0: dense, 1: experts' if moe else 'this job has no experts: only 0'})")
    rank, world = dist.get_rank(), dist.group.WORLD
    for info in repair_info:
        src, dst, kind = int(info["src"]), int(info["dst"]), int(info.get("type", 0))
        what = ("dense " if kind == 0 else "expert ") + "state" if moe else "state"
        if rank == src:
            if iteration != step:  # end_updating_os(step) ran, ttp_set_ckpt_args not yet: same objects
                log.info("rank %d sends step %d (the checkpoint args still said iteration %d)", rank, step, iteration)
            repair.send_replica(world, dst, model, optimizer, scheduler, device=_transfer_device(),
                                kind=kind if moe else None)
            log.info("rank %d sent its %s at step %d to rank %d", rank, what, step, dst)
        elif rank == dst:
            repair.receive_replica(world, src, model, optimizer, scheduler, device=_transfer_device(),
                                   kind=kind if moe else None)
            log.info("rank %d took its %s at step %d from rank %d", rank, what, step, src)


def rollback_callback(step: int, args: Any, ctx: Any = None) -> None:
    """Random streams back to where they were when ``step`` was committed
    -- or, on a rank caught inside its update to ``step``, when that update
    began (the wrapped function starts again at ``tft_get_repair_step()``)."""
    _rng.restore(step)


def track_rng() -> None:
    """Keep the random streams of the last committed steps (for a rollback,
    and for a dying gasp, which saves those of the locked step) and of the
    update in flight as it began (for a rollback of a rank caught in it)."""
    if _rng.commit not in TTP.commit_hooks:
        TTP.commit_hooks.append(_rng.commit)
    if _rng.start not in TTP.update_hooks:
        TTP.update_hooks.append(_rng.start)


def committed_rng(step: int) -> dict | None:
    """The random streams when ``step`` was committed (or set back to by a
    rollback to it), if kept; never those of an update still in flight (the
    dying gasp saves a completed step's)."""
    return _rng.states.get(step)


def register_recovery_handlers() -> None:
    """Register the five handlers and keep this rank's random streams at
    each commit and as each update begins."""
    TTP.register("stop", stop_callback)
    TTP.register("clean", clean_callback)
    TTP.register("rebuild", rebuild_callback)
    TTP.register("repair", repair_callback)
    TTP.register("rollback", rollback_callback)
    track_rng()
