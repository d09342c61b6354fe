"""A new process joins a running job (recover-in-place, recover).

The new process runs the user's script from the top: ``init_process_group``
builds the default group with every rank, ``DistributedDataParallel(model)``
verifies parameter shapes across ranks and broadcasts rank 0's parameters,
then the :class:`~.guard.Guard` builds trainguard's process group. The
survivors are paused in a recovery, so they do the same collectives on their
side (:func:`meet`): they build the new default group with it on the store
its agent serves, repeat DDP's start-up collectives into scratch copies
(a freshly started rank 0 must not overwrite trained parameters), and
rebuild trainguard's group at the generation the new process builds.

The start-up collectives are DDP's own (torch 2.13's
``_verify_param_shape_across_processes`` and ``_sync_module_states``). A
script that runs other collectives on the default group before creating
the Guard cannot be joined: the join times out and the controller falls
back to its next strategy.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.utils import _sync_params_and_buffers, _verify_param_shape_across_processes

from trainguard.core import ForceStop, RecoveryError

from .process_group import run_cancellable

if TYPE_CHECKING:
    from .comm import TorchComm

__all__ = ["JOIN_ENV", "joining", "meet"]

JOIN_ENV = "TRAINGUARD_JOIN"


def joining(raw: str | None) -> dict | None:
    """What this process joins, when its agent started it as a replacement
    (``raw``: :attr:`~trainguard.core.RankConfig.join`, ``TRAINGUARD_JOIN``)."""
    if not raw:
        return None
    try:
        join = json.loads(raw)
        return {"generation": int(join["generation"]), "step": int(join["step"])}
    except (ValueError, KeyError, TypeError) as e:
        raise RecoveryError(f"{JOIN_ENV}={raw!r} is malformed ({e}); it is set by trainguard's node agent") from None


def _default_group(prefix: Any, rank: int, size: int, timeout: timedelta, device: torch.device) -> dist.ProcessGroup:
    """The survivor's side of the new process's ``init_process_group("gloo")``:
    group ``0`` under ``default_pg`` (``prefix``), one gloo backend on the
    store under ``cpu/``, for CPU tensors and, on a GPU, CUDA tensors too
    (as torch registers it for every device gloo serves)."""
    backend_name = dist.get_backend()
    if device.type not in ("cpu", "cuda") or backend_name != "gloo":
        raise RecoveryError(f"joining a new process needs gloo as the default group's backend (on CPU or CUDA); "
                            f"this job runs {backend_name} on {device.type}")
    group = dist.ProcessGroup(prefix, rank, size)
    backend = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, size, timeout)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    for kind in {"cpu", device.type}:
        group._register_backend(torch.device(kind), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def _mirror_ddp(ddp: torch.nn.parallel.DistributedDataParallel, group: dist.ProcessGroup) -> None:
    """DDP's start-up collectives, with this rank's parameters copied first."""
    parameters, _ = ddp._build_params_for_reducer()
    _verify_param_shape_across_processes(group, parameters)
    ignore = ddp.parameters_to_ignore
    states = [p.detach().clone() for n, p in ddp.module.named_parameters() if n not in ignore]
    # torch 2.13 names it forward_sync_buffers (broadcast_buffers is its alias); before, broadcast_buffers
    # (torch 2.11 on an H200 had no forward_sync_buffers: the join failed on it)
    sync_buffers = getattr(ddp, "forward_sync_buffers", None)
    if ddp.broadcast_buffers if sync_buffers is None else sync_buffers:
        states += [b.detach().clone() for n, b in ddp.module.named_buffers() if n not in ignore]
    _sync_params_and_buffers(group, states, ddp.broadcast_bucket_size, 0)


def meet(comm: "TorchComm", generation: int, address: str, cancelled: Callable[[], bool],
         ranks: Sequence[int]) -> None:
    """Survivor side of a join: meet the new processes on ``address``
    (``host:port``) and rebuild trainguard's group over ``ranks`` at
    ``generation`` there (all of them again after elastic training).

    Runs on a helper thread so that a new STOP (``cancelled()``) abandons
    a join whose new process never arrives.

    Raises:
        ForceStop: cancelled before the join finished.
        RecoveryError: the store is unreachable or the job's device type
            cannot be joined.
    """
    host, _, port = address.rpartition(":")
    timeout = comm.process_group.timeout

    def build() -> tuple[Any, dist.ProcessGroup]:
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        # What init_process_group keeps as the default group's store, and
        # the Guard builds its own group on.
        store = dist.PrefixStore("0/", dist.PrefixStore("default_pg", client))
        default = _default_group(store, comm.rank, comm.world_size, timeout, comm.device.torch_device)
        if comm.ddp is not None:
            _mirror_ddp(comm.ddp, default)
        return store, default

    try:
        store, default = run_cancellable(build, cancelled, f"join of generation {generation}")
    except ForceStop:
        raise
    except Exception as e:
        raise RecoveryError(f"could not meet the new process on {address}: {e}") from e
    # Kept alive: the new process's default group talks to it.
    comm.joined_default_group = default
    if tuple(ranks) != comm.process_group.members:
        comm.regroup(ranks, generation, cancelled, store=store)
    else:
        comm.process_group.rebuild(generation, cancelled=cancelled, store=store)
