"""MindIO TTP / TFT's ``mindio_ttp.framework_ttp``, run on trainguard.

A script adapted for MindIO (``../seeds`` GPT-3 flow) changes one import::

    import mindio_ttp.framework_ttp as ttp                       # MindIO
    import trainguard.compat.mindio_ttp.framework_ttp as ttp     # trainguard

and is launched with ``trainguard run`` (or a torchrun patched by
``adapters-patch torchrun``; the MindIO recipe's ``import
mindio_ttp.framework_ttp`` line in the ``torchrun`` script does the same
when it names this module instead, see :func:`_route_torchrun`).

How the calls map:

* ``ttp_init_controller`` / ``ttp_start_controller`` (rank 0): under
  ``trainguard run`` the launcher's controller serves the job and these only
  check their arguments; otherwise rank 0 serves a trainguard controller at
  ``ip:port`` in a thread (the job secret ``TRAINGUARD_TOKEN`` is required).
* ``ttp_init_processor`` / ``ttp_start_processor``: connect this rank's
  :class:`~trainguard.core.Processor` with its replica groups: those of a
  :class:`~trainguard.compat.mindio_ttp.megatron_ttp.ReplicatedOptimizer`
  or of ``tft_set_optimizer_replica`` when given, else megatron's
  ``parallel_state`` when it is initialised, else ``dp_ranks`` as full copies.
* ``ttp_start_updating_os`` / ``ttp_end_updating_os(step)``: the update
  window (``step`` = completed updates, Megatron's ``iteration + 1``).
* ``@ttp_to_persist`` (``tft_exception_handler``): an exception leaving the
  wrapped training function is reported and the controller's commands are
  carried out with the registered handlers; after an in-place repair the
  function is called again, after a dump the process exits with
  :data:`~trainguard.core.EXIT_AFTER_DUMP`.

MindIO's ``replica`` and ``enable_local_copy`` arguments are checked and
otherwise ignored (MindIO deprecated ``replica`` too: the copies are what
the optimizer keeps). A name MindIO has and trainguard does not raises an
``AttributeError`` saying which feature is missing.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping, Sequence

from trainguard.adapters.megatron import runtime
from trainguard.adapters.megatron.session import TTP, checked_int
from trainguard.core import ConfigError, ReplicaGroup

__all__ = [
    "ttp_init_controller", "ttp_start_controller", "ttp_init_processor", "ttp_start_processor",
    "ttp_register_save_ckpt_handler", "ttp_register_rename_handler", "ttp_set_ckpt_args",
    "ttp_start_updating_os", "ttp_end_updating_os", "ttp_to_persist",
    "tft_init_controller", "tft_start_controller", "tft_init_processor", "tft_start_processor",
    "tft_set_optimizer_replica", "tft_set_step_args", "tft_start_updating_os", "tft_end_updating_os",
    "tft_register_save_ckpt_handler", "tft_register_rename_handler", "tft_register_exit_handler",
    "tft_register_stop_handler", "tft_register_clean_handler", "tft_register_repair_handler",
    "tft_register_rollback_handler", "tft_register_rebuild_group_handler", "tft_exception_handler",
    "tft_get_repair_step", "tft_get_repair_type", "tft_is_reboot_node",
]


# ------------------------------------------------------------- controller
def ttp_init_controller(rank: int, world_size: int, replica: int, enable_local_copy: bool) -> int:
    """Check the controller's arguments (legacy TTP). Returns 0 (MindIO's success)."""
    checked_int("replica", replica, minimum=1)
    return tft_init_controller(rank, world_size, enable_local_copy)


def tft_init_controller(rank: int, world_size: int, enable_local_copy: bool, enable_arf: bool = False,
                        **_: Any) -> int:
    TTP.controller_args = {"rank": checked_int("rank", rank), "world_size": checked_int("world_size", world_size, minimum=1)}
    if rank >= world_size:
        raise ConfigError(f"rank {rank} is outside a world of {world_size}")
    return 0


def ttp_start_controller(ip: str, port: int) -> int:
    """Serve the job's controller at ``ip:port``, unless the launcher serves one."""
    return tft_start_controller(ip, port)


