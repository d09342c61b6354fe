"""The ``trainguard`` torch.distributed backend: abortable groups for scripts
that create their own.

A script driven by the MindIO API (or anything built on megatron-core's
``parallel_state``) makes its collectives on groups it creates itself. When
one rank fails inside a step, the others sit in those collectives until the
backend's timeout, and a STOP cannot release them. Registered under the name
``trainguard``, every group such a script creates -- the default one and
each ``new_group`` -- is an :class:`~.process_group.AbortableProcessGroup`::

    import trainguard.adapters.torch.backend  # registers the name
    dist.init_process_group("trainguard")     # then megatron's groups are too

:func:`stop_all` releases every rank waiting in any of them (with
:class:`~trainguard.core.ForceStop`), and :func:`rebuild_all` replaces the
backend under each, in the order the groups were created (the order every
rank created them in, as torch requires), so in-place recovery can go on.

Each group runs gloo inside: collectives on CPU tensors, and on CUDA tensors
through host memory (ranks may share a GPU). ``TRAINGUARD_INNER_BACKEND=nccl``
runs NCCL inside instead (one GPU per rank; its communicator is aborted on
STOP) -- not yet exercised by trainguard's tests. The backend reads the
rank's :class:`~trainguard.core.RankConfig` when it makes its first group,
unless :func:`configure` handed it one already.
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from trainguard.core import ConfigError, RankConfig

from .device import CudaDevice, Device
from .process_group import AbortableProcessGroup

__all__ = ["NAME", "configure", "groups", "rebuild_all", "register", "stop_all"]

log = logging.getLogger("trainguard.torch")

NAME = "trainguard"
_groups: list[weakref.ref] = []
_lock = threading.Lock()
#: The rank's settings every group is made with (torch calls :func:`_create` with no room for them).
_settings: RankConfig | None = None


def configure(settings: RankConfig) -> None:
    """Make every later group with ``settings`` (their ``inner_backend``):
    for a caller that read the rank's settings already."""
    global _settings
    with _lock:
        _settings = settings


def _rank_settings() -> RankConfig:
    """The settings :func:`configure` gave, else the environment's, read once.

    Raises:
        ConfigError: an unknown or invalid ``TRAINGUARD_*`` variable.
    """
    global _settings
    with _lock:
        if _settings is None:
            _settings = RankConfig.from_env()
        return _settings


def _inner(kind: str) -> tuple[Callable[..., Any], Callable[[Any], None] | None]:
    if kind == "gloo":
        return Device().backend, None
    if kind == "nccl":
        import torch

        device = CudaDevice(torch.cuda.current_device())
        return (lambda store, rank, size, timeout: dist.ProcessGroupNCCL(store, rank, size, _nccl_opts(timeout))), \
            device.abort
    raise ConfigError(f"inner backend {kind!r}: choose gloo or nccl")


def _nccl_opts(timeout: timedelta) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> AbortableProcessGroup:
    factory, abort = _inner(_rank_settings().inner_backend)
    group = AbortableProcessGroup(store, rank, size, backend_factory=factory, timeout=timeout, abort=abort)
    with _lock:
        _groups.append(weakref.ref(group))
    return group


def register() -> None:
    """Make ``init_process_group("trainguard")`` available (idempotent)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])


def groups() -> list[AbortableProcessGroup]:
    """The live groups this process created through the backend, oldest first."""
    with _lock:
        alive = [g for g in (ref() for ref in _groups) if g is not None]
        _groups[:] = [weakref.ref(g) for g in alive]
    return alive


def stop_all(reason: str = "stopped by the controller") -> int:
    """Release every collective in flight on any trainguard group (safe from
    any thread); the number of groups stopped."""
    found = groups()
    for group in found:
        group.stop(reason)
    return len(found)


def rebuild_all(generation: int, cancelled: Callable[[], bool] = lambda: False) -> int:
    """Give every trainguard group a fresh backend for ``generation`` (every
    rank calls this with the same number); the number of groups rebuilt.

    Raises:
        ForceStop: ``cancelled()`` turned true before a rebuild finished.
    """
    found = groups()
    for group in found:
        group.rebuild(generation, cancelled, quiet=True)
    log.info("rank %d: %d process groups rebuilt (generation %d)", dist.get_rank(), len(found), generation)
    return len(found)


register()
