"""TaskD's manager API on trainguard's controller.

TaskD's ``manager.py``, run in the background on the pod of rank 0, works
unchanged with this import::

    from trainguard.compat.taskd.api import init_taskd_manager, start_taskd_manager

    init_taskd_manager({"job_id": os.getenv("MINDX_TASK_ID"), "node_nums": 2, "proc_per_node": 8})
    start_taskd_manager()

The manager is one :class:`trainguard.core.Controller` for the job's
``node_nums * proc_per_node`` ranks. Each training process reaches it through
its :class:`trainguard.torch.Guard`, pointed here by ``start_taskd_worker``.

**The job secret.** trainguard's control plane authenticates every message
with a per-job secret. ``trainguard run`` makes one itself; a TaskD manager
runs in one pod and its workers in others, and no file it could write would
reach them, so the manager refuses to start without ``TRAINGUARD_TOKEN``.
Put one random secret (``python -c 'import secrets;
print(secrets.token_hex(32))'``) in a Kubernetes Secret and export it as
``TRAINGUARD_TOKEN`` in every pod of the job, manager and workers alike.

**Where it listens.** Port 9601 (TaskD's ``taskd-port``), or
``TRAINGUARD_PORT``. Address: ``TRAINGUARD_HOST`` when set, else
``MASTER_ADDR`` (TaskD's recipe exports ``MASTER_ADDR=${POD_IP}`` before
starting the manager), else ``MS_SCHED_HOST`` (MindSpore), else loopback.

Differences from TaskD, on purpose: a bad config raises
:class:`~trainguard.core.ConfigError` naming every problem instead of
returning ``False``. After trainguard stopped the job (a dying-gasp
``dump``, or ``exit``) the manager waits for the relaunch on a fresh
controller, as TaskD's manager outlives process restarts; with
``start_taskd_manager(max_restarts=N)`` it raises :class:`TaskdJobStopped`
once N relaunches were used up.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
import time
from typing import Any, Mapping

from trainguard.core import (
    EXIT_AFTER_DUMP,
    EXIT_UNRECOVERABLE,
    ConfigError,
    Controller,
    ControllerConfig,
    ControllerState,
    TrainguardError,
    logs,
)

from trainguard.core.secret import shared_secret

from .. import taskd_port

__all__ = ["TaskdJobStopped", "TaskdManager", "init_taskd_manager", "start_taskd_manager"]

log = logging.getLogger("trainguard.compat.taskd")

#: The job's manager once ``init_taskd_manager`` succeeded (TaskD keeps a
#: module global of the same name).
taskd_manager: "TaskdManager | None" = None

_REQUIRED = {
    "job_id": "str, the job id (TaskD scripts pass os.getenv('MINDX_TASK_ID'))",
    "node_nums": "int >= 1, the number of nodes",
    "proc_per_node": "int >= 1, training processes per node",
}
#: TaskD switches that trainguard always has on.
_ALWAYS_ON = ("fault_recover", "taskd_enable")
#: Documented TaskD keys with no trainguard meaning, and what to use instead.
_UNSUPPORTED = {
    "plugin_dir": "TaskD plugins do not exist in trainguard; choose recover strategies with TRAINGUARD_STRATEGIES",
    "cluster_infos": "set the manager's address with TRAINGUARD_HOST and TRAINGUARD_PORT (or MASTER_ADDR)",
}
#: After the job stopped, how long the ranks get to receive their exit
#: command and leave before the controller goes away.
_LEAVE_S = 30.0
_POLL_S = 0.1


class TaskdJobStopped(TrainguardError):
    """trainguard stopped the job (dying-gasp ``dump`` or ``exit``) and no
    relaunch is allowed (``max_restarts`` used up).

    Attributes:
        exit_code: what the ranks exited with (75 after a dump: relaunching
            resumes from the checkpoint; 76 when nothing could be recovered).
        step: the step the dying-gasp checkpoint holds (``-1`` when none).
        status: the controller's final status (as ``trainguard status``).
    """

    def __init__(self, message: str, *, exit_code: int, step: int, status: dict) -> None:
        super().__init__(message)
        self.exit_code, self.step, self.status = exit_code, step, status


def _check_config(config: Any) -> tuple[str, int, int]:
    """``(job_id, node_nums, proc_per_node)`` from a TaskD manager config.

    Raises:
        ConfigError: listing every problem: not a dict, a missing key, a wrong
            type or value, an unsupported or unknown key.
    """
    example = "{'job_id': 'job-1', 'node_nums': 2, 'proc_per_node': 8}"
    if not isinstance(config, Mapping):
        raise ConfigError(f"init_taskd_manager takes a dict such as {example}, got {type(config).__name__}")
    problems = [f"missing {key!r} ({what})" for key, what in _REQUIRED.items() if key not in config]
    job_id = config.get("job_id")
    if "job_id" in config and (not isinstance(job_id, str) or not job_id.strip()):
        hint = " (is MINDX_TASK_ID set?)" if job_id is None else ""
        problems.append(f"'job_id' must be a non-empty str, got {job_id!r}{hint}")
    for key in ("node_nums", "proc_per_node"):
        value = config.get(key)
        if key in config and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems.append(f"{key!r} must be an int >= 1, got {type(value).__name__} {value!r}")
    known = [*_REQUIRED, *_ALWAYS_ON, *_UNSUPPORTED]
    for key in config:
        if key in _REQUIRED:
            continue
        if key in _ALWAYS_ON:
            if config[key] != "on":
                problems.append(f"{key!r}={config[key]!r}: trainguard's manager always recovers faults; only "
                                f"'on' is accepted (to run unprotected, do not start the manager)")
        elif key in _UNSUPPORTED:
            problems.append(f"{key!r} is a TaskD key trainguard does not support: {_UNSUPPORTED[key]}")
        else:
            close = difflib.get_close_matches(str(key), known, n=1)
            problems.append(f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                       f" (known: {', '.join(known)})"))
    if problems:
        raise ConfigError("invalid TaskD manager config: " + "; ".join(problems))
    return job_id, config["node_nums"], config["proc_per_node"]


def _bind_host(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The host to bind (``None``: let ``TRAINGUARD_HOST`` decide) and where it came from."""
    if environ.get("TRAINGUARD_HOST"):
        return None, "TRAINGUARD_HOST"
    for name in ("MASTER_ADDR", "MS_SCHED_HOST"):
        if environ.get(name):
            return environ[name], name
    return "127.0.0.1", "default"


