"""TaskD's worker API, for the training processes.

TaskD's worker runs inside each training process, after the distributed
environment is up::

    from trainguard.compat.taskd.api.taskd_worker_api import init_taskd_worker, start_taskd_worker

    init_taskd_worker(dist.get_rank(), 5000)
    start_taskd_worker()
    guard = Guard(model, opt, ...)        # trainguard.torch.Guard: build it after start_taskd_worker

**What is mapped now.** In trainguard the per-rank link to the manager is
the :class:`trainguard.torch.Guard`, which connects to the controller named
by ``TRAINGUARD_CONTROLLER`` with the secret ``TRAINGUARD_TOKEN``.
:func:`start_taskd_worker` sets ``TRAINGUARD_CONTROLLER`` to the manager
started by ``start_taskd_manager``: ``MASTER_ADDR`` (TaskD's PyTorch recipe
exports ``MASTER_ADDR=${POD_IP}`` in the manager's pod) or ``MS_SCHED_HOST``
(``framework="ms"``), at port 9601 or ``TRAINGUARD_PORT``. When
``TRAINGUARD_CONTROLLER`` is already set (the job runs under ``trainguard
run``, or you set it) it is left alone. Without a Guard nothing connects:
these calls alone protect nothing.

**Lightweight profiling.** TaskD's worker is also the per-rank agent of
lightweight profiling. In trainguard the Guard records the markers
(:mod:`trainguard.core.profiling`); :func:`start_taskd_worker` points it at
TaskD's places unless ``TRAINGUARD_PROFILING_*`` already say otherwise:
records under ``/user/cluster-info/profiling`` when that directory exists
(TaskD's mount), the switch at
``/user/cluster-info/datatrace-config/profilingSwitch`` when that file
exists, and the disk cap ``upper_limit_of_disk_in_mb``.

Differences from TaskD, on purpose: bad arguments raise
:class:`~trainguard.core.ConfigError` naming the problem instead of
returning ``False``. ``framework="ms"`` is accepted, but trainguard has no
MindSpore adapter yet, so nothing in a MindSpore process reads the address.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Mapping

from trainguard.core import ConfigError, TrainguardError, check_env
from trainguard.core.secret import shared_secret

from .. import taskd_port

__all__ = ["WorkerSettings", "destroy_taskd_worker", "init_taskd_worker", "manager_address", "start_taskd_worker"]

log = logging.getLogger("trainguard.compat.taskd")

#: Where each framework's processes learn the manager's host (TaskD's own).
MANAGER_HOST_ENV = {"pt": "MASTER_ADDR", "ms": "MS_SCHED_HOST"}


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """What ``init_taskd_worker`` was given.

    ``upper_limit_of_disk_in_mb`` is the profiling disk cap (everything
    under the profiling directory), handed to the Guard's profiling.
    """

    rank: int
    upper_limit_of_disk_in_mb: int
    framework: str


#: This process's worker once ``init_taskd_worker`` succeeded.
taskd_worker: WorkerSettings | None = None
#: ``TRAINGUARD_CONTROLLER`` as it was before ``start_taskd_worker`` (restored by destroy).
_previous_controller: tuple[str | None] | None = None


def _int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    return value


def init_taskd_worker(rank_id: int, upper_limit_of_disk_in_mb: int = 5000, framework: str = "pt") -> bool:
    """Check and keep this process's TaskD worker settings.

    Args:
        rank_id: the global rank of this process (``dist.get_rank()``).
        upper_limit_of_disk_in_mb: profiling disk cap in MB (see the
            module docstring; 0 leaves trainguard's default).
        framework: ``"pt"`` (PyTorch) or ``"ms"`` (MindSpore).

    Returns:
        ``True`` (TaskD's success value).

    Raises:
        ConfigError: a rank or cap that is not an int >= 0, an unknown
            framework.
    """
    global taskd_worker
    rank = _int("rank_id", rank_id)
    cap = _int("upper_limit_of_disk_in_mb", upper_limit_of_disk_in_mb)
    if framework not in MANAGER_HOST_ENV:
        raise ConfigError(f"framework must be one of {sorted(MANAGER_HOST_ENV)}, got {framework!r}")
    taskd_worker = WorkerSettings(rank=rank, upper_limit_of_disk_in_mb=cap, framework=framework)
    return True


def manager_address(framework: str = "pt", environ: Mapping[str, str] | None = None) -> str:
    """``host:port`` of the TaskD manager, from TaskD's environment.

    Raises:
        ConfigError: the host variable is unset, or ``TRAINGUARD_PORT`` is
            not a port.
    """
    environ = os.environ if environ is None else environ
    name = MANAGER_HOST_ENV[framework]
    host = environ.get(name, "").strip()
    if not host:
        raise ConfigError(f"cannot find the TaskD manager: {name} is not set. Set it to the address of the pod "
                          f"running start_taskd_manager (TaskD's recipe: export {name}=${{POD_IP}} there), or set "
                          f"TRAINGUARD_CONTROLLER=host:port")
    port = taskd_port(environ)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_rank(rank: int) -> None:
    """Refuse a rank that disagrees with torch.distributed, when it is up
    (torch is only looked at if the script already imported it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_rank() != rank:
        raise ConfigError(f"init_taskd_worker was given rank {rank} but torch.distributed says this process is "
                          f"rank {dist.get_rank()}; pass dist.get_rank()")


def start_taskd_worker() -> bool:
    """Point this process's Guard at the TaskD manager.

    Sets ``TRAINGUARD_CONTROLLER`` (unless already set) so that the
    :class:`trainguard.torch.Guard` built afterwards connects to the manager
    with ``TRAINGUARD_TOKEN``. Connecting happens in the Guard, which waits
    up to 60 s for the manager to come up.

    Returns:
        ``True`` (TaskD's success value).

    Raises:
        TrainguardError: :func:`init_taskd_worker` was not called.
        ConfigError: no manager address, no ``TRAINGUARD_TOKEN``, a rank
            that disagrees with ``torch.distributed``, an unknown
            ``TRAINGUARD_*`` variable.
    """
    global _previous_controller
    if taskd_worker is None:
        raise TrainguardError("start_taskd_worker() called before init_taskd_worker(rank) succeeded")
    check_env()
    if taskd_worker.framework == "pt":
        _check_rank(taskd_worker.rank)
    # the secret the manager was started with; the Guard reads it from TRAINGUARD_TOKEN
    os.environ["TRAINGUARD_TOKEN"] = shared_secret(needed_by="a TaskD worker (its manager runs in another pod)")
    if _previous_controller is None:
        _previous_controller = (os.environ.get("TRAINGUARD_CONTROLLER"),)
    (outside,) = _previous_controller
    _point_profiling(taskd_worker, os.environ)
    level = logging.INFO if taskd_worker.rank == 0 else logging.DEBUG
    if outside:
        log.log(level, "TRAINGUARD_CONTROLLER is already set (%s); the Guard connects there, not to a TaskD "
                "manager", outside)
        return True
    os.environ["TRAINGUARD_CONTROLLER"] = address = manager_address(taskd_worker.framework)
    log.log(level, "the Guard will connect to the TaskD manager at %s", address)
    return True


#: Where TaskD's containers mount the profiling directory and the switch ConfigMap.
TASKD_PROFILING_DIR = "/user/cluster-info/profiling"
TASKD_SWITCH = "/user/cluster-info/datatrace-config/profilingSwitch"


def _point_profiling(settings: WorkerSettings, environ) -> None:
    """TaskD's profiling places and cap, where the environment names none."""
    if settings.upper_limit_of_disk_in_mb > 0:
        environ.setdefault("TRAINGUARD_PROFILING_CAP_MB", str(settings.upper_limit_of_disk_in_mb))
    if not environ.get("TRAINGUARD_PROFILING_DIR") and os.path.isdir(TASKD_PROFILING_DIR):
        environ["TRAINGUARD_PROFILING_DIR"] = TASKD_PROFILING_DIR
    if not environ.get("TRAINGUARD_PROFILING_SWITCH") and os.path.exists(TASKD_SWITCH):
        environ["TRAINGUARD_PROFILING_SWITCH"] = TASKD_SWITCH


def destroy_taskd_worker() -> bool:
    """Forget this process's worker and restore ``TRAINGUARD_CONTROLLER``.

    The Guard's own session ends with ``guard.close()``.

    Returns:
        ``True`` (TaskD's success value).

    Raises:
        TrainguardError: :func:`init_taskd_worker` was not called.
    """
    global taskd_worker, _previous_controller
    if taskd_worker is None:
        raise TrainguardError("destroy_taskd_worker() called before init_taskd_worker(rank) succeeded")
    if _previous_controller is not None:
        (previous,) = _previous_controller
        if previous is None:
            os.environ.pop("TRAINGUARD_CONTROLLER", None)
        else:
            os.environ["TRAINGUARD_CONTROLLER"] = previous
    taskd_worker, _previous_controller = None, None
    return True
