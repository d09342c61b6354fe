"""MindCluster TaskD's Python API, mapped onto trainguard.

The package mirrors TaskD's import paths (``taskd.api``,
``taskd.api.taskd_manager_api``, ``taskd.api.taskd_worker_api``) under
``trainguard.compat.taskd``, so a TaskD script changes only its imports.

What each TaskD name does in trainguard:

``init_taskd_manager(config)``
    Checks ``{"job_id", "node_nums", "proc_per_node"}`` (every problem named
    in one :class:`~trainguard.core.ConfigError`) and the job secret
    ``TRAINGUARD_TOKEN``; prepares a controller for ``node_nums *
    proc_per_node`` ranks. Returns ``True``.
``start_taskd_manager()``
    Serves that controller on port 9601 (or ``TRAINGUARD_PORT``) at
    ``TRAINGUARD_HOST``, else ``MASTER_ADDR`` / ``MS_SCHED_HOST``, else
    127.0.0.1, and blocks until every rank finished (``True``). After a
    dying gasp it serves a fresh controller for the relaunch.
``init_taskd_worker(rank_id, upper_limit_of_disk_in_mb=5000, framework="pt")``
    Checks the rank and the profiling disk cap and keeps both; the cap
    becomes ``TRAINGUARD_PROFILING_CAP_MB`` at ``start_taskd_worker``.
``start_taskd_worker()``
    Sets ``TRAINGUARD_CONTROLLER`` to the manager (``MASTER_ADDR:9601``) so
    the :class:`trainguard.torch.Guard` built next connects to it: the Guard
    is the per-rank link.
``destroy_taskd_worker()``
    Forgets the worker and restores ``TRAINGUARD_CONTROLLER``.

Not provided: TaskD's proxy and agent (``init_taskd_proxy``,
``init_taskd_agent``), whose jobs (one upstream stream per node, restarting
single processes) ``trainguard run`` does with its relay and elastic agent.
The worker's lightweight profiling is the Guard's markers
(:mod:`trainguard.core.profiling`), pointed at TaskD's directories by
``start_taskd_worker``; ``trainguard slow-nodes`` reads them.

How a TaskD deployment maps, pod by pod: the pod of rank 0 runs
``manager.py`` in the background (TaskD's ``export MASTER_ADDR=${POD_IP};
python manager.py &``); every pod exposes port 9601 and has the same
``TRAINGUARD_TOKEN`` (a random secret, best from a Kubernetes Secret); the
training processes, launched by plain ``torchrun``, call
``init_taskd_worker``/``start_taskd_worker`` and then build a Guard.
"""

from __future__ import annotations

from typing import Mapping

from trainguard.core import ConfigError

__all__ = ["TASKD_PORT", "destroy_taskd_worker", "init_taskd_manager", "init_taskd_worker", "start_taskd_manager",
           "start_taskd_worker", "taskd_port"]

#: The names TaskD's docs import from ``taskd.api``, also importable from this package (where the
#: README and docs/megatron.md name them); loaded on first use, as ``.api`` imports this module.
_API = {"init_taskd_manager", "start_taskd_manager", "init_taskd_worker", "start_taskd_worker", "destroy_taskd_worker"}


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: The port TaskD's manager listens on (the job YAML's ``taskd-port``).
TASKD_PORT = 9601


def taskd_port(environ: Mapping[str, str]) -> int:
    """The manager's port: ``TRAINGUARD_PORT`` when set, else TaskD's 9601.

    Raises:
        ConfigError: ``TRAINGUARD_PORT`` is not a port number in [1, 65535]
            (0, "any free port", cannot work: workers find the manager at a
            port known in advance).
    """
    raw = environ.get("TRAINGUARD_PORT", "").strip()
    if not raw:
        return TASKD_PORT
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise ConfigError(f"TRAINGUARD_PORT={raw!r} is not a port in [1, 65535]; TaskD workers find the "
                          f"manager at a fixed port (TaskD's is {TASKD_PORT})")
    return int(raw)