class TaskdManager:
    """One job's manager: a controller per launch of its ranks.

    Args:
        job_id, node_nums, proc_per_node: TaskD's manager config.
        controller_config: bind address, strategies, timeouts.
        token: the job secret.
    """

    def __init__(self, *, job_id: str, node_nums: int, proc_per_node: int,
                 controller_config: ControllerConfig, token: str) -> None:
        self.job_id, self.node_nums, self.proc_per_node = job_id, node_nums, proc_per_node
        self.world_size = node_nums * proc_per_node
        self.config = controller_config
        self._token = token
        #: The final controller status of each launch of the job, oldest first.
        self.attempts: list[dict] = []
        self._stop = threading.Event()
        self._running = threading.Lock()

    @property
    def status(self) -> dict | None:
        """The final status of the latest launch (``None`` before the first ended)."""
        return self.attempts[-1] if self.attempts else None

    def stop(self) -> None:
        """Ask :meth:`serve` (on another thread) to stop; it returns ``False``."""
        self._stop.set()

    def serve(self, *, max_restarts: int | None = None) -> bool:
        """Serve the job until every rank finished.

        A launch that trainguard stopped (ranks exiting after a dying-gasp
        ``dump``, or ``exit``) is followed by a fresh controller on the same
        address for the relaunch (``torchrun --max-restarts``, a rescheduled
        pod), which resumes from the checkpoint. (Plain torchrun's own
        ``--max-restarts`` relaunch hangs in ``init_process_group`` on torch
        2.13, a torch bug ``trainguard run`` works around: relaunch the
        command, or launch with ``trainguard run``, whose agent brings its
        own controller and leaves this manager unused.)

        Args:
            max_restarts: relaunches to wait for after a stop; ``None``
                waits for as many as come (TaskD's manager lives as long as
                the job's pods).

        Returns:
            ``True`` when every rank finished; ``False`` when :meth:`stop`
            was called.

        Raises:
            TaskdJobStopped: the job was stopped and ``max_restarts``
                relaunches were used up.
            TrainguardError: the address could not be bound, or the manager
                is already serving.
        """
        if not self._running.acquire(blocking=False):
            raise TrainguardError("this TaskD manager is already serving")
        try:
            restarts = 0
            while True:
                state = self._serve_once()
                if state is None:
                    return False
                if state is ControllerState.FINISHED:
                    log.info("job %s finished: all %d ranks done", self.job_id, self.world_size)
                    return True
                stopped = self._stopped(self.status)
                if max_restarts is not None and restarts >= max_restarts:
                    raise stopped
                restarts += 1
                log.warning("%s; waiting for the relaunched ranks (launch %d) on %s", stopped, restarts + 1,
                            self.status["address"])
        finally:
            self._running.release()

    def _serve_once(self) -> ControllerState | None:
        """One launch: serve until FINISHED or EXITED and the ranks left
        (``None``: stopped by :meth:`stop`)."""
        controller = Controller(self.config, self.world_size, token=self._token)
        address = controller.start()
        try:
            log.info("TaskD manager (trainguard) for job %s listening on %s for %d ranks (%d nodes x %d)",
                     self.job_id, address, self.world_size, self.node_nums, self.proc_per_node)
            state = controller.state
            while state not in (ControllerState.FINISHED, ControllerState.EXITED):
                if self._stop.wait(_POLL_S):
                    self.attempts.append(dict(controller.snapshot(), address=address))
                    return None
                state = controller.state
            # Ranks told to exit need a moment to read the command and leave.
            deadline = time.monotonic() + _LEAVE_S
            while any(r["alive"] for r in controller.snapshot()["ranks"].values()) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            self.attempts.append(dict(controller.snapshot(), address=address))
            return state
        finally:
            controller.stop()

    def _stopped(self, status: dict) -> TaskdJobStopped:
        records = status.get("recoveries") or []
        last = records[-1] if records else {}
        reason = (status.get("episode") or {}).get("reason") or last.get("reason", "")
        if last.get("strategy") == "dump":
            return TaskdJobStopped(
                f"job {self.job_id} stopped after a dying-gasp checkpoint at step {last['step']} (ranks exit "
                f"with {EXIT_AFTER_DUMP}); relaunch it to resume from that step", exit_code=EXIT_AFTER_DUMP,
                step=last["step"], status=status)
        return TaskdJobStopped(f"job {self.job_id} was stopped by trainguard: {reason or 'no reason recorded'}",
                               exit_code=EXIT_UNRECOVERABLE, step=-1, status=status)