def tft_start_controller(bind_ip: str, port: int, enable_tls: bool = True, tls_info: str = "") -> int:
    runtime.serve_controller(bind_ip, port)
    return 0


# ------------------------------------------------------------- processor
def ttp_init_processor(rank: int, dp_ranks: Sequence[int], dp_size: int, world_size: int, replica: int,
                       enable_local_copy: bool) -> int:
    """Check this rank's arguments and remember its data-parallel group."""
    checked_int("rank", rank)
    checked_int("replica", replica, minimum=1)
    ranks = [checked_int("dp_ranks[]", r) for r in dp_ranks]
    if checked_int("dp_size", dp_size, minimum=1) != len(ranks):
        raise ConfigError(f"dp_size={dp_size} but dp_ranks has {len(ranks)} ranks: {ranks[:16]}")
    if rank not in ranks:
        raise ConfigError(f"rank {rank} is not in its own dp_ranks {ranks[:16]}")
    TTP.dp_ranks = tuple(ranks)
    return tft_init_processor(rank, world_size, enable_local_copy)


def tft_init_processor(rank: int, world_size: int, enable_local_copy: bool, enable_tls: bool = True,
                       tls_info: str = "", enable_uce: bool = True, enable_arf: bool = False, **_: Any) -> int:
    TTP.rank = checked_int("rank", rank)
    TTP.world_size = checked_int("world_size", world_size, minimum=1)
    if rank >= world_size:
        raise ConfigError(f"rank {rank} is outside a world of {world_size}")
    return 0


def ttp_start_processor(master_ip: str, port: int) -> int:
    """Connect this rank to the controller (the launcher's, else ``master_ip:port``)."""
    return tft_start_processor(master_ip, port)


def tft_start_processor(master_ip: str, port: int, **_: Any) -> int:
    runtime.start_processor(master_ip, port)
    return 0


def tft_set_optimizer_replica(rank: int, replica_info: Sequence[Mapping[str, Any]]) -> None:
    """This rank's replica groups, dense first then experts:
    ``[{"rank_list": [...], "replica_cnt": n, "replica_shift": s}, ...]``."""
    groups = []
    for i, info in enumerate(replica_info):
        missing = {"rank_list", "replica_cnt"} - set(info)
        if missing:
            raise ConfigError(f"replica_info[{i}] lacks {sorted(missing)}")
        group = ReplicaGroup(tuple(int(r) for r in info["rank_list"]), int(info["replica_cnt"]),
                             int(info.get("replica_shift", 0)))
        group.check()
        if rank not in group:
            raise ConfigError(f"rank {rank} is not in replica_info[{i}]['rank_list']")
        groups.append(group)
    if not groups:
        raise ConfigError("replica_info is empty")
    TTP.replicas = tuple(groups)


# ------------------------------------------------------------- handlers
def ttp_register_save_ckpt_handler(fn: Callable) -> None:
    """``fn(save_rank, step, rank_list, args)`` writes this rank's part of
    the dying-gasp checkpoint (``rank_list``: the ranks holding the same copy)."""
    TTP.register("save", fn, legacy=True)


def ttp_register_rename_handler(fn: Callable) -> None:
    """``fn(args)``, on one rank, makes the saved checkpoint final."""
    TTP.register("rename", fn, legacy=True)


def ttp_set_ckpt_args(args: Any) -> None:
    """What the save handler gets as ``args``, set after every iteration."""
    runtime.set_args(args)


tft_set_step_args = ttp_set_ckpt_args


def tft_register_save_ckpt_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(step, save_info, args, ctx)``; ``save_info`` is ``[{"type": kind, "ranks": [...]}]``."""
    TTP.register("save", fn, ctx)


def tft_register_rename_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(step, args)``."""
    TTP.register("rename", fn, ctx)


def tft_register_exit_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(args, ctx)`` runs before the process exits on the controller's order."""
    TTP.register("exit", fn, ctx)


