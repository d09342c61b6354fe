"""Restarting a node's whole group in warm standby processes.

After a dump the survivors exit (75) and torch's agent, while restarts are
left, starts the group again: every worker pays the interpreter start and
``import torch`` again (seconds; most of a restart on a small job), then
meets the others and loads the state the job resumes from (from the node's
snapshots in memory, which outlive the workers).

:class:`WarmGroup` keeps standbys (:mod:`.standby`: torch imported, at
idle priority while it imports) while restarts are left, as many as
:meth:`WarmGroup.keep` says, hands one to a restarted rank
(:meth:`WarmGroup.take`), and :meth:`WarmGroup.start` hands the next
round's workers to them as torch's own process context, so torch's
monitoring, signals and shutdown cover them like workers it started. A
round is started cold, as torch starts it, when there are not enough
standbys, when a worker's output goes to files (``--redirects``/``--tee``:
a standby's output is the agent's), or when the command is not ``python -u
script`` (``--no-python``, other interpreter flags).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from string import Template
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.utils import macros

from .standby import command_for, handler_for, new_standby

__all__ = ["WarmGroup", "script_error"]

log = logging.getLogger("trainguard.launcher")

#: The variables torch's agent sets per worker and round (the rest of a
#: worker's environment is the same in every round of one agent).
_ROUND_VARS = ("RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE",
               "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")


def script_error(status: dict) -> str | None:
    """Why the group must not be restarted after the job's last recovery
    (``None``: it may): a dump that followed the script's own exception,
    which a restart would meet again (a restart loop; exit 75 instead: fix
    the script and relaunch)."""
    records = status.get("recoveries") or []
    if records and records[-1]["strategy"] == "dump" and records[-1]["fault"] == "unknown":
        return (f"the dump followed an exception of the script itself (rank {records[-1]['rank']}: "
                f"{records[-1]['message'][:200]}), which a restart would meet again")
    return None


class WarmGroup:
    """Standby processes for a restart of the node's whole group."""

    def __init__(self) -> None:
        self._pool: list[subprocess.Popen] = []

    def fill(self, count: int) -> None:
        """Keep ``count`` standbys starting or waiting (they import torch now)."""
        self._pool = [p for p in self._pool if p.poll() is None]
        while len(self._pool) < count:
            self._pool.append(new_standby())

    def keep(self, workers: int, *, dumping: bool, ranks_up: bool, for_a_rank: bool) -> None:
        """Fill the pool for what may come: one standby per worker while a
        dump runs (the group restart follows, and the workers leave the CPU
        to the imports meanwhile); else, once every rank of the node is up
        (``ranks_up``: an import slowed the workers starting beside it, idle
        priority or not), one for a restarted rank (``for_a_rank``) or one
        per worker where a dump and the group restart are the only way back."""
        if dumping:
            self.fill(workers)
        elif ranks_up:
            self.fill(1 if for_a_rank else workers)

    def take(self) -> subprocess.Popen | None:
        """A waiting standby, out of the pool, for one restarted rank
        (``None``: none is there)."""
        self._pool = [p for p in self._pool if p.poll() is None]
        return self._pool.pop(0) if self._pool else None

    def start(self, previous: Any, worker_group: Any, restart_count: int, logs_specs: Any,
              log_line_prefix_template: str | None) -> SubprocessContext | None:
        """The round's workers, started in standbys: torch's process context
        holding them, or ``None`` (start cold) -- see the module's notes.

        Args:
            previous: the last round's process context (its environments
                hold what this agent gives every worker).
            worker_group: this round's group (ranks, store address).
            restart_count: torch's restart count of this round.
        """
        spec = worker_group.spec
        n = spec.local_world_size
        self._pool = [p for p in self._pool if p.poll() is None]
        envs_before = getattr(previous, "envs", None)
        args = {w.local_rank: tuple(macros.substitute(list(spec.args), str(w.local_rank)))
                for w in worker_group.workers}
        if (len(self._pool) < n or not isinstance(previous, SubprocessContext) or not envs_before
                or len(envs_before) != n or any(command_for(spec.entrypoint, a) is None for a in args.values())
                or any(previous.stdouts.get(lr) or previous.stderrs.get(lr) for lr in range(n))):
            return None
        envs = {}
        for w in worker_group.workers:
            env = {k: v for k, v in envs_before[w.local_rank].items() if k != "TORCHELASTIC_ERROR_FILE"}
            env.update(RANK=str(w.global_rank), GROUP_RANK=str(worker_group.group_rank),
                       ROLE_RANK=str(w.role_rank), LOCAL_WORLD_SIZE=str(n), WORLD_SIZE=str(w.world_size),
                       GROUP_WORLD_SIZE=str(worker_group.group_world_size), ROLE_WORLD_SIZE=str(w.role_world_size),
                       MASTER_ADDR=worker_group.master_addr, MASTER_PORT=str(worker_group.master_port),
                       TORCHELASTIC_RESTART_COUNT=str(restart_count),
                       TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
                       TORCHELASTIC_RUN_ID=spec.rdzv_handler.get_run_id())
            envs[w.local_rank] = env
        prefixes = None
        if log_line_prefix_template:
            prefixes = {w.local_rank: Template(log_line_prefix_template).safe_substitute(
                role_name=spec.role, rank=w.global_rank, local_rank=w.local_rank) for w in worker_group.workers}
        pool, self._pool = self._pool[:n], self._pool[n:]
        context = _WarmContext(pool, spec.role, spec.entrypoint, args, envs, logs_specs, prefixes)
        try:
            context.start()
        except Exception:  # noqa: BLE001 - a cold start is the way out
            log.exception("could not start the group in its standby processes; starting it cold")
            context.close()
            return None
        log.info("restarted ranks %s in warm standby processes (pids %s)",
                 sorted(w.global_rank for w in worker_group.workers), sorted(context.pids().values()))
        return context

    def close(self) -> None:
        for p in self._pool:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._pool = []


class _WarmContext(SubprocessContext):
    """torch's process context, its workers taken from standbys."""

    def __init__(self, pool: list[subprocess.Popen], *args: Any) -> None:
        self._standbys = pool
        super().__init__(*args)

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the workers were started already")
        handlers = {}
        for local_rank, standby in zip(range(self.nprocs), self._standbys):
            argv, module = command_for(self.entrypoint, self.args[local_rank])
            env = {**os.environ, **self.envs[local_rank]}
            standby.stdin.write(json.dumps({"env": env, "argv": argv, "module": module}) + "\n")
            standby.stdin.close()
            handlers[local_rank] = handler_for(standby, local_rank)
        self.subprocess_handlers = handlers