def init_taskd_manager(config: dict) -> bool:
    """Check TaskD's manager config and prepare the job's controller.

    Args:
        config: ``{"job_id": str, "node_nums": int, "proc_per_node": int}``.
            TaskD's ``fault_recover`` / ``taskd_enable`` are accepted when
            ``"on"`` (trainguard always recovers); ``plugin_dir`` and
            ``cluster_infos`` are refused with what to use instead.

    Returns:
        ``True`` (TaskD's success value).

    Raises:
        ConfigError: naming every problem with ``config``; ``TRAINGUARD_TOKEN``
            missing or weak; ``TRAINGUARD_PORT`` not a port; an unknown
            ``TRAINGUARD_*`` variable.
    """
    global taskd_manager
    job_id, node_nums, proc_per_node = _check_config(config)
    environ = os.environ
    token = shared_secret(environ, needed_by="the TaskD manager (its workers run in other pods)")
    host, source = _bind_host(environ)
    port = taskd_port(environ)
    controller_config = ControllerConfig.from_env(environ, job_id=job_id, host=host, port=port)
    if node_nums > 1 and controller_config.host in ("127.0.0.1", "localhost", "::1"):
        log.warning("the TaskD manager binds %s (%s): only this host can reach it; export MASTER_ADDR=${POD_IP} "
                    "(TaskD's recipe) or TRAINGUARD_HOST", controller_config.host, source)
    taskd_manager = TaskdManager(job_id=job_id, node_nums=node_nums, proc_per_node=proc_per_node,
                                 controller_config=controller_config, token=token)
    return True


def start_taskd_manager(*, max_restarts: int | None = None) -> bool:
    """Serve the job prepared by :func:`init_taskd_manager`; block until it
    finished (see :meth:`TaskdManager.serve`).

    Returns:
        ``True`` when every rank finished.

    Raises:
        TrainguardError: :func:`init_taskd_manager` was not called, or the
            port could not be bound.
        TaskdJobStopped: the job was stopped and will not be relaunched.
    """
    if taskd_manager is None:
        raise TrainguardError("start_taskd_manager() called before init_taskd_manager(config) succeeded")
    logs.setup("taskd manager")
    return taskd_manager.serve(max_restarts=max_restarts)