def tft_register_stop_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(args, ctx)`` runs on the processor's thread when a STOP arrives
    (release what the training thread waits on)."""
    TTP.register("stop", fn, ctx)


def tft_register_clean_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(is_uce, args, ctx) -> 0 | 1 | 2``."""
    TTP.register("clean", fn, ctx)


def tft_register_repair_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(step, need_rebuild, error_ranks, repair_info, args, ctx)``."""
    TTP.register("repair", fn, ctx)


def tft_register_rollback_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(step, args, ctx)``: data, LR schedule and iteration back to ``step``."""
    TTP.register("rollback", fn, ctx)


def tft_register_rebuild_group_handler(fn: Callable, ctx: Any = None) -> None:
    """``fn(fault_ranks, args, ctx)``: fresh communication groups."""
    TTP.register("rebuild", fn, ctx)


# ------------------------------------------------------------- hot path
def ttp_start_updating_os(backup_step: int = -1) -> None:
    """The optimizer update starts (a STOP already received ends the step here)."""
    runtime.start_update()


def ttp_end_updating_os(step: int) -> None:
    """The update ended; the state is that of ``step`` completed updates."""
    runtime.end_update(step)


tft_start_updating_os = ttp_start_updating_os
tft_end_updating_os = ttp_end_updating_os


def tft_get_repair_step() -> int:
    """The step the last recovery rolled back to (-1 before any)."""
    return TTP.repair_step


def tft_get_repair_type() -> str:
    """The strategy of the last recovery ("" before any)."""
    return TTP.repair_type


def tft_is_reboot_node() -> bool:
    """True in a process started to replace a lost one."""
    return TTP.settings.join is not None


# ------------------------------------------------------------- the wrapper
def ttp_to_persist(func: Callable) -> Callable:
    """Run ``func``; on an exception, let the controller decide (see module doc)."""
    return runtime.persist(func)


tft_exception_handler = ttp_to_persist


def _route_torchrun() -> None:
    """MindIO's recipe adds ``import mindio_ttp.framework_ttp`` to the
    ``torchrun`` script before ``from torch.distributed.run import main``;
    naming this module there makes that ``main`` launch through ``trainguard
    run`` (as ``adapters-patch torchrun`` does). Only in a ``torchrun``
    process; training processes are untouched."""
    if os.path.basename(sys.argv[0]) != "torchrun" or os.environ.get("TRAINGUARD_DISABLE", "") not in ("", "0"):
        return
    import torch.distributed.run as torch_run

    from trainguard.launcher.run import main as trainguard_main

    def main(args: Sequence[str] | None = None) -> int:
        return trainguard_main(sys.argv[1:] if args is None else list(args))

    torch_run.main = main


_route_torchrun()


_UNSUPPORTED = {
    "tft_report_error": "reporting errors by code (raise the error in the function wrapped by @ttp_to_persist: it "
                        "is classified and reported)",
    "tft_set_dp_group_info": "separate DP-group registration (pass the groups with tft_set_optimizer_replica)",
    "tft_register_decrypt_handler": "TLS private-key decryption callbacks (the control plane authenticates "
                                    "with TRAINGUARD_TOKEN)",
    "tft_register_zit_upgrade_handler": "ZIT (zero-interrupt training) upgrades",
    "tft_register_stream_sync_handler": "device stream synchronisation callbacks",
    "tft_pause_train": "pausing training from the training script",
    "tft_notify_controller_dump": "dumps ordered from the training script",
    "tft_notify_controller_stop_train": "stops ordered from the training script",
    "tft_set_update_start_time": "update-window timestamps from the script",
    "tft_destroy_controller": "tearing the controller down from the script",
    "tft_destroy_processor": "tearing the processor down from the script",
}


def __getattr__(name: str) -> Any:
    if name in _UNSUPPORTED:
        raise AttributeError(f"{__name__}.{name} is not provided by trainguard: {_UNSUPPORTED[name]} is not "
                             f"supported")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (not a MindIO TTP/TFT name trainguard "
                         f"knows)")
